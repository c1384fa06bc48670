"""Preflight stage ``warmup_cache``: compile the drafter's training step once, into a cache training starts from.

One job per drafter device (``cpu``, ``cuda0``, ...). It empties the cache
directory, then runs the exact training step (``dflash.step.compile_drafter``
and ``train_step`` on ``make_batch`` batches of training's shapes and rows) in a fresh process on a short and a long batch, filling inductor's
FX-graph and AOT-autograd caches under ``cache_dir``. A second fresh process
then starts against the warm cache, as training will. ``cold_seconds`` and
``warm_seconds`` are the compile times of the two first steps (torch's own
compile timers); the wall times of the first steps and whole processes are
recorded beside them, and the second process must hit the cache.

Training points its compile cache at the warmed directory
(``dflash.compile_cache.use_warm_cache``) before it compiles.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash.compile_cache import compile_cache_hits, use_compile_cache
from dflash.config import DrafterConfig, TopologyConfig, TrainConfig, cpu_threads, parse_section
from dflash.preflight.gate import device_index
from dflash.preflight.verdict import Verdict

TARGET_SPEEDUP = 5.0
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class WarmupVerdict(Verdict):
    stage: str = "warmup_cache"
    device: str = "cpu"  # the job's device wildcard
    cache_dir: str = ""
    cold_seconds: float = 0.0  # compiling the first training step in a fresh process on an empty cache
    warm_seconds: float = 0.0  # the same in a second fresh process on the warm cache
    speedup: float = 0.0  # cold_seconds / warm_seconds
    target_speedup: float = TARGET_SPEEDUP
    cold_first_step_seconds: float = 0.0  # compile + compute of the first step
    warm_first_step_seconds: float = 0.0
    cold_process_seconds: float = 0.0  # whole processes: interpreter, imports, target, steps
    warm_process_seconds: float = 0.0
    graphs: list[int] = field(default_factory=list)  # graphs the cold process compiled for its short and its long batch
    cache_mb: float = 0.0
    cold: dict = field(default_factory=dict)  # each process's own report: startup, steps, cache counters, compile phases
    warm: dict = field(default_factory=dict)


# -- the training step, in a fresh process ---------------------------------------------------------


def batch_rows(train: TrainConfig, topology: TopologyConfig) -> int:
    """Rows of one drafter rank's batch: the global batch over the data-parallel drafter ranks."""
    world = topology.nnodes * topology.nproc_per_node - (topology.target_ranks if topology.kind == "split" else 0)
    return math.ceil(train.batch_size / max(1, world))


