"""What one training step is: the drafter's config for a target, its compiled forward, the loss, the update.

Training (``dflash.train``) and the compile-cache warmup
(``dflash.preflight.warmup``) both run ``train_step`` on a drafter from
``compile_drafter``, so that the graphs the warmup compiles are the graphs
training runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pandas as pd
import torch
import torch.fx.experimental._config as fx_config

from dflash.attention import build_training_mask
from dflash.batch import Batch, idle_batch, make_batch, rank_slice
from dflash.config import DrafterConfig, TrainConfig
from dflash.decoding.calibration import acceptance_lengths
from dflash.distributed import Layout, all_reduce_sum
from dflash.kernels import projection
from dflash.model import DFlashConfig, DFlashDrafter
from dflash.objective import FrozenHeadCrossEntropy, dpace_weights, position_accuracy
from dflash.target import Target, native_bf16
from dflash.vocab import DraftVocab


def drafter_config_for(target: Target, cfg: DrafterConfig) -> DFlashConfig:
    """The drafter's shape for ``target`` (the config's ``drafter`` section; the mask token defaults to an unused special token)."""
    mask_token_id = target.default_mask_token_id() if cfg.mask_token_id is None else cfg.mask_token_id
    return DFlashConfig.for_target(target.config, cfg, mask_token_id)


def training_drafter(config: DFlashConfig, cfg: TrainConfig, device: torch.device) -> DFlashDrafter:
    """A freshly initialised drafter as training runs it (seeded by the caller)."""
    drafter = DFlashDrafter(config).to(device)
    drafter.activation_checkpointing = cfg.activation_checkpointing
    return drafter


def compile_drafter(drafter: DFlashDrafter, enabled: bool):
    """The drafter's forward as training runs it: compiled with dynamic shapes (sequence lengths vary per batch)."""
    if not enabled:
        return drafter
    # Without duck shaping, two dimensions that happen to be equal in one batch (rows = block size, say)
    # are not tied into one symbol, which would make a later batch fail the guard and compile cold.
    fx_config.use_duck_shape = False
    # DDP wraps the compiled drafter; Dynamo would otherwise split its graph at DDP's gradient buckets into
    # graphs the compile-cache warmup (one process, no DDP) never compiles. One graph per step: every
    # gradient is ready when its backward ends, which a drafter of a few layers can afford.
    torch._dynamo.config.optimize_ddp = False
    return torch.compile(drafter, dynamic=True)


def drafter_hidden(drafter_forward, target: Target, batch: Batch, attention_backend: str) -> torch.Tensor:
    """The drafter's last hidden states over a batch's drafted block positions ``[b, A*(B-1), H]`` (the training mask,
    the frozen embedding)."""
    device = target.device
    blocks = batch.blocks
    block_size = blocks.input_ids.shape[1] // batch.anchors.shape[1]
    mask = build_training_mask(batch.anchors.to(device), batch.valid.to(device), batch.input_ids.shape[1], block_size, attention_backend)
    with torch.no_grad():
        block_embeddings = target.embed(blocks.input_ids.to(device))
    context_positions = torch.arange(batch.input_ids.shape[1], device=device).expand(batch.input_ids.shape[0], -1)
    return drafter_forward(batch.features.to(device), block_embeddings, context_positions, blocks.positions.to(device), mask)


