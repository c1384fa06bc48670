"""Preflight stage ``warmup_cache``: compile every shape of the drafter's training step into a cache training starts from.

One job per drafter device (``cpu``, ``cuda0``, ...). Inductor specialises a
compiled graph on size thresholds (its CPU reductions, say, switch kernels
at 4096 elements), so one graph covers only a range of batch shapes, and a
cache warmed on other shapes than training's serves nothing. The run's
batches take few shapes (rows are padded to ``train.pad_multiple``), and
``dflash.batch.step_shapes`` lists every one from the samples. The job
empties the cache directory and runs the exact training step
(``dflash.step.compile_drafter`` and ``train_step``) on each shape in a
fresh process, on the device index the rank trains on, filling inductor's
FX-graph and AOT-autograd caches. A second fresh process then runs every
shape again, as training will, and must load every graph from the cache:
the verdict fails otherwise. ``cold_seconds`` and ``warm_seconds`` are the
two processes' compile times (torch's own compile timers).

Training points its compile cache at the warmed directory
(``dflash.compile_cache.use_warm_cache``) before it compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dflash.batch import step_shapes
from dflash.compile_cache import compile_cache_hits, use_compile_cache
from dflash.config import DrafterConfig, TopologyConfig, TrainConfig, cpu_threads, parse_section
from dflash.errors import PreflightError
from dflash.preflight.gate import device_index
from dflash.preflight.verdict import Verdict

TARGET_SPEEDUP = 5.0
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class WarmupVerdict(Verdict):
    stage: str = "warmup_cache"
    device: str = "cpu"  # the job's device wildcard
    cache_dir: str = ""
    shapes: list[list[int]] = field(default_factory=list)  # every (rows, padded length) of the run's batches, warmed
    cold_seconds: float = 0.0  # compiling every shape in a fresh process on an empty cache
    warm_seconds: float = 0.0  # the same in a second fresh process on the warm cache
    speedup: float = 0.0  # cold_seconds / warm_seconds
    target_speedup: float = TARGET_SPEEDUP
    cold_first_step_seconds: float = 0.0  # compile + compute of the first shape's step
    warm_first_step_seconds: float = 0.0  # what training's first step should take
    cold_process_seconds: float = 0.0  # whole processes: interpreter, imports, target, steps
    warm_process_seconds: float = 0.0
    graphs: int = 0  # graphs the cold process compiled: one per size range inductor specialised on
    memory: dict = field(default_factory=dict)  # GB: the estimated peak of a drafter rank by part (dflash.cost), and what the device has
    cache_mb: float = 0.0
    cold: dict = field(default_factory=dict)  # each process's own report: startup, steps, cache counters, compile phases
    warm: dict = field(default_factory=dict)


# -- the training step, in a fresh process ---------------------------------------------------------


def _compile_totals() -> dict[str, float]:
    """Seconds per compile phase so far in this process, from torch's own timers (nested phases count in their parents too)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: float(value) for name, value in zip(names, values, strict=True)}


def _compile_seconds() -> float:
    """Time spent compiling: Dynamo frames (AOT autograd and inductor included) and lazily compiled backwards."""
    totals = _compile_totals()
    return totals.get("_compile.compile_inner", 0.0) + totals.get("backward._backward_impl", 0.0)


