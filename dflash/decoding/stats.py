"""What a decoding did, step by step: acceptance, what each step verified and whose tokens, the gate's predictions
against what the target accepted, and the time each part took."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from dflash.decoding.proposal import Proposal
from dflash.decoding.verify import Verified


@dataclass
class DecodeStats:
    block_size: int
    num_input_tokens: int
    num_output_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify step: accepted draft tokens + 1
    verified: list[int] = field(default_factory=list)  # per verify step: draft tokens verified (0: a plain step)
    verify_seconds: list[float] = field(default_factory=list)  # per verify step: the target's forward, as decoding paid it
    choices: Counter = field(default_factory=Counter)  # per verify step: whose tokens were verified ("a+b": both; "" for none)
    consulted: Counter = field(default_factory=Counter)  # a gated proposer's: how many steps each candidate drafted on
    # Per draft position verified after an accepted prefix: (position 1.., predicted acceptance, accepted).
    predictions: list[tuple[int, float, bool]] = field(default_factory=list)
    target_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # the part of decode_seconds spent proposing

    def record(self, proposal: Proposal, draft: list[int], parents: list[int], step: Verified) -> None:
        """One verify step: of ``proposal``, ``draft`` (its tokens' ``parents``) was verified, as ``step`` decided."""
        self.target_forwards += 1
        self.verify_seconds.append(step.seconds)
        self.acceptance_lengths.append(len(step.path) + 1)
        self.verified.append(len(draft))
        self.choices[proposal.source if draft else ""] += 1
        if proposal.accept is not None:  # every draft token whose parent was accepted: was it?
            reached = {-1, *step.path}
            drafted = min(proposal.drafted, len(draft))
            self.predictions += [(step.depths[i + 1], proposal.accept[i], i in step.path) for i in range(drafted) if parents[i] in reached]

    @property
    def tau(self) -> float:
        """Acceptance length: mean over verify steps of accepted draft tokens plus the bonus token."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """For draft position k = 1..B-1: the fraction of verify steps that accepted it."""
        steps = len(self.acceptance_lengths)
        return [sum(length - 1 >= k for length in self.acceptance_lengths) / steps if steps else 0.0 for k in range(1, self.block_size)]

    def steps_with(self, source: str) -> int:
        """Verify steps that verified tokens of the proposer ``source`` (alone or beside others')."""
        return sum(n for key, n in self.choices.items() if source in key.split("+"))

    @property
    def mean_verified(self) -> float:
        return sum(self.verified) / len(self.verified) if self.verified else 0.0

    @property
    def time_per_output_token(self) -> float:
        return self.decode_seconds / self.num_output_tokens if self.num_output_tokens else float("nan")


@dataclass
class Generation:
    tokens: torch.Tensor  # [num_output_tokens], the new tokens only
    stats: DecodeStats
