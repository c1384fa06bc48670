"""Lossless speculative decoding with a DFlash drafter, one request at a time.

prefill → draft B-1 tokens in one drafter forward → verify the block in one
target forward → accept the longest prefix the target agrees with, plus the
target's own next token → crop both caches. With block size 1 the same loop
is plain greedy decoding: the autoregressive baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash.model import DFlashDrafter, DraftCache
from dflash.target import Target, select_features


@dataclass
class DecodeStats:
    block_size: int
    num_input_tokens: int
    num_output_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify step: accepted draft tokens + 1
    target_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

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
    def time_per_output_token(self) -> float:
        return self.decode_seconds / self.num_output_tokens if self.num_output_tokens else float("nan")


@dataclass
class Generation:
    tokens: torch.Tensor  # [num_output_tokens], the new tokens only
    stats: DecodeStats


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
    drafter: DFlashDrafter | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
) -> Generation:
    """Greedy decoding of one prompt (``input_ids`` [1, S]); output identical to the target's own greedy decoding.

    ``block_size`` defaults to the drafter's; 1 (or no drafter) is the autoregressive baseline.
    ``stop_token_ids`` defaults to the target's end-of-sequence tokens.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one request: input_ids must be [1, S], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if block_size is None:
        block_size = drafter.block_size if drafter is not None else 1
    if block_size > 1 and drafter is None:
        raise ValueError(f"block_size={block_size} needs a drafter; use block_size=1 for the autoregressive baseline")
    device = target.device
    stop = set(target.eos_token_ids if stop_token_ids is None else stop_token_ids)
    layer_ids = drafter.config.target_layer_ids if block_size > 1 else None
    mask_token_id = drafter.mask_token_id if block_size > 1 else None
    lm_head = target.lm_head

    input_ids = input_ids.to(device)
    prompt_len = input_ids.shape[1]
    max_len = prompt_len + max_new_tokens
    tokens = input_ids[0].tolist()
    target_cache = DynamicCache(config=target.config)
    draft_cache = DraftCache()
    stats = DecodeStats(block_size=block_size, num_input_tokens=prompt_len, num_output_tokens=0)

    start_time = _clock(device)
    out = target.model(
        input_ids=input_ids,
        position_ids=torch.arange(prompt_len, device=device)[None],
        cache=target_cache,
        use_cache=True,
        output_hidden_states=block_size > 1,
        logits_to_keep=1,
    )
    stats.target_forwards += 1
    tokens.append(int(out.logits[0, -1].argmax()))
    # Context not yet in the drafter's cache: hidden states of positions [context_start, len(tokens) - 1).
    context = select_features(out.hidden_states, layer_ids) if block_size > 1 else None
    context_start = 0
    decode_start = _clock(device)
    stats.prefill_seconds = decode_start - start_time

    # `start` is the position of the last committed token, which the target has not processed yet.
    start = len(tokens) - 1
    while tokens[-1] not in stop and len(tokens) < max_len:
        verify_size = min(block_size, max_len - start)
        block = [tokens[-1]] + [mask_token_id] * (verify_size - 1)
        block_ids = torch.tensor([block], device=device)
        positions = torch.arange(start, start + verify_size, device=device)[None]
        if verify_size > 1:
            hidden = drafter(
                context_features=context,
                block_embeddings=target.embed(block_ids),
                context_positions=torch.arange(context_start, start, device=device)[None],
                block_positions=positions,
                cache=draft_cache,
            )
            block_ids[0, 1:] = lm_head(hidden[:, 1:].to(target.dtype)).argmax(-1)[0]
        out = target.model(
            input_ids=block_ids,
            position_ids=positions,
            cache=target_cache,
            use_cache=True,
            output_hidden_states=block_size > 1,
        )
        stats.target_forwards += 1
        verified = out.logits[0].argmax(-1)
        agrees = (block_ids[0, 1:] == verified[:-1]).int()
        accepted = int(agrees.cumprod(0).sum())
        committed = block_ids[0, 1 : accepted + 1].tolist() + [int(verified[accepted])]
        for token in committed:
            tokens.append(token)
            if token in stop or len(tokens) >= max_len:
                break
        stats.acceptance_lengths.append(accepted + 1)
        # The target has processed block positions 0..accepted; later positions were rejected.
        processed = accepted + 1
        _crop(target_cache, start + processed)
        if block_size > 1:
            context = select_features(out.hidden_states, layer_ids)[:, :processed]
            context_start = start
        start += processed
    stats.decode_seconds = _clock(device) - decode_start
    new_tokens = torch.tensor(tokens[prompt_len:], dtype=torch.long)
    stats.num_output_tokens = len(new_tokens)
    return Generation(tokens=new_tokens, stats=stats)
