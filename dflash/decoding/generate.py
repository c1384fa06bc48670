"""Speculative decoding of one request, in the loop gpt-fast's ``generate.py`` made familiar:

prefill → propose up to B-1 tokens → verify ``[last token] + proposal`` in one target forward → commit the longest
prefix (or branch) the target agrees with, plus the target's own next token → the caches keep that → again. With block
size 1 (or no proposer) the same loop is plain greedy decoding: the autoregressive baseline. Whatever the proposal,
the output is the target's own greedy output.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from dflash.decoding.drafter import DFlashProposer
from dflash.decoding.lookup import PromptLookup, PromptLookupProposer
from dflash.decoding.proposal import Proposal, Proposer
from dflash.decoding.stats import DecodeStats, Generation
from dflash.decoding.verify import verify
from dflash.model import DFlashDrafter
from dflash.target import Target


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


def _checked_block_size(drafter, input_ids: torch.Tensor, max_new_tokens: int, block_size: int | None) -> int:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one request: input_ids must be [1, S], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if block_size is None:
        block_size = getattr(drafter, "block_size", None) or 1
    if block_size > 1 and drafter is None:
        raise ValueError(f"block_size={block_size} needs a drafter; use block_size=1 for the autoregressive baseline")
    return block_size


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
    block_size = _checked_block_size(drafter, input_ids, max_new_tokens, block_size)
    proposer = make_proposer(target, drafter) if block_size > 1 else None
    hidden_states = proposer is not None and proposer.needs_hidden_states
    device, stop = target.device, set(target.eos_token_ids if stop_token_ids is None else stop_token_ids)
    input_ids = input_ids.to(device)
    tokens, cache = input_ids[0].tolist(), DynamicCache(config=target.config)
    prompt_len, max_len = len(tokens), len(tokens) + max_new_tokens
    stats = DecodeStats(block_size=block_size, num_input_tokens=prompt_len, num_output_tokens=0, target_forwards=1)

    started = _clock(device)
    positions = torch.arange(prompt_len, device=device)[None]
    out = target.forward(input_ids, cache, position_ids=positions, output_hidden_states=hidden_states, logits_to_keep=1)
    tokens.append(int(out.logits[0, -1].argmax()))
    if proposer is not None:
        proposer.observe(out.hidden_states, prompt_len, 0)
    decode_start = _clock(device)
    stats.prefill_seconds = decode_start - started

    start = len(tokens) - 1  # the position of the last committed token, which the target has not processed yet
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
        step = verify(target, cache, tokens[-1], start, draft, parents, hidden_states)
        for token in step.committed:
            tokens.append(token)
            if token in stop or len(tokens) >= max_len:
                break
        stats.record(proposal, draft, parents, step)
        if verify_size > 1:  # every step that proposed hears how it went, a plain one too
            proposer.feedback(proposal, step.path)
        if proposer is not None:
            proposer.observe(step.hidden_states, step.kept, start)
        start += step.kept
    stats.decode_seconds = _clock(device) - decode_start
    new_tokens = torch.tensor(tokens[prompt_len:], dtype=torch.long)
    stats.num_output_tokens = len(new_tokens)
    return Generation(tokens=new_tokens, stats=stats)
