"""Training throughput per topology: drafter training tokens/s and target hidden-state tokens/s.

    python benchmarks/train_throughput.py                  # table on stdout, JSON in benchmarks/results/
    python benchmarks/train_throughput.py --steps 20 --out my.json

On the CPU (gloo) it runs the real training loop (``dflash.train.train_drafter``)
under torchrun on a random Llama target with hidden states computed online:
one process; 2 processes colocated; 8 processes split 5 + 3. With CUDA it
measures one GPU colocated instead, compiled flex_attention against SDPA with
a dense mask, with peak GPU memory.

Training tokens/s counts sample tokens (no padding) of the global batches per
second, after the first step (which compiles and warms up, reported apart).
Target tokens/s is the throughput of the target's forward passes, summed over
the ranks that run them (their capacity; they may wait on training).
Each measurement runs in fresh processes, so that compile caches and memory
statistics of one never leak into the next.

First it prints the FLOP balance of a split (``dflash.cost``): the target's pass
and the drafter's training per sample of ``config/gpu-8x.yaml`` (Qwen3-8B, a
5-layer drafter, 512 anchors x 16) and the target ranks that balance them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Random targets of a size each device turns over in seconds per step.
PRESETS = {
    "cpu": {
        "target": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        "lengths": (96, 320),  # sample lengths, spread evenly between the two
        "train": {"batch_size": 8, "max_anchors": 16, "compile": False, "precision": "fp32"},
    },
    "cuda": {
        "target": dict(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=128
        ),
        "lengths": (512, 2048),
        "train": {"batch_size": 8, "max_anchors": 256, "compile": True, "precision": "bf16"},
    },
}
# config/gpu-8x.yaml: Qwen3-8B (its published config.json) and the drafter and training it configures.
QWEN3_8B = dict(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936)
GPU_8X = {"drafter_layers": 5, "features": 5, "block_size": 16, "train": {"max_anchors": 512, "sample_loss_positions": False}, "world": 8}


def flop_balance(tokens_per_sample: tuple[int, ...] = (1000, 1500, 2048)) -> list[dict]:
    """The FLOPs per sample either side of config/gpu-8x.yaml's split, and the target ranks that balance them."""
    from dflash.config import TrainConfig
    from dflash.cost import Shape, balanced_target_ranks, drafter_flops, target_flops

    target = Shape(**QWEN3_8B)
    drafter = Shape(**QWEN3_8B | {"layers": GPU_8X["drafter_layers"]})
    cfg = TrainConfig(**GPU_8X["train"])
    rows = []
    for tokens in tokens_per_sample:
        t = target_flops(target, tokens)
        d = drafter_flops(drafter, GPU_8X["features"] * target.hidden, tokens, cfg, GPU_8X["block_size"])
        rows.append(
            {
                "tokens": tokens,
                "target_tflop": round(t / 1e12, 1),
                "drafter_tflop": round(d / 1e12, 1),
                "balanced_target_ranks_of_8": balanced_target_ranks(GPU_8X["world"], t, d),
            }
        )
    return rows


CPU_TOPOLOGIES = [
    ("1 process", {"kind": "colocated", "nproc_per_node": 1}),
    ("2 colocated", {"kind": "colocated", "nproc_per_node": 2}),
    ("8 split 5+3", {"kind": "split", "nproc_per_node": 8, "target_ranks": 5}),
    ("8 split 2+6", {"kind": "split", "nproc_per_node": 8, "target_ranks": 2}),
]


