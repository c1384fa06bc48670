"""The DFlash training objective as pure functions: anchors, blocks, labels, decayed loss, accuracy.

Shapes: a batch of ``b`` right-padded rows of length ``S``; ``A`` anchors per row;
blocks of ``B`` tokens. Block position ``k`` of the block at anchor ``a`` is fed
``[token[a], MASK, ..., MASK]`` at positions ``a + k`` and trained to predict
the target's greedy continuation: ``token[a + k]`` on text the target wrote
itself, and on other text (a dataset's own reply) the target's greedy token
after ``a + k - 1``, for as long as the text agrees with that continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def default_gamma(block_size: int) -> float:
    """The recipes' decay constant: 7 for B=16, 5 for B=10, 4 for B=8; linear between and beyond."""
    points = [(8, 4.0), (10, 5.0), (16, 7.0)]
    if block_size <= 8:
        return block_size / 2.0
    if block_size >= 16:
        return 7.0 * block_size / 16.0
    for (b0, g0), (b1, g1) in zip(points, points[1:]):
        if b0 <= block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    raise AssertionError("unreachable")


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """The loss weight of each block position ``[B]``: 0 at the anchor (given), ``exp(-(k-1)/gamma)`` at k >= 1,
    since position k is accepted only after every position before it."""
    offsets = torch.arange(block_size)
    weights = torch.exp(-(offsets - 1).clamp(min=0).float() / gamma)
    weights[0] = 0.0
    return weights


def dpace_weights(cross_entropy: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's position weights ``[blocks, B]`` (speculators' ``dpace_loss_decay``), from each position's cross-entropy
    ``[blocks, B]`` and which positions train (bool): with the smoothed confidence ``s_k = (1 - alpha) exp(-CE_k) + alpha``
    at trained positions (1 elsewhere), position k weighs ``sum_{j >= k} s_1 ... s_j`` over the trained j: how much of
    the expected acceptance length rides on position k being right. Nothing flows back through the weights."""
    with torch.no_grad():
        trained = trained.to(torch.float32)
        smooth = torch.where(trained > 0, (1.0 - alpha) * torch.exp(-cross_entropy.float()) + alpha, torch.ones_like(trained))
        prefix = smooth.cumprod(-1)
        return (prefix * trained).flip(-1).cumsum(-1).flip(-1) * trained


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_anchors`` anchor positions per row, drawn without replacement, sorted.

    A position may anchor when it and the next position are both in the loss
    mask. Rows with fewer candidates are padded with position 0 and marked
    invalid. Returns ``anchors`` (long) and ``valid`` (bool), both ``[b, max_anchors]``.
    """
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be at least 1, got {max_anchors}")
    mask = loss_mask.bool()
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    # Random keys on the CPU generator keep the draw identical whatever the device.
    keys = torch.rand(mask.shape, generator=generator).to(mask.device)
    keys = keys.masked_fill(~candidates, 2.0)
    k = min(max_anchors, mask.shape[1])
    chosen = keys.topk(k, dim=1, largest=False).indices
    valid = candidates.gather(1, chosen)
    anchors = torch.where(valid, chosen, torch.full_like(chosen, mask.shape[1]))
    anchors, order = anchors.sort(dim=1)
    valid = valid.gather(1, order)
    anchors = anchors.masked_fill(~valid, 0)
    if k < max_anchors:
        pad = max_anchors - k
        anchors = F.pad(anchors, (0, pad))
        valid = F.pad(valid, (0, pad))
    return anchors, valid


@dataclass
class Blocks:
    """The drafter's block inputs and targets for one batch; every tensor is ``[b, A*B]``."""

    input_ids: torch.Tensor  # [token at anchor, MASK x (B-1)] per block
    positions: torch.Tensor  # anchor + 0..B-1
    labels: torch.Tensor  # the target's greedy token at anchor + k (0 where out of range)
    weights: torch.Tensor  # loss weight; 0 at k=0, out of range, outside the loss mask, past a disagreement, in padding blocks
    soft_ids: torch.Tensor | None = None  # [b, A*B, k]: the target's most likely tokens at anchor + k (distillation)
    soft_probs: torch.Tensor | None = None  # [b, A*B, k]: their probabilities, summing to 1 over k


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    position_weights: torch.Tensor,
    mask_token_id: int,
    greedy: torch.Tensor | None = None,
    soft: tuple[torch.Tensor, torch.Tensor] | None = None,
    greedy_path_only: bool = True,
) -> Blocks:
    """``position_weights`` ``[B]``: the loss weight of each block position (``decay_weights``); its length is the
    block size. ``greedy`` ``[b, S]``: the target's greedy next token after each position. Position ``k`` is then
    labelled ``greedy[a + k - 1]`` and trained only where ``token[a + j] == greedy[a + j - 1]`` for every
    ``0 < j < k``, so that its label is the target's own continuation of the block (``greedy_path_only=False``:
    trained at every position, on the target's teacher-forced token after the text as it stands); without
    ``greedy`` (text the target wrote) the label is ``token[a + k]``. ``soft`` (with ``greedy``): the target's top-k
    next tokens and their probabilities ``[b, S, k]`` after each position, gathered like the labels and
    renormalised over the k."""
    batch, seq_len = input_ids.shape
    offsets = torch.arange(len(position_weights), device=input_ids.device)
    positions = anchors[:, :, None] + offsets  # [b, A, B]
    in_range = positions < seq_len
    gather_at = positions.clamp(max=seq_len - 1).flatten(1)
    labels = input_ids.gather(1, gather_at).view_as(positions)
    in_loss = loss_mask.bool().gather(1, gather_at).view_as(positions)
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    weights = position_weights.to(input_ids.device) * (in_range & in_loss & valid[:, :, None])
    if greedy is not None:
        predicted = greedy.gather(1, (positions - 1).clamp(min=0, max=seq_len - 1).flatten(1)).view_as(positions)
        agrees = labels == predicted  # the text's token a+k is the target's greedy one
        # Position k needs agreement at 1..k-1: an exclusive running product over the block.
        follows = torch.cat([torch.ones_like(agrees[:, :, :2]), agrees[:, :, 1:-1]], dim=-1).cumprod(-1).bool()
        if greedy_path_only:
            weights = weights * follows
        labels = predicted
    soft_ids = soft_probs = None
    if soft is not None:
        at = (positions - 1).clamp(min=0, max=seq_len - 1).flatten(1)[:, :, None].expand(-1, -1, soft[0].shape[-1])
        soft_ids = soft[0].gather(1, at)
        soft_probs = soft[1].gather(1, at)
        soft_probs = soft_probs / soft_probs.sum(-1, keepdim=True).clamp(min=1e-12)
    labels = labels.masked_fill(~in_range, 0)
    return Blocks(
        input_ids=block_ids.flatten(1),
        positions=positions.flatten(1),
        labels=labels.flatten(1),
        weights=weights.flatten(1),
        soft_ids=soft_ids,
        soft_probs=soft_probs,
    )


