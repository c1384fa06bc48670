"""The arms of an evaluation, as data: each a name and the proposers it drafts with (none: the autoregressive
baseline), gated or not. Proposers are registered by name in ``PROPOSERS``, each with the function that builds it
for a prompt from what the arms share; adding a proposer is a module of its own and one line there (or a call to
``register_proposer``). An arm of several proposers is gated: the gate merges their proposals."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dflash.decoding import drafter, lookup
from dflash.decoding.calibration import Calibration
from dflash.decoding.gate import GatedProposer, PaidCost, Throughput
from dflash.decoding.generate import speculative_generate
from dflash.decoding.lookup import LookupConfidence, PromptLookup
from dflash.decoding.proposal import Proposer
from dflash.decoding.stats import Generation
from dflash.model import DFlashDrafter
from dflash.target import Target


@dataclass(frozen=True)
class Arm:
    name: str
    proposers: tuple[str, ...] = ()  # registered proposers' names; none: the autoregressive baseline
    gated: bool = True  # the gate decides what each step verifies (always, with several proposers)


def evaluation_arms(gate: bool) -> list[Arm]:
    """The evaluation's arms, in the order each prompt is decoded: the autoregressive baseline first (the others'
    verifies are timed against its step), the drafter, prompt lookup, the hybrid of both."""
    return [Arm("baseline"), Arm("dflash", ("dflash",), gated=gate), Arm("lookup", ("lookup",), gated=False), Arm("hybrid", ("dflash", "lookup"))]


@dataclass
class Shared:
    """What the arms share across prompts: the models, the drafter's calibration and logits (``draft_head``, built
    once), what is learnt as they decode (prompt lookup's acceptance by match length, the verify cost as paid, each
    gated arm's rate)."""

    target: Target
    drafter: DFlashDrafter
    block_size: int
    lookup: PromptLookup
    cost: PaidCost  # every arm's verifies teach it; the gated arms decide with its table as it stands
    calibration: Calibration
    head: Callable[[torch.Tensor], torch.Tensor]
    draft_cost: float = 0.0  # the drafter's proposal, in target steps
    branches: int = 1  # gated: the drafter's most probable tokens per position the verify may try
    confidence: LookupConfidence = field(default_factory=LookupConfidence)
    throughput: dict[str, Throughput] = field(default_factory=lambda: defaultdict(Throughput))  # per gated arm


# A proposer for a prompt, built from what the arms share, gated or not, and the widest verify it needs.
ProposerFactory = Callable[[Shared, bool], tuple[Proposer, int]]

PROPOSERS: dict[str, ProposerFactory] = {
    "dflash": drafter.for_arm,
    "lookup": lookup.for_arm,
}


def register_proposer(name: str, factory: ProposerFactory) -> None:
    if name in PROPOSERS:
        raise ValueError(f"a proposer named {name!r} is registered already")
    PROPOSERS[name] = factory


def build(arm: Arm, shared: Shared) -> tuple[Proposer | None, int]:
    """A fresh proposer for one prompt (the drafter's cache is per request), and the arm's widest verify."""
    if not arm.proposers:
        return None, 1
    unknown = [name for name in arm.proposers if name not in PROPOSERS]
    if unknown:
        raise ValueError(f"arm {arm.name!r}: no proposer registered as {', '.join(unknown)} (known: {', '.join(PROPOSERS)})")
    built = [PROPOSERS[name](shared, arm.gated or len(arm.proposers) > 1) for name in arm.proposers]
    width = max(w for _, w in built)
    if not arm.gated and len(built) == 1:
        return built[0][0], width
    return GatedProposer([p for p, _ in built], shared.cost.table(), shared.throughput[arm.name]), width


def decode_arms(arms: Sequence[Arm], shared: Shared, ids: torch.Tensor, max_new_tokens: int) -> dict[str, Generation]:
    """One prompt decoded by every arm in turn, each built after the last has taught the cost what it paid; the
    first arm, the autoregressive baseline, gives the median plain step the others' verifies are timed against."""
    if not arms or arms[0].proposers:
        raise ValueError(f"the first arm must be the autoregressive baseline (no proposers), got {arms[0] if arms else 'no arms'}")
    generations: dict[str, Generation] = {}
    step = None
    for arm in arms:
        proposer, width = build(arm, shared)
        generation = generations[arm.name] = speculative_generate(shared.target, proposer, ids, max_new_tokens, block_size=width)
        seconds = generation.stats.verify_seconds
        if step is None:
            step = statistics.median(seconds) if seconds else 0.0  # 0: the prefill answered, in every arm
        if step:
            shared.cost.record(generation.stats.verified, seconds, step)
    return generations
