"""How many draft tokens a decoding step verifies: the target's verify cost, calibrated confidence, the gate.

A verify of k tokens costs c(k) target steps (c(1) = 1), measured on the
machine at hand, then learnt from what decoding pays (``PaidCost``). A
proposal of n tokens whose conditional acceptance probabilities are q_1..q_n
(q_j: token j is accepted given that 1..j-1 were) commits, in expectation,

    E(n) = 1 + sum_{m <= n} prod_{j <= m} q_j

tokens, counting the target's own next token. The gate proposes the n in
0..N that maximises E(n) - R (C(n + 1) + d): C(k) is the cheapest width at or
above k (a verify is padded to that width, its extra slots filled with more
draft tokens, which can only add accepted tokens), d what drafting costs per
step, and R the tokens per plain step the decoding has committed so far
(``Throughput``). Maximising that surplus with R the policy's own long-run rate
maximises the rate (a renewal-reward argument; Dinkelbach's for ratios): a
step verifies one more token only if what it adds to E beats what its added
cost earns at the rate decoding already gets. The per-step ratio E / (C + d)
would not: it takes tokens worth less than R where the drafting is sunk, and
stops short where a long proposal earns more than R at the margin. With no
confidence the gate proposes nothing; with full confidence, the whole block
wherever the verify costs less than a step per token.

A token tree (alternatives to a token, each on a branch of its own) is gated
the same way: E is 1 plus the sum, over the tokens verified, of each one's
probability that its whole branch is accepted (its path value), so the gate
takes the tokens of highest path value. A chain's path values are the
products above; an alternative's is its own q times its parent's.

The drafter's q come from its own probability of each token it proposes,
calibrated on validation data per position and per rank (``Calibration``: its
first choice, and its second, third... as alternatives to the first); prompt
lookup's from the acceptance observed so far for proposals of the same match
length (``LookupConfidence``).
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.errors import InputError


@dataclass(frozen=True)
class VerifyCost:
    """The target's forward over k new tokens, relative to one token: ``relative[k - 1]`` = c(k) / c(1)."""

    relative: tuple[float, ...]
    step_ms: float | None = None  # c(1), where measured

    def __post_init__(self):
        if not self.relative or any(c <= 0 for c in self.relative):
            raise InputError(f"a verify cost table needs positive costs for widths 1..k, got {list(self.relative)}")

    @property
    def max_width(self) -> int:
        return len(self.relative)

    def width(self, wanted: int) -> int:
        """The cheapest width at or above ``wanted`` (the first of equals): what a verify of ``wanted`` tokens is padded to."""
        if not 1 <= wanted <= self.max_width:
            raise ValueError(f"width {wanted} outside the cost table's 1..{self.max_width}")
        return min(range(wanted, self.max_width + 1), key=lambda k: (self.relative[k - 1], k))

    def best_count(self, values: Sequence[float], draft_cost: float = 0.0, rate: float = 1.0) -> tuple[int, float]:
        """``(n, surplus)``: how many draft tokens to verify after the last committed one, and the expected committed
        tokens beyond what the step's cost would earn at ``rate`` tokens per plain step, E - rate x (C + d). ``values``
        are the proposal's tokens' probabilities of being accepted, each its whole path's (a token counts only with
        every token before it on its branch), highest first: the verify takes the first n, padded to their cheapest
        width (slots past the proposal's end expect nothing). A chain's values are the running products of its
        conditional acceptances (``path_values``). Ties go to the shorter verify."""
        limit = min(len(values), self.max_width - 1)
        best, best_surplus = 0, -math.inf
        for n in range(limit + 1):
            width = self.width(n + 1)
            surplus = 1.0 + sum(values[: width - 1]) - rate * (self.relative[width - 1] + draft_cost)
            if surplus > best_surplus + 1e-12:
                best, best_surplus = width - 1, surplus
        return best, best_surplus

    def best_length(self, accept: Sequence[float], draft_cost: float = 0.0, rate: float = 1.0) -> tuple[int, float]:
        """``best_count`` for a chain whose tokens' conditional acceptance probabilities are ``accept``."""
        return self.best_count(path_values(accept), draft_cost, rate)

    def to_dict(self) -> dict:
        return {"relative": list(self.relative), "step_ms": self.step_ms}


