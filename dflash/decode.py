"""Lossless speculative decoding, one request at a time: a DFlash drafter, prompt lookup, or none.

prefill → propose up to B-1 tokens → verify ``[last token] + proposal`` in one
target forward → accept the longest prefix the target agrees with, plus the
target's own next token → crop the caches. A DFlash drafter proposes B-1
tokens in one forward from the target's hidden states; prompt lookup
proposes the tokens that followed the last earlier occurrence of the
context's final n-gram; with block size 1 (or no proposer) the same loop is
plain greedy decoding: the autoregressive baseline. Whatever the proposal,
the output is the target's own greedy output.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from dflash.kernels import kernel_of, projection
from dflash.model import DFlashDrafter, DraftCache
from dflash.policy import Calibration, LookupConfidence, VerifyCost
from dflash.target import Target, select_features


@dataclass
class DecodeStats:
    block_size: int
    num_input_tokens: int
    num_output_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify step: accepted draft tokens + 1
    verified: list[int] = field(default_factory=list)  # per verify step: draft tokens verified (0: a plain step)
    choices: Counter = field(default_factory=Counter)  # per verify step: which proposer's tokens were verified ("" for none)
    consulted: Counter = field(default_factory=Counter)  # a gated proposer's: how many steps each candidate drafted on
    # Per draft position verified after an accepted prefix: (position 1.., predicted acceptance, accepted).
    predictions: list[tuple[int, float, bool]] = field(default_factory=list)
    target_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # the part of decode_seconds spent proposing

    @property
    def tau(self) -> float:
        """Acceptance length: mean over verify steps of accepted draft tokens plus the bonus token."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """For draft position k = 1..B-1: the fraction of verify steps that accepted it."""
        steps = len(self.acceptance_lengths)
        return [sum(length - 1 >= k for length in self.acceptance_lengths) / steps if steps else 0.0 for k in range(1, self.block_size)]

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


@dataclass
class Proposal:
    """Draft tokens to verify after the last committed one, with what is known of them."""

    tokens: list[int]
    accept: list[float] | None = None  # per token: the probability it is accepted given the ones before are (None: unknown)
    source: str = ""  # the proposer's name
    match: int = 0  # prompt lookup: the length of the n-gram that matched
    own: int | None = None  # how many of ``tokens`` the proposer drafted (the rest pad the verify); None: all
    consulted: tuple[str, ...] = ()  # a gated proposer's: the candidates that drafted this step

    @property
    def drafted(self) -> int:
        return len(self.tokens) if self.own is None else self.own


class Proposer(Protocol):
    """What ``speculative_generate`` drafts with. ``observe`` is told of every target forward (the prefill from
    position 0, then each verify's accepted positions), whether or not ``propose`` is called after it; ``feedback``
    of how many of a proposal's tokens were accepted; ``ceiling`` bounds the confidences a proposal of ``count``
    tokens could carry, before drafting it (None: no bound known)."""

    name: str
    needs_hidden_states: bool
    draft_cost: float  # a proposal's cost, in target steps

    def observe(self, hidden_states, count: int, start: int) -> None: ...

    def propose(self, tokens: list[int], count: int) -> Proposal: ...

    def ceiling(self, count: int) -> list[float] | None: ...

    def feedback(self, proposal: Proposal, accepted: int) -> None: ...


def draft_head(target: Target, drafter: DFlashDrafter):
    """The drafter's logits from its hidden states: the target's LM head rows of its vocabulary, in its dtype, on
    its layers' linear kernel (the draft side needs no exactness)."""
    weight = target.lm_head.weight
    vocab = drafter.draft_vocab
    return projection((weight if vocab is None else vocab.head(weight)).to(drafter.dtype), kernel_of(drafter.layers))


class DFlashProposer:
    """Drafts with a DFlash drafter: context keys and values of every committed token stay in its cache; each
    proposal is one forward over ``[last token, MASK x (n)]`` projected through ``head`` (``draft_head``, built
    once per drafter). With a ``calibration``, each token carries the calibrated probability of its acceptance."""

    name = "dflash"
    needs_hidden_states = True

    def __init__(self, target: Target, drafter: DFlashDrafter, calibration: Calibration | None = None, draft_cost: float = 0.0, head=None):
        self.target, self.drafter, self.calibration, self.draft_cost = target, drafter, calibration, draft_cost
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

    def propose(self, tokens: list[int], count: int) -> Proposal:
        start = len(tokens) - 1
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
        logits = self.project(hidden[0, 1:])
        drafted = logits.argmax(-1)
        ids = (drafted if self.token_ids is None else self.token_ids[drafted]).tolist()
        if self.calibration is None:
            return Proposal(ids, source=self.name)
        top = torch.softmax(logits.float(), dim=-1).amax(-1).tolist()
        return Proposal(ids, accept=self.calibration(top), source=self.name)

    def ceiling(self, count: int) -> list[float] | None:
        return None if self.calibration is None else self.calibration.ceiling(count)

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        pass


@dataclass
class PromptLookup:
    """Prompt lookup decoding: propose the up to ``num_tokens`` tokens that followed the latest earlier occurrence
    of the context's last n-gram (the longest of ``max_ngram`` down to 1 that occurs before). Needs no training."""

    num_tokens: int = 10
    max_ngram: int = 3

    @property
    def block_size(self) -> int:
        return self.num_tokens + 1


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

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        if self.confidence is not None and proposal.drafted:
            self.confidence.update(proposal.match, proposal.drafted, accepted)


class GatedProposer:
    """Per step, the verify takes the (candidate, length) with the most expected committed tokens per unit of cost
    (``VerifyCost.best_length``, the cost including every draft made that step), padded to the cheapest width: one
    candidate is a confidence-gated drafter, a drafter and prompt lookup the hybrid. Candidates are asked cheapest
    first, and a costly one only when the best proposal its ``ceiling`` allows beats the best so far after paying
    for it: the drafter is not run on the steps where lookup's proposal is out of its reach. A candidate not asked
    still observes every target forward, so its state (the drafter's cache) catches up when it is next asked."""

    def __init__(self, candidates: list[Proposer], cost: VerifyCost):
        self.candidates, self.cost = sorted(candidates, key=lambda c: c.draft_cost), cost
        self.name = "+".join(c.name for c in candidates)
        self.needs_hidden_states = any(c.needs_hidden_states for c in candidates)
        self.draft_cost = sum(c.draft_cost for c in candidates)
        self.block_size = cost.max_width

    def observe(self, hidden_states, count: int, start: int) -> None:
        for candidate in self.candidates:
            candidate.observe(hidden_states, count, start)

    def _best(self, proposals: list[Proposal], count: int, spent: float) -> tuple[Proposal | None, int, float]:
        best, best_length, best_gain = None, 0, 1.0 / (self.cost.relative[0] + spent)  # a plain step
        for proposal in proposals:
            length, gain = self.cost.best_length(proposal.accept[:count], spent)
            if gain > best_gain:
                best, best_length, best_gain = proposal, min(length, count), gain
        return best, best_length, best_gain

    def propose(self, tokens: list[int], count: int) -> Proposal:
        proposals, consulted, spent = [], [], 0.0
        for candidate in self.candidates:
            ceiling = candidate.ceiling(count)
            if ceiling is not None:
                reach = self.cost.best_length(ceiling[:count], spent + candidate.draft_cost)[1]
                if reach <= self._best(proposals, count, spent)[2]:
                    continue
            proposal = candidate.propose(tokens, count)
            if proposal.accept is None:
                raise ValueError(f"a gated proposer needs confidences, and {candidate.name!r} gives none (a drafter needs a calibration)")
            proposals.append(proposal)
            consulted.append(candidate.name)
            spent += candidate.draft_cost
        best, best_length, _ = self._best(proposals, count, spent)
        if best is None or best_length == 0:
            return Proposal([], accept=[], source="", consulted=tuple(consulted))
        # Slots past the proposal's end (a short lookup match) are filled with its last token: free, since the padded
        # width costs no more, and lossless, since any token may be verified.
        filler = (best.tokens or tokens[-1:])[-1:]
        padded = (best.tokens + filler * best_length)[:best_length]
        accept = (best.accept + [0.0] * best_length)[:best_length]
        own = min(len(best.tokens), best_length)
        return Proposal(padded, accept=accept, source=best.source, match=best.match, own=own, consulted=tuple(consulted))

    def ceiling(self, count: int) -> list[float] | None:
        return None

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        for candidate in self.candidates:
            if candidate.name == proposal.source:
                candidate.feedback(proposal, accepted)


def make_proposer(target: Target, drafter) -> Proposer:
    """A proposer for a ``DFlashDrafter``, a ``PromptLookup``, or a proposer itself."""
    if isinstance(drafter, DFlashDrafter):
        return DFlashProposer(target, drafter)
    if isinstance(drafter, PromptLookup):
        return PromptLookupProposer(drafter)
    return drafter


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _crop(cache: DynamicCache, length: int) -> None:
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: DFlashDrafter | PromptLookup | Proposer | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
) -> Generation:
    """Greedy decoding of one prompt (``input_ids`` [1, S]); output identical to the target's own greedy decoding.

    ``drafter`` proposes the tokens to verify: a ``DFlashDrafter``, a ``PromptLookup`` or any ``Proposer`` (a
    ``GatedProposer`` chooses how many). ``block_size`` (the widest verify) defaults to the drafter's; 1 (or no
    drafter) is the autoregressive baseline. ``stop_token_ids`` defaults to the target's end-of-sequence tokens.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one request: input_ids must be [1, S], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if block_size is None:
        block_size = getattr(drafter, "block_size", None) or 1
    if block_size > 1 and drafter is None:
        raise ValueError(f"block_size={block_size} needs a drafter; use block_size=1 for the autoregressive baseline")
    proposer = make_proposer(target, drafter) if block_size > 1 else None
    hidden_states = proposer is not None and proposer.needs_hidden_states
    device = target.device
    stop = set(target.eos_token_ids if stop_token_ids is None else stop_token_ids)

    input_ids = input_ids.to(device)
    prompt_len = input_ids.shape[1]
    max_len = prompt_len + max_new_tokens
    tokens = input_ids[0].tolist()
    target_cache = DynamicCache(config=target.config)
    stats = DecodeStats(block_size=block_size, num_input_tokens=prompt_len, num_output_tokens=0)

    start_time = _clock(device)
    out = target.forward(
        input_ids, target_cache, position_ids=torch.arange(prompt_len, device=device)[None], output_hidden_states=hidden_states, logits_to_keep=1
    )
    stats.target_forwards += 1
    tokens.append(int(out.logits[0, -1].argmax()))
    if proposer is not None:
        proposer.observe(out.hidden_states, prompt_len, 0)
    decode_start = _clock(device)
    stats.prefill_seconds = decode_start - start_time

    # `start` is the position of the last committed token, which the target has not processed yet.
    start = len(tokens) - 1
    while tokens[-1] not in stop and len(tokens) < max_len:
        verify_size = min(block_size, max_len - start)
        proposal = Proposal([])
        if verify_size > 1:
            drafting = _clock(device)
            proposal = proposer.propose(tokens, verify_size - 1)
            stats.draft_seconds += _clock(device) - drafting
            stats.consulted.update(proposal.consulted)
        draft = proposal.tokens[: verify_size - 1]
        block_ids = torch.tensor([[tokens[-1]] + draft], device=device)
        out = target.forward(
            block_ids, target_cache, position_ids=torch.arange(start, start + block_ids.shape[1], device=device)[None], output_hidden_states=hidden_states
        )
        stats.target_forwards += 1
        verified = out.logits[0].argmax(-1)
        agrees = (block_ids[0, 1:] == verified[:-1]).int()
        accepted = int(agrees.cumprod(0).sum())
        committed = draft[:accepted] + [int(verified[accepted])]
        for token in committed:
            tokens.append(token)
            if token in stop or len(tokens) >= max_len:
                break
        stats.acceptance_lengths.append(accepted + 1)
        stats.verified.append(len(draft))
        stats.choices[proposal.source if draft else ""] += 1
        if proposal.accept is not None:
            stats.predictions += [(k + 1, proposal.accept[k], k < accepted) for k in range(min(proposal.drafted, len(draft), accepted + 1))]
        if proposer is not None and draft:
            proposer.feedback(proposal, accepted)
        # The target has processed block positions 0..accepted; later positions were rejected.
        processed = accepted + 1
        _crop(target_cache, start + processed)
        if proposer is not None:
            proposer.observe(out.hidden_states, processed, start)
        start += processed
    stats.decode_seconds = _clock(device) - decode_start
    new_tokens = torch.tensor(tokens[prompt_len:], dtype=torch.long)
    stats.num_output_tokens = len(new_tokens)
    return Generation(tokens=new_tokens, stats=stats)