def drafter_loss(
    drafter_forward,
    target: Target,
    batch: Batch,
    attention_backend: str,
    head_chunk: int,
    head: torch.Tensor | None = None,
    dpace_alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted loss of one batch through the frozen ``head`` (the target's LM head, or its draft-vocabulary
    rows, which the batch's labels index); also per-position correct and counted predictions. With ``dpace_alpha``
    the positions the batch trains are weighted by D-PACE (``dflash.objective.dpace_weights``) instead of its weights."""
    device = target.device
    blocks = batch.blocks
    block_size = blocks.input_ids.shape[1] // batch.anchors.shape[1]
    hidden = drafter_hidden(drafter_forward, target, batch, attention_backend)
    weights = blocks.weights.to(device).flatten()
    rows = weights.nonzero().squeeze(1)  # never an anchor (position 0 weighs 0), so each has a drafted row:
    drafted = rows - rows // block_size - 1  # row (block, k) of the blocks is row (block, k - 1) of the drafted positions
    if blocks.soft_ids is not None:  # distillation: the target's top-k distribution
        labels, probs = blocks.soft_ids.to(device).flatten(0, 1)[rows], blocks.soft_probs.to(device).flatten(0, 1)[rows]
    else:
        labels, probs = blocks.labels.to(device).flatten()[rows], None
    reweight = None
    if dpace_alpha is not None:

        def reweight(cross_entropy: torch.Tensor) -> torch.Tensor:
            per_block = torch.zeros_like(weights).index_put_((rows,), cross_entropy).view(-1, block_size)
            return dpace_weights(per_block, (weights > 0).view(-1, block_size), dpace_alpha).flatten()[rows]

    loss, predictions = FrozenHeadCrossEntropy.apply(
        hidden.flatten(0, 1)[drafted],
        target.lm_head.weight if head is None else head,
        labels,
        weights[rows],
        batch.weight_total.to(device),
        head_chunk,
        probs,
        reweight,
    )
    all_predictions = torch.full_like(weights, -1, dtype=torch.long)
    all_predictions[rows] = predictions
    correct, counted = position_accuracy(all_predictions.view_as(blocks.labels), blocks.labels.to(device), blocks.weights.to(device), block_size)
    return loss, correct, counted


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast (fp32 master weights) where the device computes bf16 natively, unless the config says otherwise."""
    if precision == "bf16" or (precision == "auto" and native_bf16(device)):
        return torch.bfloat16
    return None


def normalise_globally(batch: Batch, layout: Layout) -> None:
    """Divide every rank's weighted loss by the weight total of the whole global batch, times the
    drafter ranks because DDP and FSDP average gradients over ranks: the data-parallel gradient is
    then the one-process gradient of the global batch, whatever the topology."""
    total = all_reduce_sum(batch.weight_total.to(layout.device, torch.float32), layout)
    batch.weight_total = total / layout.drafter_world


def train_step(forward, drafter: torch.nn.Module, optimizer, target: Target, batch: Batch, cfg: TrainConfig, head: torch.Tensor | None = None):
    """One optimizer step: loss, backward, clipping, update (``head`` as in ``drafter_loss``; ``optimizer`` a
    ``dflash.optim.DrafterOptimizer``, which also steps the schedule, or a torch optimizer).

    ``forward`` is the (compiled) drafter, wrapped in DDP when several ranks
    train: its backward then leaves every rank with the averaged gradient.
    """
    device = target.device
    dtype = autocast_dtype(cfg.precision, device)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        dpace_alpha = cfg.dpace_alpha if cfg.position_weights == "dpace" else None
        loss, correct, counted = drafter_loss(forward, target, batch, cfg.attention_backend, cfg.head_chunk, head, dpace_alpha)
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
    optimizer.step()
    return loss, correct, counted, grad_norm


@dataclass
class BlockOutcomes:
    """The drafter on validation blocks: one row per block, one column per draft position 1..B-1."""

    correct: torch.Tensor  # bool: its top token is the target's greedy token
    counted: torch.Tensor  # bool: the position is labelled (in range, in the loss mask, in the draft vocabulary)
    confidence: torch.Tensor  # its top token's probability
    # [blocks, positions, ranks - 1]: the same for its second, third... most probable tokens
    runner_up_correct: torch.Tensor | None = None
    runner_up_confidence: torch.Tensor | None = None

    def accuracy(self) -> list[float]:
        """Per position 1..B-1, over the labelled positions, as training's accuracy counts them."""
        return ((self.correct & self.counted).sum(0) / self.counted.sum(0).clamp(min=1)).tolist()

    def tau_sums(self) -> tuple[float, int]:
        """Acceptance lengths summed over the blocks whose first position is labelled, and their count: greedy speculative
        decoding's τ at this block size, teacher-forced (the cumulative product of correctness along each block)."""
        blocks = self.counted[:, 0]
        return float(acceptance_lengths(self.correct[blocks], self.counted[blocks]).sum()), int(blocks.sum())

    def ranked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(confidence, correct)`` ``[blocks, positions, ranks]``, the first choice first."""
        probs, correct = [self.confidence[..., None]], [self.correct[..., None]]
        if self.runner_up_correct is not None:
            probs.append(self.runner_up_confidence)
            correct.append(self.runner_up_correct)
        return torch.cat(probs, -1), torch.cat(correct, -1)

    @classmethod
    def cat(cls, parts: list[BlockOutcomes]) -> BlockOutcomes:
        fields = [f.name for f in dataclasses.fields(cls) if getattr(parts[0], f.name) is not None]
        return cls(**{f: torch.cat([getattr(p, f) for p in parts]) for f in fields})


@torch.no_grad()
def block_outcomes(drafter, target: Target, project, batch: Batch, cfg: TrainConfig, ranks: int = 1) -> BlockOutcomes:
    """What the drafter drafts on a batch's blocks, every labelled position compared with the target's token, for its
    ``ranks`` most probable tokens; ``project`` maps its hidden states to logits (``dflash.kernels.projection`` of the
    frozen head)."""
    dtype = autocast_dtype(cfg.precision, target.device)
    with torch.autocast(target.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        hidden = drafter_hidden(drafter, target, batch, cfg.attention_backend)
    block_size = batch.blocks.input_ids.shape[1] // batch.anchors.shape[1]
    hidden = hidden.view(-1, block_size - 1, hidden.shape[-1])
    labels = batch.blocks.labels.view(-1, block_size)[:, 1:].to(target.device)
    counted = batch.blocks.weights.view(-1, block_size)[:, 1:].to(target.device) > 0
    top, predicted = [], []
    for chunk in hidden.split(max(1, cfg.head_chunk // block_size)):
        best = torch.softmax(project(chunk).float(), dim=-1).topk(ranks, dim=-1)
        top.append(best.values)
        predicted.append(best.indices)
    predicted, top = torch.cat(predicted), torch.cat(top)
    correct = ((predicted == labels[..., None]) & counted[..., None]).cpu()
    top = top.cpu()
    return BlockOutcomes(
        correct=correct[..., 0],
        counted=counted.cpu(),
        confidence=top[..., 0],
        runner_up_correct=correct[..., 1:] if ranks > 1 else None,
        runner_up_confidence=top[..., 1:] if ranks > 1 else None,
    )


@dataclass(frozen=True)
class ValidationData:
    """Validation samples with the target's rows of them (by index), the draft vocabulary their labels index, and the
    seed that fixes their anchors."""

    samples: pd.DataFrame
    rows: object  # a HiddenStateCache or a list of TargetRow
    vocab: DraftVocab | None = None
    seed: int = 0

    def batch(self, indices: list[int], config: DFlashConfig, cfg: TrainConfig) -> Batch:
        return make_batch(self.samples, indices, [self.rows[i] for i in indices], config, cfg, self.seed, 0, self.vocab)


def validation_outcomes(drafter, target: Target, project, data: ValidationData, config: DFlashConfig, cfg: TrainConfig, ranks: int = 1) -> BlockOutcomes:
    """``block_outcomes`` over all of ``data`` in this process, every position weighted, on the target's greedy path."""
    cfg = dataclasses.replace(cfg, sample_loss_positions=False, labels="greedy_path")
    count = len(data.samples)
    batches = (data.batch(list(range(begin, min(count, begin + cfg.batch_size))), config, cfg) for begin in range(0, count, cfg.batch_size))
    return BlockOutcomes.cat([block_outcomes(drafter, target, project, batch, cfg, ranks) for batch in batches])


@torch.no_grad()
def validation_metrics(
    drafter, target: Target, head: torch.Tensor, data: ValidationData, config: DFlashConfig, cfg: TrainConfig, layout: Layout
) -> tuple[list[float], float]:
    """Per-position accuracy (positions 0..B-1; 0 is never drafted) and teacher-forced τ of ``drafter`` on ``data``,
    every position weighted, summed over the drafter ranks."""
    cfg = dataclasses.replace(cfg, sample_loss_positions=False, labels="greedy_path")
    count, span, block = len(data.samples), cfg.batch_size * layout.drafter_world, config.block_size
    sums = torch.zeros(2 * block + 2, dtype=torch.float64)  # correct, counted per position; τ sum, blocks
    # The same batches on every rank, so that each takes part in every forward (FSDP gathers parameters in each).
    for begin in range(0, count, span):
        share = rank_slice(list(range(begin, min(count, begin + span))), layout.rank, layout.drafter_world)
        batch = data.batch(share, config, cfg) if share else idle_batch(data.samples, 0, config.feature_width, config, cfg)
        outcome = block_outcomes(drafter, target, projection(head), batch, cfg)
        if share:
            tau_sum, blocks = outcome.tau_sums()
            sums[1:block] += (outcome.correct & outcome.counted).sum(0).double()
            sums[block + 1 : 2 * block] += outcome.counted.sum(0).double()
            sums[-2:] += torch.tensor([tau_sum, blocks], dtype=torch.float64)
    totals = all_reduce_sum(sums.to(layout.device), layout).cpu()
    accuracy = (totals[:block] / totals[block : 2 * block].clamp(min=1)).tolist()
    return accuracy, float(totals[-2] / totals[-1].clamp(min=1))