def sequence_lengths(avoid: set[int]) -> list[int]:
    """A short and a long padded length, for two batches; neither equal to another dimension of the step.

    Two lengths, because inductor specialises on size thresholds (e.g. a guard
    ``3*rows*length <= 4096`` on the SmolLM2-shaped drafter): a short and a long
    batch can need two graphs, and both should be in the cache. An equal
    dimension would make Dynamo tie the two in one symbol and recompile later.
    """
    short = next(n for n in (157, 163, 167, 173, 179) if n not in avoid)
    long = next(n for n in (523, 541, 547, 557, 563) if n not in avoid)
    return [short, long]


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
    """One process's warmup: the training step on batches of the given padded lengths, timed, with cache counters."""
    start = time.perf_counter()
    from dflash.model import DFlashDrafter
    from dflash.objective import default_gamma
    from dflash.preflight.synthetic import synthetic_batch
    from dflash.step import compile_drafter, drafter_config_for, train_step
    from dflash.target import load_from_manifest

    use_compile_cache(spec["cache_dir"])
    device = torch.device(spec["device"])
    drafter_cfg = parse_section(DrafterConfig, spec["drafter"], "drafter")
    train_cfg = parse_section(TrainConfig, spec["train"], "train")
    target = load_from_manifest(spec["target_manifest"], device=device)
    config = drafter_config_for(target, drafter_cfg)
    drafter = DFlashDrafter(config).to(device)
    forward = compile_drafter(drafter, enabled=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    gamma = train_cfg.gamma or default_gamma(config.block_size)
    queries = train_cfg.max_anchors * config.block_size
    width = len(config.target_layer_ids) * config.hidden_size
    lengths = sequence_lengths({spec["rows"], queries, width, config.hidden_size, config.block_size, train_cfg.max_anchors, config.vocab_size})
    report: dict = {"startup_seconds": time.perf_counter() - start, "rows": spec["rows"], "queries": queries, "steps": []}
    for seed, length in enumerate(lengths):
        # Rows from ``length`` down to half of it, padded to ``length``, as a real batch is.
        rows = [length - i * length // (2 * spec["rows"]) for i in range(spec["rows"])]
        batch = synthetic_batch(config, rows, train_cfg.max_anchors, gamma, seed, train_cfg.sample_loss_positions)
        frames, compiling, t = compile_cache_hits()["frames_compiled"], _compile_seconds(), time.perf_counter()
        train_step(forward, drafter, optimizer, target, batch, train_cfg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        report["steps"].append(
            {
                "length": length,
                "seconds": time.perf_counter() - t,
                "compile_seconds": _compile_seconds() - compiling,
                "graphs_compiled": compile_cache_hits()["frames_compiled"] - frames,
            }
        )
    report["cache"] = compile_cache_hits()
    # What the compiles spent their time on: in a warm process, what is left to speed up.
    report["compile_phases"] = {name: round(t, 3) for name, t in sorted(_compile_totals().items(), key=lambda kv: -kv[1])[:12]}
    report_path.write_text(json.dumps(report))


def _device_env(device: str, topology: TopologyConfig) -> tuple[str, dict[str, str]]:
    """The torch device a ``cpu``/``cudaN`` job uses, and the environment that pins it."""
    env = dict(os.environ)
    # The threads a training process of this topology runs with: inductor's CPU kernels are compiled for a thread count.
    env["OMP_NUM_THREADS"] = str(cpu_threads(topology.nproc_per_node))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    index = device_index(device)
    if index is None:
        return "cpu", env
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) != 1:
        # Pin the job to its device, unless the scheduler already did (one visible device).
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
    return "cuda:0", env


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
    drafter: DrafterConfig,
    train: TrainConfig,
    topology: TopologyConfig,
    cache_dir: str | Path,
) -> WarmupVerdict:
    start = time.perf_counter()
    cache_dir = Path(cache_dir).resolve()
    verdict = WarmupVerdict(device=device, cache_dir=str(cache_dir))
    torch_device, env = _device_env(device, topology)
    # A leftover cache would make the cold start warm and the measurement meaningless.
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    spec = {
        "device": torch_device,
        "target_manifest": str(Path(target_manifest).resolve()),
        "drafter": asdict(drafter),
        "train": asdict(train),
        "rows": batch_rows(train, topology),
        "cache_dir": str(cache_dir),
    }
    # Cold fills the cache; warm is the second start, as training makes it, and must find every graph there.
    for label in ("cold", "warm"):
        report, seconds, failure = _run_step_process(spec, env)
        if report is None:
            verdict.fail(f"the {label} warmup process failed on {device}:\n{failure}\nRun `dflash warmup-cache` alone to reproduce, and fix the error above")
            break
        first = report["steps"][0]
        setattr(verdict, label, report)
        setattr(verdict, f"{label}_process_seconds", round(seconds, 2))
        setattr(verdict, f"{label}_seconds", round(first["compile_seconds"], 2))
        setattr(verdict, f"{label}_first_step_seconds", round(first["seconds"], 2))
    if verdict.ok:
        _judge(verdict)
    verdict.cache_mb = _directory_mb(cache_dir)
    verdict.seconds = time.perf_counter() - start
    warm = verdict.warm
    verdict.summarize(
        f"{device}: compile cold {verdict.cold_seconds:.1f} s, warm {verdict.warm_seconds:.1f} s ({verdict.speedup:.1f}x, target {TARGET_SPEEDUP:.0f}x); "
        f"warm start = {warm.get('startup_seconds', 0):.1f} s startup + {verdict.warm_seconds:.1f} s compile + "
        f"{verdict.warm_first_step_seconds - verdict.warm_seconds:.1f} s first step; graphs {verdict.graphs}; cache {verdict.cache_mb} MB at {cache_dir}"
    )
    return verdict


def _judge(verdict: WarmupVerdict) -> None:
    """The second start must compile nothing cold; the speedup is reported against its target, not required."""
    verdict.graphs = [step["graphs_compiled"] for step in verdict.cold["steps"]]
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
    parser.add_argument("--spec", required=True, help="device, target manifest, drafter and train sections, rows, cache directory (JSON)")
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args()
    _step_main(json.loads(args.spec), args.report)