def sample_positions(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """An unbiased, cheaper stand-in for ``weights``: keep each position with probability
    ``weight / max weight`` and give the kept ones the max weight.

    The expected loss and gradient are unchanged (divide by the *original* weight
    total), but only about ``sum(w) / max(w)`` positions per block need an LM-head
    product: 6.7 of 15 for B=16, γ=7. The LM head dominates training cost when the
    vocabulary is large and the drafter small.
    """
    top = weights.max()
    if top <= 0:
        return weights
    keep = torch.rand(weights.shape, generator=generator).to(weights.device) * top < weights
    return torch.where(keep, top, torch.zeros_like(weights))


def loss_normaliser(weights: torch.Tensor, kind: str) -> torch.Tensor:
    """What a batch's weighted loss is divided by: the sum of its positions' weights, or the count of its positions
    of positive weight (``positions``: each position weighs its own weight, whatever the others weigh)."""
    if kind == "positions":
        return (weights > 0).sum().to(weights.dtype)
    return weights.sum()


def decayed_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean cross-entropy; ``logits`` [N, V], ``labels``/``weights`` [N].

    ``total`` is the normaliser, by default ``weights.sum()``; pass the original
    weight total when ``weights`` came from ``sample_positions``.
    """
    total = weights.sum() if total is None else total
    if total <= 0:
        raise ValueError("the batch has no position with positive loss weight: no anchors in the loss mask")
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    return (ce * weights).sum() / total


def position_accuracy(predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 accuracy per block position over positions with positive weight.

    Inputs ``[b, A*B]``. Returns ``(correct, counted)``, each ``[B]``, so that
    callers can sum over batches before dividing.
    """
    counted = (weights > 0).view(-1, block_size)
    correct = (predictions == labels).view(-1, block_size) & counted
    return correct.sum(0), counted.sum(0)


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """``decayed_loss`` through a frozen LM head, in row chunks: the loss training runs.

    ``labels`` ``[N]`` are hard targets; ``[N, k]`` with ``probs`` ``[N, k]`` (rows summing to 1) are a
    distribution over k tokens each, the target's own (distillation): the loss of a row is then its
    cross-entropy against that distribution. Never holds more than ``chunk`` rows of logits: the
    gradient with respect to the hidden states is computed in the forward pass (the head is frozen,
    so nothing else needs the logits). Also returns the top-1 predictions. The head is never copied:
    each chunk of hidden states is cast to the head's dtype, and the softmax is taken in fp32.

    ``reweight`` (D-PACE): a function of every row's cross-entropy ``[N]`` that gives the rows' weights in place of
    ``weights``; each row's gradient is then computed unweighted and scaled once the weights are known, so the
    head is still read once per row.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, total, chunk, probs=None, reweight=None):
        if labels.dim() == 1:
            labels, probs = labels[:, None], torch.ones(labels.shape[0], 1, device=labels.device)
        cross_entropy = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        predictions = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for begin in range(0, hidden.shape[0], chunk):
            h = hidden[begin : begin + chunk].to(head_weight.dtype)
            logits = (h @ head_weight.t()).float()
            y, q, w = labels[begin : begin + chunk], probs[begin : begin + chunk].float(), weights[begin : begin + chunk]
            lse = torch.logsumexp(logits, dim=-1)
            cross_entropy[begin : begin + chunk] = lse - (logits.gather(1, y) * q).sum(1)
            predictions[begin : begin + chunk] = logits.argmax(-1)
            if grad is not None:
                softmax = torch.exp(logits - lse[:, None])
                softmax.scatter_add_(1, y, -q)
                if reweight is None:
                    softmax *= (w / total)[:, None]
                grad[begin : begin + chunk] = softmax.to(head_weight.dtype) @ head_weight
        if reweight is not None:
            weights = reweight(cross_entropy)
            if grad is not None:
                grad *= (weights / total)[:, None].to(grad.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(predictions)
        return (cross_entropy * weights).sum() / total, predictions

    @staticmethod
    def backward(ctx, grad_loss, _grad_predictions):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None, None
