"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's last n-gram. Needs
no training; with a ``LookupConfidence``, each token carries the acceptance seen so far for its match length."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dflash.decoding.proposal import Proposal


@dataclass
class PromptLookup:
    """Prompt lookup decoding: propose the up to ``num_tokens`` tokens that followed the latest earlier occurrence
    of the context's last n-gram (the longest of ``max_ngram`` down to 1 that occurs before). Needs no training."""

    num_tokens: int = 10
    max_ngram: int = 3

    @property
    def block_size(self) -> int:
        return self.num_tokens + 1


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


class PromptLookupProposer:
    """Prompt lookup as a proposer; with a ``confidence``, each token carries the acceptance observed so far for
    proposals of the same match length, and learns from every verify."""

    name = "lookup"
    needs_hidden_states = False
    draft_cost = 0.0

    def __init__(self, lookup: PromptLookup, confidence: LookupConfidence | None = None):
        self.lookup, self.confidence = lookup, confidence

    def observe(self, hidden_states, count: int, start: int) -> None:
        pass

    def propose(self, tokens: list[int], count: int) -> Proposal:
        count = min(count, self.lookup.num_tokens)
        for n in range(min(self.lookup.max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for begin in range(len(tokens) - n - 1, -1, -1):  # the latest earlier occurrence
                if tokens[begin : begin + n] == suffix:
                    found = tokens[begin + n : begin + n + count]
                    accept = self.confidence(n, len(found)) if self.confidence is not None else None
                    return Proposal(found, accept=accept, source=self.name, match=n)
        return Proposal([], accept=[], source=self.name)

    def ceiling(self, count: int) -> list[float] | None:
        return None  # proposing is free: ask

    def feedback(self, proposal: Proposal, path: list[int]) -> None:
        if self.confidence is not None and proposal.drafted:
            self.confidence.update(proposal.match, proposal.drafted, len(path))


def for_arm(shared, gated: bool) -> tuple[PromptLookupProposer, int]:
    """Prompt lookup in an evaluation arm, and its widest verify: gated, with the confidence learnt across prompts."""
    return PromptLookupProposer(shared.lookup, shared.confidence if gated else None), shared.lookup.block_size
