"""The gate: how many draft tokens a decoding step verifies, and the verify cost it decides with.

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
calibrated on validation data (``dflash.decoding.calibration``); prompt
lookup's from the acceptance observed so far for proposals of the same match
length (``dflash.decoding.lookup``). ``GatedProposer`` is the gate as a
proposer: of its candidates' proposals, merged, what the verify takes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash.decoding.proposal import Proposal, Proposer, merge, path_values, token_depths
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


class GatedProposer:
    """Per step, the verify takes the tokens whose expected committed tokens most exceed what their cost earns at the
    decoding's rate so far (``VerifyCost.best_count``, the cost including every draft made that step; the rate from
    ``throughput``, which each verify updates, shared across requests where given): of the candidates' proposals, merged
    into one token tree, the tokens most likely accepted, padded to the cheapest width. One candidate is a
    confidence-gated drafter; a drafter and prompt lookup, the hybrid, whose verify may try lookup's continuation and
    the drafter's beside it. Candidates are asked cheapest first, and a costly one only when the best proposal its
    ``ceiling`` allows beats the best so far after paying for it: the drafter is not run on the steps where lookup's
    proposal leaves it nothing to add. A candidate not asked still observes every target forward, so its state (the
    drafter's cache) catches up when it is next asked."""

    def __init__(self, candidates: list[Proposer], cost: VerifyCost, throughput: Throughput | None = None):
        self.candidates, self.cost = sorted(candidates, key=lambda c: c.draft_cost), cost
        self.throughput = Throughput() if throughput is None else throughput
        self.candidates_by_name = {c.name: c for c in candidates}
        self.name = "+".join(c.name for c in candidates)
        self.needs_hidden_states = any(c.needs_hidden_states for c in candidates)
        self.draft_cost = sum(c.draft_cost for c in candidates)
        self.block_size = cost.max_width
        self._proposals: dict[str, Proposal] = {}  # this step's, by candidate
        self._spent = 0.0  # this step's drafting

    def observe(self, hidden_states, count: int, start: int) -> None:
        for candidate in self.candidates:
            candidate.observe(hidden_states, count, start)

    @staticmethod
    def _ranked(proposal: Proposal) -> list[int]:
        """The proposal's tokens, most likely accepted first (each after its parent: a token is never likelier than it)."""
        values, depths = proposal.values(), token_depths(proposal.parent_indices())
        return sorted(range(len(values)), key=lambda i: (-values[i], depths[i]))

    def _best(self, values: list[float], count: int, spent: float, rate: float) -> tuple[int, float]:
        """The best count of the tokens of ``values`` (highest first) and its surplus at ``rate``."""
        n, surplus = self.cost.best_count(values[:count], spent, rate)
        return min(n, count), surplus

    def choose(self, proposal: Proposal, count: int, spent: float, last: int, rate: float) -> Proposal:
        """What the verify takes of ``proposal``: its most likely accepted tokens, as many as earn most beyond their
        cost at ``rate`` (``spent``: the step's drafting), at most ``count``, padded to their width (with ``last``, the
        last committed token, where the proposal has none); none where a plain step earns more."""
        ranked = self._ranked(proposal)
        values = proposal.values()
        n, _ = self._best([values[i] for i in ranked], count, spent, rate)
        if n == 0:
            return Proposal([], accept=[], source="")
        chosen = ranked[:n]
        index = {old: new for new, old in enumerate(chosen)}
        parents = [index.get(proposal.parent_indices()[i], -1) for i in chosen]
        # Slots past the proposal's end (a short lookup match, or none where a wider verify costs less than a plain
        # step) are filled with its last token, each following the one before: free, since the padded width costs no
        # more, and lossless, since any token may be verified.
        fill = n - len(chosen)
        parents += range(len(chosen) - 1, n - 1)
        origins = None if proposal.origins is None else [proposal.origins[i] for i in chosen]
        names = [c.name for c in self.candidates if origins is not None and any(c.name in o for o in origins)]
        return Proposal(
            [proposal.tokens[i] for i in chosen] + [proposal.tokens[chosen[-1]] if chosen else last] * fill,
            accept=[proposal.accept[i] for i in chosen] + [0.0] * fill,
            parents=None if parents == list(range(-1, n - 1)) else parents,
            source="+".join(names) if origins is not None else proposal.source,  # merged: whose tokens it verifies
            match=proposal.match,
            own=len(chosen),
            origins=origins,
        )

    def propose(self, tokens: list[int], count: int) -> Proposal:
        self._proposals, spent, rate = {}, 0.0, self.throughput.rate
        merged, pool = None, []  # the proposals so far as one tree, and its values, highest first
        for candidate in self.candidates:
            ceiling = candidate.ceiling(count)
            if ceiling is not None:
                # At best the candidate adds tokens of the highest values it could give, none of them already proposed.
                reach = self._best(sorted(pool + ceiling, reverse=True), count, spent + candidate.draft_cost, rate)[1]
                if reach <= self._best(pool, count, spent, rate)[1]:
                    continue
            proposal = candidate.propose(tokens, count)
            if proposal.accept is None:
                raise ValueError(f"a gated proposer needs confidences, and {candidate.name!r} gives none (a drafter needs a calibration)")
            self._proposals[candidate.name] = proposal
            spent += candidate.draft_cost
            merged = merge(list(self._proposals.values()))
            pool = sorted(merged.values(), reverse=True)
        consulted, self._spent = tuple(self._proposals), spent
        if merged is None:
            return Proposal([], accept=[], source="", consulted=consulted)
        return dataclasses.replace(self.choose(merged, count, spent, tokens[-1], rate), consulted=consulted)

    def ceiling(self, count: int) -> list[float] | None:
        return None

    def feedback(self, proposal: Proposal, path: list[int]) -> None:
        """The step's tokens and cost go to the throughput; each candidate hears of its own tokens: those verified (a
        chain's are a prefix of it), and those accepted."""
        self.throughput.update(len(path) + 1, self.cost.relative[len(proposal.tokens)] + self._spent)
        for name, own in self._proposals.items():
            verified = [i for i in range(proposal.drafted) if name in proposal.origins[i]]
            if verified:
                mine = dataclasses.replace(own, tokens=own.tokens[: len(verified)], own=None)
                own_path = [k for k, i in enumerate(verified) if i in path]
                self.candidates_by_name[name].feedback(mine, own_path)
