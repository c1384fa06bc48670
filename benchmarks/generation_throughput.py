"""Tokens per second of in-process regeneration: padded ``generate`` batches against continuous batching.

    python benchmarks/generation_throughput.py            # the embedded target; table on stdout, JSON in benchmarks/results/

Both arms answer the same real prompts (ShareGPT's first turns) with ``dflash.generation.LocalEngine``,
greedy, in the dtype regeneration uses, interleaved over ``--rounds``. Padded batches (``batching: padded``)
keep a finished row in its batch until the whole batch ends; transformers' continuous batching
(``batching: continuous``, ``generate_batch``) frees a finished request's slot at once. Counts the tokens of
the responses only (to their stop token), so that padding and the steps after a stop count as cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from dflash.config import GenerationConfig, cpu_threads
    from dflash.data import load_conversations
    from dflash.generation import LocalEngine, Request
    from dflash.target import Target, preparation_dtype

    torch.set_num_threads(cpu_threads())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = Target.load("embedded", device=device, dtype=preparation_dtype("auto", device))
    conversations = load_conversations("sharegpt")[: args.prompts]
    requests = [Request(c.prompt_id, c.as_messages(), target.chat_prompt_ids(c.as_messages())[:256]) for c in conversations]
    arms = {
        name: LocalEngine(target, GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, batching=name))
        for name in ("padded", "continuous")
    }
    rates: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, engine in arms.items():
            start = time.perf_counter()
            responses = engine.generate(requests, seed=0)
            seconds = time.perf_counter() - start
            tokens[name] = sum(map(len, responses))
            rates[name].append(tokens[name] / seconds)
    rows = [
        {"batching": name, "tokens": tokens[name], "tokens_per_s": round(statistics.median(rates[name]), 1), "rounds": [round(r, 1) for r in rates[name]]}
        for name in arms
    ]
    print(
        f"{len(requests)} prompts, up to {args.max_new_tokens} new tokens, batch {args.batch_size}, {target.dtype} on {device}, {torch.get_num_threads()} threads"
    )
    for row in rows:
        print(f"  {row['batching']:>10}: {row['tokens_per_s']:7.1f} tokens/s ({row['tokens']} tokens; rounds {row['rounds']})")
    out = args.out or ROOT / "benchmarks" / "results" / f"generation_throughput_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    environment = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "device": str(device), "dtype": str(target.dtype)}
    out.write_text(json.dumps({"environment": environment, "arguments": vars(args) | {"out": str(out)}, "rows": rows}, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
