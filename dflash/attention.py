"""Drafter attention: one mask definition, two kernels.

The training mask is written once, as a flex_attention ``mask_mod`` (a pure
function of batch, head, query index and key index). The flex backend turns it
into a sparse block mask; the SDPA backend evaluates the very same function on
a dense grid. CUDA uses compiled flex_attention; the CPU uses SDPA because
flex_attention on CPU has no backward in torch 2.13.

Layout of one training row: keys are ``[context (S) | block 0 (B) | block 1 (B) | ...]``,
queries are the blocks only. Query ``q`` belongs to block ``q // B``; in the drafter's last
layer, whose queries are each block's drafted positions 1..B-1 only (``TrainingMask.drafted``:
the anchor's output there feeds nothing), to block ``q // (B - 1)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

Backend = Literal["auto", "flex", "sdpa"]
BACKENDS = ("auto", "flex", "sdpa")
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dflash_mask_mod(anchors: torch.Tensor, anchor_valid: torch.Tensor, context_length: int, block_size: int, queries_per_block: int | None = None) -> MaskMod:
    """The DFlash training mask.

    A block sees the context strictly before its anchor (the anchor's own hidden
    state does not exist yet at inference), all of its own block, never another
    block. A padding block (``anchor_valid`` false) sees nothing. Each block has
    ``queries_per_block`` queries (``block_size`` unless given; ``block_size - 1``
    for the drafted positions only) and ``block_size`` keys.
    """
    queries_per_block = queries_per_block or block_size

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // queries_per_block
        anchor = anchors[b, block]
        sees_context = (kv_idx < context_length) & (kv_idx < anchor)
        sees_own_block = (kv_idx >= context_length) & ((kv_idx - context_length) // block_size == block)
        return anchor_valid[b, block] & (sees_context | sees_own_block)

    return mask_mod


def resolve_backend(backend: Backend, device: torch.device | str) -> Literal["flex", "sdpa"]:
    """``auto`` is flex on CUDA and SDPA elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


@dataclass
class TrainingMask:
    """A mask built for one batch, in the form its backend consumes."""

    backend: Literal["flex", "sdpa"]
    block_size: int  # the key blocks' length; each block's queries are its drafted positions alone in ``drafted``
    block_mask: BlockMask | None = None
    kernel: Callable | None = None  # flex: the attention kernel (compiled on CUDA)
    dense: torch.Tensor | None = None  # [batch, 1, Q, K] bool; empty rows opened up, see `empty_rows`
    empty_rows: torch.Tensor | None = None  # [batch, 1, Q, 1] bool: queries that see nothing
    drafted: TrainingMask | None = None  # the same keys for each block's drafted positions 1..B-1 only (the last layer's queries)


@functools.cache
def compiled_flex_kernels() -> tuple[Callable, Callable]:
    """``create_block_mask`` and ``flex_attention`` compiled, wrapped once per process and only by mask building,
    which never runs inside a Dynamo trace (there, ``torch.compile`` would return the raw function). Uncompiled,
    the first materialises the dense mask and the second the whole score matrix."""
    return torch.compile(create_block_mask), torch.compile(flex_attention)


def build_training_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    context_length: int,
    block_size: int,
    backend: Backend = "auto",
    compile_block_mask: bool | None = None,
) -> TrainingMask:
    """The mask of every block position's queries, with ``drafted``: the mask of positions 1..B-1's only."""
    batch, num_anchors = anchors.shape
    kv_len = context_length + num_anchors * block_size
    device = anchors.device
    kind = resolve_backend(backend, device)
    if kind == "flex":
        if compile_block_mask is None:
            compile_block_mask = device.type == "cuda"
        make = compiled_flex_kernels()[0] if compile_block_mask else create_block_mask
        # The CPU runs flex eagerly: forward only (no backward in torch 2.13), in the preflight checks and tests.
        kernel = compiled_flex_kernels()[1] if device.type == "cuda" else flex_attention

        def flex(queries: int) -> TrainingMask:
            mask_mod = dflash_mask_mod(anchors, anchor_valid, context_length, block_size, queries)
            return TrainingMask("flex", block_size, block_mask=make(mask_mod, batch, None, num_anchors * queries, kv_len, device=device), kernel=kernel)

        return dataclasses.replace(flex(block_size), drafted=flex(block_size - 1))
    mask_mod = dflash_mask_mod(anchors, anchor_valid, context_length, block_size)
    dense = create_mask(mask_mod, batch, 1, num_anchors * block_size, kv_len, device=device)
    empty = ~dense.any(dim=-1, keepdim=True)
    # SDPA turns a row with no visible key into NaN, which poisons the backward;
    # open such rows to every key and zero their output afterwards (flex gives 0).
    dense = dense | empty
    drafted = TrainingMask(
        "sdpa", block_size, dense=drafted_rows(dense, block_size, dim=2).contiguous(), empty_rows=drafted_rows(empty, block_size, dim=2).contiguous()
    )
    return TrainingMask("sdpa", block_size, dense=dense, empty_rows=empty, drafted=drafted)


def drafted_rows(x: torch.Tensor, block_length: int, dim: int) -> torch.Tensor:
    """The rows of ``x`` along ``dim`` (blocks of ``block_length``, one after another) that are drafted: each block's
    positions 1.., not its anchor at 0."""
    return x.unflatten(dim, (-1, block_length)).narrow(dim + 1, 1, block_length - 1).flatten(dim, dim + 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TrainingMask | None, scale: float) -> torch.Tensor:
    """Attention over ``[batch, heads, len, head_dim]`` tensors with grouped KV heads.

    ``mask=None`` means every query sees every key (drafting at inference).
    """
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if mask.backend == "flex":
        return mask.kernel(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=gqa)
    return out.masked_fill(mask.empty_rows, 0.0)
