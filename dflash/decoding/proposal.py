"""What a proposer drafts, and what ``speculative_generate`` asks of it.

A ``Proposal`` is the draft tokens to verify after the last committed one: a chain, or a token tree (alternatives to
a token, each on a branch of its own), with each token's probability of acceptance where the proposer knows it. A
``Proposer`` drafts them; ``merge`` makes one tree of several proposals (the hybrid's).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Proposal:
    """Draft tokens to verify after the last committed one, with what is known of them: a chain, or a token tree."""

    tokens: list[int]
    accept: list[float] | None = None  # per token: the probability it is accepted given its parent is (None: unknown)
    # Per token: the index of the token it follows (-1: the last committed one), parents before their children;
    # None: a chain, each token following the one before.
    parents: list[int] | None = None
    source: str = ""  # the proposer's name
    match: int = 0  # prompt lookup: the length of the n-gram that matched
    own: int | None = None  # how many of ``tokens`` the proposer drafted (the rest pad the verify); None: all
    consulted: tuple[str, ...] = ()  # a gated proposer's: the candidates that drafted this step
    origins: list[frozenset[str]] | None = None  # a gated proposer's: per drafted token, the candidates that proposed it

    @property
    def drafted(self) -> int:
        return len(self.tokens) if self.own is None else self.own

    def parent_indices(self) -> list[int]:
        return list(range(-1, len(self.tokens) - 1)) if self.parents is None else self.parents

    def values(self) -> list[float]:
        """Per token: the probability that it is accepted, its whole branch up to it with it."""
        values: list[float] = []
        for parent, q in zip(self.parent_indices(), self.accept):
            values.append(q * (values[parent] if parent >= 0 else 1.0))
        return values


def token_depths(parents: list[int]) -> list[int]:
    """Per draft token: its position after the last committed token (1: its child)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 1)
    return depths


def path_values(accept: Sequence[float]) -> list[float]:
    """A chain's tokens' probabilities of being accepted: the running products of their conditional ones."""
    return list(itertools.accumulate(accept, operator.mul))


class Proposer(Protocol):
    """What ``speculative_generate`` drafts with. ``observe`` is told of every target forward (the prefill from
    position 0, then each verify's accepted positions), whether or not ``propose`` is called after it; ``feedback``,
    after every step it proposed for (an empty proposal too), of the proposal's tokens the target accepted (their
    indices, from the first); ``ceiling`` bounds, highest first, the ``values`` a proposal of up to ``count`` tokens
    could carry, before drafting it (None: no bound known)."""

    name: str
    needs_hidden_states: bool
    draft_cost: float  # a proposal's cost, in target steps

    def observe(self, hidden_states, count: int, start: int) -> None: ...

    def propose(self, tokens: list[int], count: int) -> Proposal: ...

    def ceiling(self, count: int) -> list[float] | None: ...

    def feedback(self, proposal: Proposal, path: list[int]) -> None: ...


def merge(proposals: list[Proposal]) -> Proposal:
    """One token tree of several proposals, each token's ``origins`` the proposers that proposed it: tokens on the same
    path are one, with the highest probability of acceptance any proposer gives it."""
    tokens: list[int] = []
    parents: list[int] = []
    values: list[float] = []
    origins: list[set[str]] = []
    index: dict[tuple[int, int], int] = {}
    for proposal in proposals:
        node_of: list[int] = []
        for parent, token, value in zip(proposal.parent_indices(), proposal.tokens, proposal.values()):
            key = (node_of[parent] if parent >= 0 else -1, token)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
                values.append(0.0)
                origins.append(set())
            node = index[key]
            values[node] = max(values[node], value)
            origins[node].add(proposal.source)
            node_of.append(node)
    # A token is never likelier than its parent (each proposer's are not, and a parent takes the highest of its
    # proposers'), so its conditional probability is the ratio.
    accept = [value / values[parent] if parent >= 0 and values[parent] > 0 else value for value, parent in zip(values, parents)]
    names = list(dict.fromkeys(p.source for p in proposals))
    return Proposal(tokens, accept=accept, parents=parents, source="+".join(names), origins=[frozenset(o) for o in origins])