def _step_main(spec: dict, report_path: Path) -> None:
    """One process's warmup: the training step on a batch of each shape, timed, with cache counters."""
    start = time.perf_counter()
    from dflash.optim import build_optimizer
    from dflash.preflight.synthetic import synthetic_batch
    from dflash.step import compile_drafter, drafter_config_for, train_step, training_drafter
    from dflash.target import load_from_manifest, preparation_dtype

    use_compile_cache(spec["cache_dir"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(cpu_threads(spec["local_processes"]))
    drafter_cfg = parse_section(DrafterConfig, spec["drafter"], "drafter")
    train_cfg = parse_section(TrainConfig, spec["train"], "train")
    # The step reads the target's embedding and head only (the batches bring their features): none of its layers.
    target = load_from_manifest(spec["target_manifest"], device=device, dtype=preparation_dtype(train_cfg.target_dtype, device), layers=False)
    config = drafter_config_for(target, drafter_cfg)
    drafter = training_drafter(config, train_cfg, device)
    forward = compile_drafter(drafter, enabled=True)
    optimizer = build_optimizer(drafter, train_cfg, total_steps=len(spec["shapes"]))
    report: dict = {"startup_seconds": time.perf_counter() - start, "threads": torch.get_num_threads(), "steps": []}
    for seed, (rows, length) in enumerate(spec["shapes"]):
        # Rows from ``length`` down to half of it: padded to ``length``, as a real batch of that shape is.
        batch = synthetic_batch(config, [length - i * length // (2 * rows) for i in range(rows)], train_cfg, seed)
        frames, compiling, t = compile_cache_hits()["frames_compiled"], _compile_seconds(), time.perf_counter()
        train_step(forward, drafter, optimizer, target, batch, train_cfg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        report["steps"].append(
            {
                "rows": rows,
                "length": length,
                "seconds": time.perf_counter() - t,
                "compile_seconds": _compile_seconds() - compiling,
                "graphs_compiled": compile_cache_hits()["frames_compiled"] - frames,
                "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None,
            }
        )
    report["cache"] = compile_cache_hits()
    # What the compiles spent their time on: in a warm process, what is left to speed up.
    report["compile_phases"] = {name: round(t, 3) for name, t in sorted(_compile_totals().items(), key=lambda kv: -kv[1])[:12]}
    report_path.write_text(json.dumps(report))


def _device_env(device: str) -> tuple[str, dict[str, str]]:
    """The torch device a ``cpu``/``cudaN`` job compiles for, and the environment of its processes.

    The device index is part of the compiled graphs' cache keys, so ``cudaN`` compiles for ``cuda:N``
    with the devices training sees, never for a device renumbered by pinning ``CUDA_VISIBLE_DEVICES``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    index = device_index(device)
    if index is None:
        return "cpu", env
    visible = torch.cuda.device_count()
    if index >= visible:
        raise PreflightError(
            f"warmup device {device} is cuda:{index}, but this job sees {visible} CUDA device(s): the warmup compiles for the device index "
            f"the training rank uses, so the job must see the node's GPUs as training does (under SLURM: give warmup_cache the GPUs of a node)"
        )
    return f"cuda:{index}", env


def _run_step_process(spec: dict, env: dict[str, str]) -> tuple[dict | None, float, str]:
    """A fresh process running ``_step_main``: its report, its wall time, and the tail of its output when it failed."""
    with tempfile.TemporaryDirectory(prefix="dflash-warmup-") as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "dflash.preflight.warmup", "--spec", json.dumps(spec), "--report", str(report_path)]
        start = time.perf_counter()
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if result.returncode != 0 or not report_path.is_file():
            return None, seconds, (result.stderr or result.stdout).strip()[-3000:]
        return json.loads(report_path.read_text()), seconds, ""


def _directory_mb(directory: Path) -> float:
    return round(sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 1e6, 1)


def warmup_cache(
    device: str,
    target_manifest: str | Path,
    shapes: list[list[int]],
    drafter: DrafterConfig,
    train: TrainConfig,
    topology: TopologyConfig,
    cache_dir: str | Path,
) -> WarmupVerdict:
    """Compile the training step on ``device`` for every batch shape ``[rows, length]`` of the run into ``cache_dir``."""
    start = time.perf_counter()
    cache_dir = Path(cache_dir).resolve()
    verdict = WarmupVerdict(device=device, cache_dir=str(cache_dir), shapes=shapes)
    torch_device, env = _device_env(device)
    check_memory(verdict, torch_device, target_manifest, drafter, train, topology)
    if not verdict.ok:
        verdict.summarize(f"{device}: not warmed, the run would not fit")
        return verdict
    # A leftover cache would make the cold start warm and the measurement meaningless.
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    spec = {
        "device": torch_device,
        "local_processes": topology.nproc_per_node,  # inductor's CPU kernels are built for training's thread count
        "target_manifest": str(Path(target_manifest).resolve()),
        "drafter": asdict(drafter),
        "train": asdict(train),
        "shapes": verdict.shapes,
        "cache_dir": str(cache_dir),
    }
    # Cold fills the cache; warm is the second start, as training makes it, and must find every graph there.
    for label in ("cold", "warm"):
        report, seconds, failure = _run_step_process(spec, env)
        if report is None:
            verdict.fail(f"the {label} warmup process failed on {device}:\n{failure}\nRun `dflash warmup-cache` alone to reproduce, and fix the error above")
            break
        setattr(verdict, label, report)
        setattr(verdict, f"{label}_process_seconds", round(seconds, 2))
        setattr(verdict, f"{label}_seconds", round(sum(step["compile_seconds"] for step in report["steps"]), 2))
        setattr(verdict, f"{label}_first_step_seconds", round(report["steps"][0]["seconds"], 2))
    if verdict.ok:
        _judge(verdict)
    verdict.cache_mb = _directory_mb(cache_dir)
    verdict.seconds = time.perf_counter() - start
    warm = verdict.warm
    verdict.summarize(
        f"{device}: {len(verdict.shapes)} batch shapes in {verdict.graphs} graph(s); compile cold {verdict.cold_seconds:.1f} s, warm {verdict.warm_seconds:.1f} s "
        f"({verdict.speedup:.1f}x, target {TARGET_SPEEDUP:.0f}x); warm start = {warm.get('startup_seconds', 0):.1f} s startup + "
        f"{verdict.warm_first_step_seconds:.1f} s first step; cache {verdict.cache_mb} MB at {cache_dir}"
    )
    return verdict


def warmup_caches(
    devices: list[str],
    target_manifest: str | Path,
    samples: str | Path,
    drafter: DrafterConfig,
    train: TrainConfig,
    topology: TopologyConfig,
    cache_root: str | Path,
) -> list[WarmupVerdict]:
    """``warmup_cache`` on every device at once, each into ``cache_root/<device>``: one job that sees a node's GPUs
    warms each of them (cudaN must compile for cuda:N), rather than one job per device seeing GPUs 0..N. The
    compiles run in processes of their own; the threads here only wait for them."""
    from dflash.data import read_samples

    lengths = [len(ids) for ids in read_samples(samples)["input_ids"]]
    shapes = [list(shape) for shape in step_shapes(lengths, train, topology.drafter_world)]
    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        runs = [pool.submit(warmup_cache, device, target_manifest, shapes, drafter, train, topology, Path(cache_root) / device) for device in devices]
        return [run.result() for run in runs]


def check_memory(verdict: WarmupVerdict, device: str, target_manifest, drafter: DrafterConfig, train: TrainConfig, topology: TopologyConfig) -> None:
    """The estimated peak memory of a drafter rank on its largest batch (``dflash.cost``) against the device's:
    a run that would not fit fails here, before anything compiles, naming the keys that make it smaller."""
    import psutil

    from dflash.cost import Shape, drafter_rank_memory, target_weights
    from dflash.model import DFlashConfig
    from dflash.target import config_from_manifest, preparation_dtype

    target_config = config_from_manifest(target_manifest)
    drafter_config = DFlashConfig.for_target(target_config, drafter, mask_token_id=0)  # the mask token does not change the cost
    rows, length = max(verdict.shapes, key=lambda s: s[0] * s[1])
    torch_device = torch.device(device)
    dtype = preparation_dtype(train.target_dtype, torch_device)
    memory = drafter_rank_memory(
        Shape.of(drafter_config) if drafter.draft_vocab_size is None else replace(Shape.of(drafter_config), vocab=drafter.draft_vocab_size),
        drafter_config.feature_width,
        rows,
        length,
        train,
        drafter_config.block_size,
        target=target_weights(Shape.of(target_config), torch.finfo(dtype).bits // 8, holds_layers=topology.kind == "colocated"),
        shards=topology.drafter_world if topology.data_parallel == "fsdp" else 1,
    )
    available = torch.cuda.get_device_properties(torch_device).total_memory if torch_device.type == "cuda" else psutil.virtual_memory().available
    gb = {name: value / 1e9 for name, value in asdict(memory).items()} | {"estimate": memory.total / 1e9, "available": available / 1e9}
    verdict.memory = {name: float(f"{value:.3g}") for name, value in gb.items()}
    if memory.total > 0.95 * available:
        parts = ", ".join(f"{name} {value / 1e9:.1f} GB" for name, value in asdict(memory).items())
        verdict.fail(
            f"a drafter rank on {device} would need about {memory.total / 1e9:.1f} GB for its largest batch ({rows} rows of {length} tokens: {parts}) "
            f"of the {available / 1e9:.1f} GB there: set train.activation_checkpointing: true, lower train.max_anchors or train.batch_size "
            "(or data.max_length), or shard the training state with topology.data_parallel: fsdp"
        )


def _judge(verdict: WarmupVerdict) -> None:
    """Every shape of the second start must load its graphs from the cache; the speedup is reported against its target, not required."""
    verdict.graphs = sum(step["graphs_compiled"] for step in verdict.cold["steps"])
    verdict.speedup = round(verdict.cold_seconds / max(verdict.warm_seconds, 1e-9), 1)
    warm = verdict.warm["cache"]
    if warm["fxgraph_cache_miss"] or warm["autograd_cache_miss"] or not warm["fxgraph_cache_hit"]:
        verdict.fail(
            f"the second start did not run from the warmed cache (FX graph {warm['fxgraph_cache_hit']} hit(s), {warm['fxgraph_cache_miss']} miss(es); "
            f"AOT autograd {warm['autograd_cache_hit']} hit(s), {warm['autograd_cache_miss']} miss(es)): check that TORCHINDUCTOR_FX_GRAPH_CACHE "
            "and TORCHINDUCTOR_AUTOGRAD_CACHE are not set to 0 and that no other job writes this cache directory"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one warmup process (run by warmup_cache)")
    parser.add_argument("--spec", required=True, help="device, target manifest, drafter and train sections, shapes, cache directory (JSON)")
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args()
    _step_main(json.loads(args.spec), args.report)
