"""Where a finished run's decoding time goes, and what it bought: prints figures, writes JSON.

    python benchmarks/decode_cost.py            # after `snakemake --cores 1`; reads results/

For each evaluation set and arm (the drafter, prompt lookup, the hybrid): τ and speedup
from ``results/eval/summary.csv``; the drafter's per-position acceptance and the verify
lengths its gate chose, from the per-prompt rows. Then it measures, on this machine, what
a speculative step costs in target steps:

- the target's forward over k new tokens after a KV cache of ``--context`` tokens,
  c(k)/c(1) for k = 1..max(8, B), on torch's default linear and on oneDNN's packed one
  (``dflash.kernels``), the two interleaved in rounds (median over rounds);
- one proposal of the run's drafter at its block size, per draft kernel (torch's
  default, oneDNN packed in fp32 and in bf16 where native, int8), as a fraction of
  c(1): right after a target verify, as decoding pays it, and timed alone, where its
  weights stay in the CPU's caches; and, per draft kernel, the validation τ
  teacher-forced as the evaluation computes it (every draft position verified), which
  a kernel of fewer bytes may lower.

The speedup a run can reach is about τ / (c(B)/c(1) + draft cost): the figures say which
part to improve. Median timings; machines of one kind differ, so compare ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_costs(target, context: int, max_width: int, repeats: int, rounds: int = 3) -> dict[str, list[float]]:
    """Milliseconds of the target's forward over k = 1..``max_width`` new tokens, per linear kernel (rounds interleaved)."""
    from dflash.decoding.gate import measure_verify_cost
    from dflash.kernels import pack_linears

    packed = copy.deepcopy(target)
    models = {"default": target}
    if pack_linears(packed.model, "auto"):
        models["packed"] = packed
    per_round: dict[str, list[list[float]]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            cost = measure_verify_cost(model, max_width, context, repeats)
            per_round[name].append([c * cost.step_ms for c in cost.relative])
    return {name: [statistics.median(column) for column in zip(*rows)] for name, rows in per_round.items()}


def draft_kernels(drafter) -> dict:
    """The run's drafter on each draft kernel available here (``dflash.kernels.draft_linears``)."""
    from dflash.kernels import DRAFT_KERNELS, draft_linears, kernel_available

    parameter = next(drafter.parameters())
    drafters = {}
    for kernel in ("default", *DRAFT_KERNELS):
        if kernel_available(kernel, parameter.device, parameter.dtype):
            drafters[kernel] = copy.deepcopy(drafter)
            draft_linears(drafters[kernel], kernel)
    return drafters


def validation_tau(target, drafters: dict, results: Path, block_size: int) -> dict[str, float]:
    """Per draft kernel: τ teacher-forced on the run's validation samples, every draft position verified."""
    from dflash.data import read_samples
    from dflash.decoding.drafter import draft_head
    from dflash.evaluate import calibrate

    validation = read_samples(results / "data" / "validation.parquet")
    taus = {}
    for kernel, model in drafters.items():
        total, blocks = calibrate(target, model, validation, block_size, draft_head(target, model))[1].tau_sums()
        taus[kernel] = total / blocks if blocks else float("nan")
    return taus


def draft_costs(target, drafters: dict, block_size: int, context: int, repeats: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    """Milliseconds of one proposal of the run's drafter at ``block_size`` (the evaluation's), per draft kernel
    available here: right after a target verify, as decoding makes it, and timed alone (the drafter's weights
    still in cache from the proposal before); kernels interleaved in rounds, median over rounds."""
    from dflash.decoding.drafter import draft_head
    from dflash.evaluate import measure_draft_ms

    heads = {kernel: draft_head(target, model) for kernel, model in drafters.items()}
    timings: dict[str, dict[str, list[float]]] = {kernel: {"decoding_ms": [], "alone_ms": []} for kernel in drafters}
    for _ in range(rounds):
        for kernel, model in drafters.items():
            for key, after_verify in (("decoding_ms", True), ("alone_ms", False)):
                timings[kernel][key].append(measure_draft_ms(target, model, heads[kernel], block_size, context, repeats, after_verify))
    return {kernel: {key: statistics.median(values) for key, values in columns.items()} for kernel, columns in timings.items()}


def acceptance(results: Path, summary: pd.DataFrame) -> tuple[dict[str, list[float]], dict[str, dict[int, int]]]:
    """Per set, from the per-prompt rows: the drafter's mean per-position acceptance, and how often its gate verified
    each number of draft tokens."""
    positions, lengths = {}, {}
    for name in summary["set"]:
        rows = pd.read_csv(results / "eval" / f"{name}.csv")
        matrix = [[float(x) for x in str(cell).split()] for cell in rows["per_position_acceptance"].dropna()]
        positions[name] = [round(v, 3) for v in pd.DataFrame(matrix).mean().tolist()]
        chosen = Counter(int(x) for cell in rows.get("verified_lengths", pd.Series(dtype=str)).dropna() for x in str(cell).split())
        lengths[name] = dict(sorted(chosen.items()))
    return positions, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="the results directory of a finished run")
    parser.add_argument("--context", type=int, default=300, help="tokens already in the KV caches")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_cost_cpu.json")
    args = parser.parse_args()

    from dflash.config import cpu_threads
    from dflash.kernels import pack_linears, resolve_draft_kernel
    from dflash.model import DFlashDrafter
    from dflash.target import load_from_manifest

    torch.set_num_threads(cpu_threads())
    summary = pd.read_csv(args.results / "eval" / "summary.csv")
    target = load_from_manifest(args.results / "target" / "target.json")
    drafter = DFlashDrafter.from_pretrained(args.results / "train" / "drafter", dtype=target.dtype).eval()
    block_size = int(summary["block_size"].iloc[0])
    widths = list(range(1, max(8, block_size) + 1))
    costs = kernel_costs(target, args.context, len(widths), args.repeats)
    kernel = "packed" if "packed" in costs else "default"
    pack_linears(target.model, kernel)
    drafters = draft_kernels(drafter)
    drafts = draft_costs(target, drafters, block_size, args.context, args.repeats)
    taus = validation_tau(target, drafters, args.results, block_size)
    draft_kernel = resolve_draft_kernel(drafter)
    one = costs[kernel][0]
    per_position, chosen = acceptance(args.results, summary)

    print(f"target forward over k tokens after {args.context} cached ({target.dtype}, {torch.get_num_threads()} threads), ms (c(k)/c(1)):")
    for name, row in costs.items():
        print(f"  {name:<8}" + "  ".join(f"{k}: {ms:.1f} ({ms / row[0]:.2f})" for k, ms in zip(widths, row)))
    print(f"one proposal at B={block_size}, ms (fraction of c(1)), per draft kernel:")
    for name, draft in drafts.items():
        print(
            f"  {name:<8}after a verify {draft['decoding_ms']:.1f} ({draft['decoding_ms'] / one:.3f}), "
            f"alone {draft['alone_ms']:.1f} ({draft['alone_ms'] / one:.3f}); validation τ {taus[name]:.3f}"
            + ("  <- eval.draft_kernel: auto" if name == draft_kernel else "")
        )
    step = costs[kernel][block_size - 1] / one + drafts[draft_kernel]["decoding_ms"] / one
    print(f"a full-block speculative step costs {step:.2f} target steps: it pays for itself above τ = {step:.2f}\n")
    print(f"{'set':<12} {'arm':<14} {'tau':>6} {'speedup':>8}  per-position acceptance (drafter); draft tokens the gate verified: steps")
    for row in summary.itertuples():
        gate = " ".join(f"{n}:{count}" for n, count in chosen[row.set].items())
        print(f"{row.set:<12} {'dflash':<14} {row.tau:>6.2f} {row.speedup:>8.2f}  {' '.join(f'{a:.2f}' for a in per_position[row.set][:8])}; {gate}")
        print(f"{row.set:<12} {'prompt lookup':<14} {row.pld_tau:>6.2f} {row.pld_speedup:>8.2f}")
        print(
            f"{row.set:<12} {'hybrid':<14} {row.hybrid_tau:>6.2f} {row.hybrid_speedup:>8.2f}  lookup's proposal on {row.hybrid_lookup_share:.0%} of steps, the drafter run on {row.hybrid_drafter_share:.0%}"
        )
    measured = {
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "target_dtype": str(target.dtype)},
        "context": args.context,
        "target_ms": costs,
        "target_ratio": {name: [round(ms / row[0], 3) for ms in row] for name, row in costs.items()},
        "draft_ms": drafts,
        "draft_ratio": {name: {key: round(ms / one, 3) for key, ms in draft.items()} for name, draft in drafts.items()},
        "draft_kernel": draft_kernel,
        "validation_tau": taus,
        "step_in_target_steps": round(step, 3),
        "summary": summary.to_dict(orient="records"),
        "per_position_acceptance": per_position,
        "gate_verified": chosen,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(measured, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
