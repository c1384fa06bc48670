"""How much does the drafter's first position gain from more training data? A learning curve on a finished run.

    python benchmarks/data_ceiling.py                      # reads results/ of a `snakemake --cores 1 train`
    python benchmarks/data_ceiling.py --results other/results --heldout 30

Block position 1 predicts the token after the last verified one: x[t+1] from x[t]
and the target's hidden states up to t-1, which is what a drafter sees. Two
predictors that train to convergence in about a minute each, on growing shares of
the run's training samples, are scored on the same held-out samples:

- the previous-token table: the most frequent x[t+1] after x[t] (a bigram model);
- a linear probe: [embedding of x[t], standardised target features at t-1] → the
  target's LM head (over the tokens the training responses use), AdamW to a plateau.

Neither is a drafter; together they show how first-position accuracy grows per
doubling of regenerated data, which bounds what any drafter trained on that data can
reach cheaply: a τ of 2 needs first-position accuracy well above 0.5. Reads the run's
samples (``data/train.parquet``) and its hidden-state cache (``cache/train/hidden-states``).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def first_position_examples(samples, cache):
    """Per anchor t (training's anchor rule; t ≥ 1 so that features at t-1 exist): x[t], features at t-1,
    x[t+1], and the sample it comes from."""
    from dflash.objective import sample_anchors

    current, previous_features, following, sample_of = [], [], [], []
    for i, (ids, mask) in enumerate(zip(samples["input_ids"], samples["loss_mask"])):
        ids, mask = torch.tensor(np.asarray(ids)), torch.tensor(np.asarray(mask)).bool()
        anchors, valid = sample_anchors(mask[None], max_anchors=len(mask))  # every candidate
        anchors = anchors[valid]
        anchors = anchors[anchors >= 1]
        current.append(ids[anchors])
        previous_features.append(cache[i][anchors - 1].half())
        following.append(ids[anchors + 1])
        sample_of.append(torch.full((len(anchors),), i))
    return tuple(map(torch.cat, (current, previous_features, following, sample_of)))


def bigram_accuracy(current, following, train, test) -> float:
    table = collections.defaultdict(collections.Counter)
    for a, b in zip(current[train].tolist(), following[train].tolist()):
        table[a][b] += 1
    guesses = [table[a].most_common(1)[0][0] if a in table else -1 for a in current[test].tolist()]
    return float((torch.tensor(guesses) == following[test]).float().mean())


def probe_accuracy(target, current, features, following, train, test, steps: int, seed: int) -> float:
    torch.manual_seed(seed)
    vocab = torch.unique(following[train])
    index = torch.full((target.lm_head.weight.shape[0],), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    head = target.lm_head.weight.detach()[vocab]
    # The target's residual stream has a few dimensions 100x the others; standardise so that they do not drown the rest.
    scale = 1.0 / (features[train].float().std(0) + 1e-3)
    hidden = target.hidden_size
    from_token = torch.nn.Linear(hidden, hidden, bias=False)
    from_context = torch.nn.Linear(features.shape[1], hidden, bias=False)
    for layer in (from_token, from_context):
        torch.nn.init.normal_(layer.weight, std=0.02)
    norm = torch.nn.RMSNorm(hidden)
    params = [*from_token.parameters(), *from_context.parameters(), *norm.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)

    def logits(rows):
        with torch.no_grad():
            token = target.embed(current[rows])
        return norm(from_token(token) + from_context(features[rows].float() * scale)) @ head.t()

    train_rows = torch.nonzero(train).squeeze(1)
    labels = index[following]
    for _ in range(steps):
        rows = train_rows[torch.randint(len(train_rows), (128,))]
        loss = torch.nn.functional.cross_entropy(logits(rows), labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        test_rows = torch.nonzero(test).squeeze(1)
        return float((logits(test_rows).argmax(-1) == labels[test_rows]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--heldout", type=int, default=30, help="the last N training samples are scored, never trained on")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--steps", type=int, default=1200, help="probe steps of 128 examples (it plateaus by ~1000 on the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_ceiling.json")
    args = parser.parse_args()

    from dflash.config import cpu_threads
    from dflash.data import read_samples
    from dflash.features import HiddenStateCache
    from dflash.target import load_from_manifest

    torch.set_num_threads(cpu_threads())
    samples_path = args.results / "data" / "train.parquet"
    cache_dir = args.results / "cache" / "train" / "hidden-states"
    manifest = args.results / "target" / "target.json"
    for path in (samples_path, cache_dir / "meta.json", manifest):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run `snakemake --cores 1 train` first (or pass --results)")
    if not all(0 < fraction <= 1 for fraction in args.fractions):
        raise SystemExit(f"--fractions must lie in (0, 1], got {args.fractions}: a share above 1 would train on held-out samples")
    samples = read_samples(samples_path)
    if not 0 < args.heldout < len(samples):
        raise SystemExit(f"--heldout must be between 1 and {len(samples) - 1} (the run has {len(samples)} samples)")
    target = load_from_manifest(manifest)
    current, features, following, sample_of = first_position_examples(samples, HiddenStateCache(cache_dir))
    trainable = len(samples) - args.heldout
    is_heldout = sample_of >= trainable

    rows = []
    for fraction in args.fractions:
        used = max(1, round(trainable * fraction))
        train = sample_of < used
        start = time.perf_counter()
        row = {
            "fraction": fraction,
            "samples": used,
            "examples": int(train.sum()),
            "bigram_acc": bigram_accuracy(current, following, train, is_heldout),
            "probe_acc": probe_accuracy(target, current, features, following, train, is_heldout, args.steps, args.seed),
        }
        rows.append(row)
        print(
            f"{used:5d} samples {row['examples']:7d} examples   bigram {row['bigram_acc']:.3f}   probe {row['probe_acc']:.3f}"
            f"   ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"results": str(args.results), "heldout_samples": args.heldout, "heldout_examples": int(is_heldout.sum()), "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"held-out: {args.heldout} samples, {report['heldout_examples']} first-position examples; written {args.out}")


if __name__ == "__main__":
    main()
