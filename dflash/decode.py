"""Lossless speculative decoding, one request at a time: a DFlash drafter, prompt lookup, or none.

prefill → propose up to B-1 tokens → verify ``[last token] + proposal`` in one
target forward → accept the longest prefix the target agrees with, plus the
target's own next token → crop the caches. A proposal may be a token tree
(alternatives to a token, verified in the same forward, each seeing only its
own branch): the longest branch the target agrees with is accepted, and the
caches keep that branch. A DFlash drafter proposes B-1
tokens in one forward from the target's hidden states; prompt lookup
proposes the tokens that followed the last earlier occurrence of the
context's final n-gram; with block size 1 (or no proposer) the same loop is
plain greedy decoding: the autoregressive baseline. Whatever the proposal,
the output is the target's own greedy output.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from dflash.kernels import kernel_of, projection
from dflash.model import DFlashDrafter, DraftCache
from dflash.policy import Calibration, LookupConfidence, Throughput, VerifyCost, path_values
from dflash.target import Target, select_features


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


def tree_mask(parents: list[int], past: int, device: torch.device) -> torch.Tensor:
    """The verify's attention mask ``[1, 1, n + 1, past + n + 1]`` (True: attend) for the last committed token and a
    tree of n draft tokens: every position sees the cached context, itself and its ancestors."""
    n = len(parents)
    sees = torch.eye(n + 1, dtype=torch.bool)
    sees[:, 0] = True
    for i, parent in enumerate(parents):
        sees[i + 1] |= sees[parent + 1]
    return torch.cat([torch.ones(n + 1, past, dtype=torch.bool), sees], dim=1)[None, None].to(device)


def accepted_path(draft: list[int], parents: list[int], verified: list[int]) -> list[int]:
    """The draft tokens (by index) the target accepts: from the last committed token, each time the child whose token
    is the target's next one (``verified[j]``: its token after block position j, the last committed token at 0)."""
    path, node = [], -1
    while True:
        child = next((i for i, token in enumerate(draft) if parents[i] == node and token == verified[node + 1]), None)
        if child is None:
            return path
        path.append(child)
        node = child


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

    def feedback(self, proposal: Proposal, path: list[int]) -> None:
        if self.confidence is not None and proposal.drafted:
            self.confidence.update(proposal.match, proposal.drafted, len(path))


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


def _keep(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep the cache's first ``start`` positions and, of the block after them, positions ``keep`` (increasing)."""
    if keep == list(range(len(keep))):
        excess = cache.get_seq_length() - start - len(keep)
        if excess > 0:
            cache.crop(-excess)
        return
    index = torch.tensor(keep) + start
    for layer in cache.layers:  # the kept positions moved down in place (the indexing copies them first), the rest cut
        index = index.to(layer.keys.device)
        layer.keys[..., start : start + len(keep), :] = layer.keys[..., index, :]
        layer.values[..., start : start + len(keep), :] = layer.values[..., index, :]
    cache.crop(-(cache.get_seq_length() - start - len(keep)))


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
        parents = proposal.parent_indices()[: len(draft)]  # parents come before their children: a prefix is a tree
        chain = parents == list(range(-1, len(draft) - 1))
        depths = [0] + token_depths(parents)
        block_ids = torch.tensor([[tokens[-1]] + draft], device=device)
        verifying = time.perf_counter()
        out = target.forward(
            block_ids,
            target_cache,
            position_ids=(start + torch.tensor(depths, device=device))[None],
            attention_mask=None if chain else tree_mask(parents, start, device),
            output_hidden_states=hidden_states,
        )
        stats.target_forwards += 1
        verified = out.logits[0].argmax(-1).tolist()  # on the host: the forward has finished
        stats.verify_seconds.append(time.perf_counter() - verifying)
        path = accepted_path(draft, parents, verified)
        accepted = len(path)
        committed = [draft[i] for i in path] + [verified[path[-1] + 1 if path else 0]]
        for token in committed:
            tokens.append(token)
            if token in stop or len(tokens) >= max_len:
                break
        stats.acceptance_lengths.append(accepted + 1)
        stats.verified.append(len(draft))
        stats.choices[proposal.source if draft else ""] += 1
        if proposal.accept is not None:  # every draft token whose parent was accepted: was it?
            reached = {-1, *path}
            stats.predictions += [(depths[i + 1], proposal.accept[i], i in path) for i in range(min(proposal.drafted, len(draft))) if parents[i] in reached]
        if verify_size > 1:  # every step that proposed hears how it went, a plain one too
            proposer.feedback(proposal, path)
        # The caches keep the last committed token and the accepted branch; the other block positions were rejected.
        keep = [0] + [i + 1 for i in path]
        _keep(target_cache, start, keep)
        if proposer is not None:
            kept = out.hidden_states
            if kept is not None and keep[-1] != accepted:  # a branch off the block's first positions
                kept = tuple(h[:, keep] for h in kept)
            proposer.observe(kept, len(keep), start)
        start += len(keep)
    stats.decode_seconds = _clock(device) - decode_start
    new_tokens = torch.tensor(tokens[prompt_len:], dtype=torch.long)
    stats.num_output_tokens = len(new_tokens)
    return Generation(tokens=new_tokens, stats=stats)