def worker(spec: dict) -> None:
    """One rank (started by torchrun, or alone): train ``spec['steps']`` steps; rank 0 writes the measurement."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash import distributed
    from dflash.config import DrafterConfig, TopologyConfig, TrainConfig, parse_section
    from dflash.preflight.synthetic import synthetic_samples
    from dflash.run import RunPaths, RunSettings
    from dflash.target import Target
    from dflash.train import train_drafter

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    preset = PRESETS[spec["device"]]
    topology = parse_section(TopologyConfig, spec["topology"] | {"device": spec["device"]}, "topology")
    layout = distributed.init(topology)
    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**preset["target"], max_position_embeddings=4096)).to(layout.device, dtype)
    target = Target.from_model(model, source=f"random-llama-{preset['target']['hidden_size']}")
    low, high = preset["lengths"]
    count = preset["train"]["batch_size"] * spec["steps"]
    samples = synthetic_samples([low + (high - low) * i // max(1, count - 1) for i in range(count)], preset["target"]["vocab_size"] - 1)
    train = parse_section(
        TrainConfig, preset["train"] | {"epochs": 1, "hidden_states": "online", "attention_backend": spec["backend"], "log_every": spec["steps"]}, "train"
    )
    drafter = parse_section(DrafterConfig, {"num_hidden_layers": 1, "num_context_features": 3, "mask_token_id": preset["target"]["vocab_size"] - 1}, "drafter")
    if layout.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(layout.device)
    scratch = Path(spec["scratch"])
    paths = RunPaths(hidden_cache=scratch / "hidden", checkpoints=scratch / "checkpoints", drafter=scratch / "drafter", metrics=scratch / "metrics.csv")
    result = train_drafter(target, samples, RunSettings(drafter, train), paths, layout=layout)
    peak = torch.cuda.max_memory_allocated(layout.device) / 2**30 if layout.device.type == "cuda" else None
    peaks = distributed.gather_to_main(peak, layout) if layout.is_drafter else None
    if layout.is_main:
        measured = {
            "processes": layout.world,
            "drafter_ranks": layout.drafter_world,
            "steps": result.steps,
            "train_tokens_per_s": round(result.tokens_per_second, 1),
            "target_tokens_per_s": round(result.target_tokens_per_second, 1),
            "first_step_s": round(result.first_step_seconds, 2),
            "peak_gpu_memory_gib": max(peaks) if peak is not None else None,
        }
        Path(spec["result"]).write_text(json.dumps(measured))
    distributed.shutdown(layout)


def measure(label: str, topology: dict, device: str, backend: str, steps: int) -> dict:
    """One measurement in fresh processes."""
    nproc = topology.get("nproc_per_node", 1)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"topology": topology, "device": device, "backend": backend, "steps": steps, "scratch": tmp, "result": str(Path(tmp) / "result.json")}
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        start = time.perf_counter()
        done = subprocess.run([*launcher, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{label} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return (
            {"topology": label, "device": device, "attention": backend}
            | json.loads(Path(spec["result"]).read_text())
            | {"wall_s": round(time.perf_counter() - start, 1)}
        )


def table(rows: list[dict]) -> str:
    columns = ["topology", "device", "attention", "processes", "train_tokens_per_s", "target_tokens_per_s", "first_step_s", "peak_gpu_memory_gib", "wall_s"]
    cells = [columns] + [["-" if row[c] is None else str(row[c]) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per measurement (the first is not timed)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default: benchmarks/results/train_throughput_<device>.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    balance = flop_balance()
    print("FLOPs per sample, config/gpu-8x.yaml (Qwen3-8B target, 5-layer drafter, 512 anchors x 16):")
    for row in balance:
        print(
            f"  {row['tokens']} tokens: target {row['target_tflop']} TFLOP, drafter {row['drafter_tflop']} TFLOP -> {row['balanced_target_ranks_of_8']} target ranks of 8"
        )
    if torch.cuda.is_available():
        device = "cuda"
        plan = [("1 GPU colocated", {"kind": "colocated"}, "flex"), ("1 GPU colocated", {"kind": "colocated"}, "sdpa")]
    else:
        device = "cpu"
        plan = [(label, topology, "sdpa") for label, topology in CPU_TOPOLOGIES]
    rows = []
    for label, topology, backend in plan:
        rows.append(measure(label, topology, device, backend, args.steps))
        print(f"measured {label} ({backend}): {rows[-1]['train_tokens_per_s']} training tokens/s", file=sys.stderr)
    environment = {"torch": torch.__version__, "cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    out = args.out or ROOT / "benchmarks" / "results" / f"train_throughput_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment, "preset": PRESETS[device], "flop_balance": balance, "rows": rows}, indent=2) + "\n")
    print(table(rows))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
