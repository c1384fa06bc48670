"""Where a finished run's decoding time goes, and what it bought: prints figures, writes JSON.

    python benchmarks/decode_cost.py            # after `snakemake --cores 1`; reads results/

For each evaluation set and arm (the drafter, prompt lookup, the hybrid): τ and speedup
from ``results/eval/summary.csv``; the drafter's per-position acceptance and the verify
lengths its gate chose, from the per-prompt rows. Then it measures, on this machine, what
a speculative step costs in target steps:

- the target's forward over k new tokens after a KV cache of ``--context`` tokens,
  c(k)/c(1) for k = 1..max(8, B), on torch's default linear and on oneDNN's packed one
  (``dflash.kernels``), the two interleaved in rounds (median over rounds);
- one draft step of the run's drafter at its block size, split into its forward and
  the LM head over its draft vocabulary (with the argmax), each as a fraction of c(1).

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
    from dflash.kernels import pack_linears
    from dflash.policy import measure_verify_cost

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


@torch.no_grad()
def draft_costs(target, drafter, block_size: int, context: int, repeats: int) -> dict[str, float]:
    """Milliseconds of one draft step at ``block_size`` (the evaluation's): the drafter's forward over the block
    (with ``context`` cached keys), and the head."""
    from dflash.decode import DFlashProposer
    from dflash.model import DraftCache

    proposer = DFlashProposer(target, drafter)
    width = drafter.config.feature_width
    cache = DraftCache()
    drafter(
        torch.randn(1, context, width), target.embed(torch.zeros(1, 1, dtype=torch.long)), torch.arange(context)[None], torch.tensor([[context]]), cache=cache
    )
    block = torch.tensor([[1] + [drafter.mask_token_id] * (block_size - 1)])
    embeddings = target.embed(block)
    positions = torch.arange(context, context + block_size)[None]
    no_context = torch.empty(1, 0, width)

    def forward():
        return drafter(no_context, embeddings, torch.empty(1, 0, dtype=torch.long), positions, cache=cache)

    hidden = forward()[0, 1:].to(proposer.head.dtype)
    return {
        "forward_ms": median_ms(forward, repeats),
        "head_ms": median_ms(lambda: proposer.project(hidden).argmax(-1), repeats),
        "draft_vocab": len(drafter.draft_vocab) if drafter.draft_vocab is not None else target.config.vocab_size,
    }


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
    from dflash.kernels import pack_linears
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
    if kernel == "packed":
        pack_linears(target.model)
        pack_linears(drafter)
    draft = draft_costs(target, drafter, block_size, args.context, args.repeats)
    one = costs[kernel][0]
    per_position, chosen = acceptance(args.results, summary)

    print(f"target forward over k tokens after {args.context} cached ({target.dtype}, {torch.get_num_threads()} threads), ms (c(k)/c(1)):")
    for name, row in costs.items():
        print(f"  {name:<8}" + "  ".join(f"{k}: {ms:.1f} ({ms / row[0]:.2f})" for k, ms in zip(widths, row)))
    print(
        f"draft step at B={block_size} ({kernel} linears): forward {draft['forward_ms']:.1f} ms ({draft['forward_ms'] / one:.3f} of c(1)), "
        f"LM head over {draft['draft_vocab']} tokens {draft['head_ms']:.1f} ms ({draft['head_ms'] / one:.3f})"
    )
    step = costs[kernel][block_size - 1] / one + (draft["forward_ms"] + draft["head_ms"]) / one
    print(f"a full-block speculative step costs {step:.2f} target steps: it pays for itself above τ = {step:.2f}\n")
    print(f"{'set':<12} {'arm':<14} {'tau':>6} {'speedup':>8}  per-position acceptance (drafter); draft tokens the gate verified: steps")
    for row in summary.itertuples():
        gate = " ".join(f"{n}:{count}" for n, count in chosen[row.set].items())
        print(f"{row.set:<12} {'dflash':<14} {row.tau:>6.2f} {row.speedup:>8.2f}  {' '.join(f'{a:.2f}' for a in per_position[row.set][:8])}; {gate}")
        print(f"{row.set:<12} {'prompt lookup':<14} {row.pld_tau:>6.2f} {row.pld_speedup:>8.2f}")
        print(f"{row.set:<12} {'hybrid':<14} {row.hybrid_tau:>6.2f} {row.hybrid_speedup:>8.2f}  lookup's proposal on {row.hybrid_lookup_share:.0%} of steps")
    measured = {
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "target_dtype": str(target.dtype)},
        "context": args.context,
        "target_ms": costs,
        "target_ratio": {name: [round(ms / row[0], 3) for ms in row] for name, row in costs.items()},
        "draft": draft | {"forward_ratio": round(draft["forward_ms"] / one, 3), "head_ratio": round(draft["head_ms"] / one, 3)},
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
