"""The drafter's confidence: per draft position, the probability that a token is accepted given that the ones
before it were, as a function of the drafter's own probability of it, fitted on validation data the drafter never
trained on (per rank: its first choice, and its second, third... as alternatives to the first).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.errors import InputError


@dataclass
class Calibration:
    """Per draft position k: the probability that it is accepted given that 1..k-1 were, as a non-decreasing step
    function of the drafter's top probability there (equal-count bins made monotone by pooling adjacent violators)."""

    upper: list[list[float]]  # per position: each bin's highest top probability (the last bin takes everything above)
    rates: list[list[float]]  # per position: each bin's observed acceptance
    counts: list[list[int]]
    # The same for the drafter's second, third... choice at each position, as the alternative to its first: the
    # probability that it is the target's token given that the first choices before it were.
    runner_up: list[Calibration] = field(default_factory=list)

    @property
    def positions(self) -> int:
        return len(self.rates)

    def __call__(self, probs: Sequence[float]) -> list[float]:
        out = []
        for k, p in enumerate(probs):
            if k >= self.positions or not self.rates[k]:
                out.append(0.0)  # never observed: no claim of acceptance
                continue
            upper, rates = self.upper[k], self.rates[k]
            out.append(next((r for u, r in zip(upper, rates) if p <= u), rates[-1]))
        return out

    def ceiling(self, count: int) -> list[float]:
        """The highest acceptance each of positions 1..``count`` can be given (the rates never fall with the probability)."""
        return [rates[-1] if rates else 0.0 for rates in self.rates[:count]] + [0.0] * max(0, count - self.positions)

    @classmethod
    def fit(cls, probs: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor, bins: int = 10, first: torch.Tensor | None = None) -> Calibration:
        """From blocks ``[N, P]``: the drafter's probability of a token at positions 1..P, whether it was the target's
        token, and whether the position was labelled. Position k uses the blocks whose positions 1..k-1 were all
        correct: by ``first`` ``[N, P]``, the correctness of the first choices, where ``probs`` are of another."""
        first = correct if first is None else first
        upper, rates, counts = [], [], []
        prefix = torch.ones(probs.shape[0], dtype=torch.bool)
        for k in range(probs.shape[1]):
            use = prefix & counted[:, k]
            p, y = probs[use, k].double(), correct[use, k].double()
            order = p.argsort()
            p, y = p[order], y[order]
            groups = [g for g in torch.tensor_split(torch.arange(len(p)), min(bins, len(p))) if len(g)] if len(p) else []
            # Pool adjacent violators: merge bins until the rates never fall as the probability rises.
            pooled: list[list[float]] = []  # [upper, sum of correct, count]
            for g in groups:
                pooled.append([float(p[g[-1]]), float(y[g].sum()), len(g)])
                while len(pooled) > 1 and pooled[-2][1] / pooled[-2][2] >= pooled[-1][1] / pooled[-1][2]:
                    last = pooled.pop()
                    pooled[-1] = [last[0], pooled[-1][1] + last[1], pooled[-1][2] + last[2]]
            upper.append([u for u, _, _ in pooled])
            rates.append([s / n for _, s, n in pooled])
            counts.append([n for _, _, n in pooled])
            prefix = prefix & first[:, k] & counted[:, k]
        return cls(upper=upper, rates=rates, counts=counts)

    @classmethod
    def fit_ranked(cls, probs: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor, bins: int = 10) -> Calibration:
        """From blocks ``[N, P, R]``: the drafter's R most probable tokens at each position, best first. The first
        choice's calibration, with its ``runner_up`` for the others."""
        calibration = cls.fit(probs[..., 0], correct[..., 0], counted, bins)
        calibration.runner_up = [cls.fit(probs[..., r], correct[..., r], counted, bins, first=correct[..., 0]) for r in range(1, probs.shape[-1])]
        return calibration

    def to_dict(self) -> dict:
        return {"upper": self.upper, "rates": self.rates, "counts": self.counts, "runner_up": [c.to_dict() for c in self.runner_up]}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        runner_up = [cls.from_dict(c) for c in data.get("runner_up", [])]
        return cls(upper=data["upper"], rates=data["rates"], counts=data["counts"], runner_up=runner_up)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InputError(f"{path}: not a calibration written by dflash ({err}); rerun the evaluate stage") from err


def acceptance_lengths(correct: torch.Tensor, counted: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Per block ``[N, P]``: the acceptance length greedy speculative decoding gets from it, 1 plus the run of correct
    positions from the first (a position not labelled ends the run); ``lengths`` ``[N]`` caps how many are verified."""
    run = (correct & counted).int().cumprod(1)
    if lengths is not None:
        run = run * (torch.arange(run.shape[1])[None] < lengths[:, None])
    return 1 + run.sum(1)