@dataclass
class PaidCost:
    """The verify cost as decoding pays it, learnt while decoding: each verify's forward is timed relative to a plain
    step of the same prompt (the median step of its autoregressive baseline, decoded just before it), so load that
    drifts between prompts cancels. The table the gate decides with (``table``) takes, per width, the median paid so
    far, with the ``prior`` (measured at the start, or given) counting as ``prior_weight`` verifies of it: a width
    decoding has not verified keeps its prior cost, one verified often its paid cost. ``prior_weight`` None: the prior,
    never updated."""

    prior: VerifyCost
    prior_weight: int | None = None
    paid: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # per width: each verify, in plain steps

    def record(self, verified: Sequence[int], seconds: Sequence[float], step_seconds: float) -> None:
        """One decoding's verifies: the draft tokens each verified and its forward's seconds; ``step_seconds``, the
        same prompt's plain step."""
        for drafted, elapsed in zip(verified, seconds, strict=True):
            self.paid[drafted + 1].append(elapsed / step_seconds)

    def table(self) -> VerifyCost:
        if self.prior_weight is None:
            return self.prior
        relative = []
        for k, prior in enumerate(self.prior.relative, 1):
            paid = self.paid.get(k, [])
            relative.append((len(paid) * statistics.median(paid) + self.prior_weight * prior) / (len(paid) + self.prior_weight) if paid else prior)
        return VerifyCost(tuple(relative), self.prior.step_ms)

    def paid_table(self) -> dict[int, dict]:
        """Per width verified: the median paid, in plain steps, and how many verifies it is of."""
        return {k: {"relative": statistics.median(v), "verifies": len(v)} for k, v in sorted(self.paid.items())}


@dataclass
class Throughput:
    """A gated decoding's committed tokens per unit of cost so far (its verifies and drafts, in plain steps): the
    ``rate`` its gate weighs each step's cost with. ``prior_steps`` plain steps (a token for a step's cost) start it."""

    tokens: float = 0.0
    cost: float = 0.0
    prior_steps: int = 8

    @property
    def rate(self) -> float:
        return (self.tokens + self.prior_steps) / (self.cost + self.prior_steps)

    def update(self, tokens: int, cost: float) -> None:
        self.tokens += tokens
        self.cost += cost


def path_values(accept: Sequence[float]) -> list[float]:
    """A chain's tokens' probabilities of being accepted: the running products of their conditional ones."""
    return list(itertools.accumulate(accept, operator.mul))


@torch.no_grad()
def measure_verify_cost(target, max_width: int, context: int = 256, repeats: int = 15) -> VerifyCost:
    """c(k)/c(1) for k = 1..``max_width``: the target's forward over k new tokens after ``context`` cached ones, as
    decoding runs it. Each round times every width once, and c(k)/c(1) is the median over rounds of the round's own
    ratio: load from other processes drifts over seconds, and a ratio within a round cancels it."""
    from transformers import DynamicCache

    device = target.device
    ids = torch.randint(0, target.config.vocab_size, (1, context + max_width), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache(config=target.config)
    target.forward(ids[:, :context], cache, logits_to_keep=1)

    def verify(k: int) -> float:
        begin = time.perf_counter()
        target.forward(ids[:, context : context + k], cache, position_ids=torch.arange(context, context + k, device=device)[None])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cache.crop(-k)
        return (time.perf_counter() - begin) * 1e3

    for k in range(1, max_width + 1):  # warm every width once
        verify(k)
    rounds = [[verify(k) for k in range(1, max_width + 1)] for _ in range(repeats)]
    relative = [statistics.median(r[k] / r[0] for r in rounds) for k in range(max_width)]
    return VerifyCost(relative=tuple(relative), step_ms=statistics.median(r[0] for r in rounds))


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


@dataclass
class LookupConfidence:
    """Prompt lookup's acceptance so far, by match length and position: (accepted + 1) / (tried + 2) for the k-th token
    of a proposal whose n-gram matched ``match`` tokens, given tokens 1..k-1 were accepted."""

    tried: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    accepted: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))

    def __call__(self, match: int, count: int) -> list[float]:
        return [(self.accepted[match, k] + 1) / (self.tried[match, k] + 2) for k in range(1, count + 1)]

    def update(self, match: int, verified: int, accepted: int) -> None:
        for k in range(1, min(verified, accepted + 1) + 1):
            self.tried[match, k] += 1
            self.accepted[match, k] += k <= accepted
