"""The DFlash drafter as a proposer: one forward over ``[last token, MASK x n]`` from the target's hidden states
drafts n tokens; with a calibration, each carries its probability of acceptance, and the proposal may be a tree of
the drafter's first and next choices."""

from __future__ import annotations

import torch

from dflash.decoding.calibration import Calibration
from dflash.decoding.proposal import Proposal, path_values
from dflash.kernels import kernel_of, projection
from dflash.model import DFlashDrafter, DraftCache
from dflash.target import Target, select_features


def draft_head(target: Target, drafter: DFlashDrafter):
    """The drafter's logits from its hidden states: the target's LM head rows of its vocabulary, in its dtype, on
    its layers' linear kernel (the draft side needs no exactness)."""
    weight = target.lm_head.weight
    vocab = drafter.draft_vocab
    return projection((weight if vocab is None else vocab.head(weight)).to(drafter.dtype), kernel_of(drafter.layers))


class DFlashProposer:
    """Drafts with a DFlash drafter: context keys and values of every committed token stay in its cache; each
    proposal is one forward over ``[last token, MASK x (n)]`` projected through ``head`` (``draft_head``, built
    once per drafter), n at most ``depth``. With a ``calibration``, each token carries the calibrated probability of
    its acceptance, and with ``branches`` > 1 the proposal is a tree: at each position the drafter's second, third...
    choices are alternatives to its first, following the first choices before them."""

    name = "dflash"
    needs_hidden_states = True

    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter,
        calibration: Calibration | None = None,
        draft_cost: float = 0.0,
        head=None,
        branches: int = 1,
        depth: int | None = None,
    ):
        if branches > 1 and (calibration is None or len(calibration.runner_up) < branches - 1):
            known = 1 + len(calibration.runner_up) if calibration is not None else 0
            raise ValueError(f"{branches} branches need a calibration of the drafter's {branches} most probable tokens; this one has {known}")
        self.target, self.drafter, self.calibration, self.draft_cost = target, drafter, calibration, draft_cost
        self.branches, self.depth = branches, depth
        self.cache = DraftCache()
        self.project = draft_head(target, drafter) if head is None else head
        vocab = drafter.draft_vocab
        self.token_ids = None if vocab is None else vocab.token_ids.to(target.device)
        self.context: torch.Tensor | None = None  # features of the positions not yet in the cache
        self.context_start = 0

    def observe(self, hidden_states, count: int, start: int) -> None:
        """The target processed ``count`` tokens from position ``start`` (the prefill: from 0); features wait for the next proposal."""
        features = select_features(hidden_states, self.drafter.config.target_layer_ids)[:, :count]
        if self.context is None:
            self.context, self.context_start = features, start
        else:
            self.context = torch.cat([self.context, features], dim=1)

    def _positions(self, count: int) -> int:
        """How many positions a proposal of up to ``count`` tokens drafts."""
        return count if self.depth is None else min(count, self.depth)

    def propose(self, tokens: list[int], count: int) -> Proposal:
        start = len(tokens) - 1
        count = self._positions(count)
        device = self.target.device
        block = torch.tensor([[tokens[-1]] + [self.drafter.mask_token_id] * count], device=device)
        hidden = self.drafter(
            context_features=self.context,
            block_embeddings=self.target.embed(block),
            context_positions=torch.arange(self.context_start, start, device=device)[None],
            block_positions=torch.arange(start, start + count + 1, device=device)[None],
            cache=self.cache,
        )
        self.context = None  # now in the cache
        logits = self.project(hidden[0])
        if self.calibration is None:
            drafted = logits.argmax(-1)
            return Proposal((drafted if self.token_ids is None else self.token_ids[drafted]).tolist(), source=self.name)
        top = torch.softmax(logits.float(), dim=-1).topk(self.branches, dim=-1)
        ids = (top.indices if self.token_ids is None else self.token_ids[top.indices]).T.tolist()
        return self.tree(ids, top.values.T.tolist(), self.calibration)

    @classmethod
    def tree(cls, ids: list[list[int]], probs: list[list[float]], calibration: Calibration) -> Proposal:
        """The proposal of the drafter's choices ``ids`` ``[rank][position]`` of probabilities ``probs``: its first
        choices in a chain, each other choice an alternative to the first at its position (a chain for one rank)."""
        count = len(ids[0])
        tokens, accept, parents = list(ids[0]), calibration(probs[0]), list(range(-1, count - 1))
        for rank in range(1, len(ids)):
            tokens += ids[rank]
            accept += calibration.runner_up[rank - 1](probs[rank])
            parents += range(-1, count - 1)
        return Proposal(tokens, accept=accept, parents=parents if len(ids) > 1 else None, source=cls.name)

    def ceiling(self, count: int) -> list[float] | None:
        if self.calibration is None:
            return None
        count = self._positions(count)
        chain = path_values(self.calibration.ceiling(count))
        values = list(chain)
        for runner_up in self.calibration.runner_up[: self.branches - 1]:
            values += [q * (chain[k - 1] if k else 1.0) for k, q in enumerate(runner_up.ceiling(count))]
        return sorted(values, reverse=True)

    def feedback(self, proposal: Proposal, path: list[int]) -> None:
        pass


def for_arm(shared, gated: bool) -> tuple[DFlashProposer, int]:
    """The drafter in an evaluation arm, and its widest verify: gated, calibrated and at most ``branches`` choices
    per position (a tree); ungated, its whole block every step."""
    if not gated:
        return DFlashProposer(shared.target, shared.drafter), shared.block_size
    depth = shared.block_size - 1
    proposer = DFlashProposer(shared.target, shared.drafter, shared.calibration, shared.draft_cost, shared.head, shared.branches, depth=depth)
    return proposer, 1 + depth * shared.branches
