"""Where a finished run's decoding time goes, and what it bought: prints figures, writes JSON.

    python benchmarks/decode_cost.py            # after `snakemake --cores 1`; reads results/

For each evaluation set and arm (the drafter, prompt lookup): τ and speedup from
``results/eval/summary.csv``, and per-position acceptance from the per-prompt rows.
Then it measures, on this machine, what a speculative step costs in target steps:

- the target's forward over k new tokens after a KV cache of ``--context`` tokens,
  c(k)/c(1) for k = 1, 2, 4, 8 and the run's block size (median of ``--repeats``);
- one draft step of the run's drafter at its block size, split into its forward and
  the LM head over its draft vocabulary (with the argmax), each as a fraction of c(1).

The speedup a run can reach is about τ / (c(B)/c(1) + draft cost): the figures say which
part to improve. Median timings; machines of one kind differ, so compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
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


@torch.no_grad()
def target_costs(target, context: int, widths: list[int], repeats: int) -> dict[int, float]:
    """Milliseconds of a target forward over k new tokens after ``context`` cached ones (the cache cropped back each time)."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, target.config.vocab_size - 100, (1, context), generator=generator)
    cache = DynamicCache(config=target.config)
    target.model(input_ids=prompt, cache=cache, use_cache=True)
    costs = {}
    for k in widths:
        block = torch.randint(100, target.config.vocab_size - 100, (1, k), generator=generator)
        positions = torch.arange(context, context + k)[None]

        def step(block=block, positions=positions, k=k):
            target.model(input_ids=block, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True)
            cache.crop(-k)

        costs[k] = median_ms(step, repeats)
    return costs


@torch.no_grad()
def draft_costs(target, drafter, block_size: int, context: int, repeats: int) -> dict[str, float]:
    """Milliseconds of one draft step at ``block_size`` (the evaluation's): the drafter's forward over the block
    (with ``context`` cached keys), and the head."""
    from dflash.decode import DFlashProposer
    from dflash.model import DraftCache

    proposer = DFlashProposer(target, drafter)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
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
        "head_ms": median_ms(lambda: (hidden @ proposer.head.t()).argmax(-1), repeats),
        "draft_vocab": len(drafter.draft_vocab) if drafter.draft_vocab is not None else target.config.vocab_size,
    }


def acceptance(results: Path, summary: pd.DataFrame) -> dict[str, list[float]]:
    """Mean per-position acceptance of the drafter per set, from the per-prompt rows."""
    positions = {}
    for name in summary["set"]:
        rows = pd.read_csv(results / "eval" / f"{name}.csv")
        matrix = [[float(x) for x in str(cell).split()] for cell in rows["per_position_acceptance"].dropna()]
        positions[name] = [round(v, 3) for v in pd.DataFrame(matrix).mean().tolist()]
    return positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="the results directory of a finished run")
    parser.add_argument("--context", type=int, default=300, help="tokens already in the KV caches")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_cost_cpu.json")
    args = parser.parse_args()

    from dflash.config import cpu_threads
    from dflash.model import DFlashDrafter
    from dflash.target import load_from_manifest

    torch.set_num_threads(cpu_threads())
    summary = pd.read_csv(args.results / "eval" / "summary.csv")
    target = load_from_manifest(args.results / "target" / "target.json")
    drafter = DFlashDrafter.from_pretrained(args.results / "train" / "drafter", dtype=target.dtype).eval()
    block_size = int(summary["block_size"].iloc[0])
    widths = sorted({1, 2, 4, 8, block_size})
    costs = target_costs(target, args.context, widths, args.repeats)
    draft = draft_costs(target, drafter, block_size, args.context, args.repeats)
    one = costs[1]
    per_position = acceptance(args.results, summary)

    print(f"target forward after {args.context} cached tokens ({target.dtype}, {torch.get_num_threads()} threads):")
    print("  " + "  ".join(f"c({k})={costs[k]:.1f} ms ({costs[k] / one:.2f})" for k in widths))
    print(
        f"draft step at B={block_size}: forward {draft['forward_ms']:.1f} ms ({draft['forward_ms'] / one:.3f} of c(1)), "
        f"LM head over {draft['draft_vocab']} tokens {draft['head_ms']:.1f} ms ({draft['head_ms'] / one:.3f})"
    )
    step = costs[block_size] / one + (draft["forward_ms"] + draft["head_ms"]) / one
    print(f"a speculative step costs {step:.2f} target steps: the drafter pays for itself above τ = {step:.2f}\n")
    print(f"{'set':<12} {'arm':<14} {'tau':>6} {'speedup':>8}  per-position acceptance (drafter)")
    for row in summary.itertuples():
        print(f"{row.set:<12} {'dflash':<14} {row.tau:>6.2f} {row.speedup:>8.2f}  {' '.join(f'{a:.2f}' for a in per_position[row.set][:8])}")
        print(f"{row.set:<12} {'prompt lookup':<14} {row.pld_tau:>6.2f} {row.pld_speedup:>8.2f}")
    measured = {
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "target_dtype": str(target.dtype)},
        "context": args.context,
        "target_ms": costs,
        "target_ratio": {k: round(v / one, 3) for k, v in costs.items()},
        "draft": draft | {"forward_ratio": round(draft["forward_ms"] / one, 3), "head_ratio": round(draft["head_ms"] / one, 3)},
        "step_in_target_steps": round(step, 3),
        "summary": summary.to_dict(orient="records"),
        "per_position_acceptance": per_position,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(measured, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
