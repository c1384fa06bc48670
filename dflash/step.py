"""What one training step is: the drafter's config for a target, its compiled forward, the loss, the update.

Training (``dflash.train``) and the compile-cache warmup
(``dflash.preflight.warmup``) both run ``train_step`` on a drafter from
``compile_drafter``, so that the graphs the warmup compiles are the graphs
training runs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx.experimental._config as fx_config

from dflash.attention import build_training_mask
from dflash.batch import Batch, idle_batch, make_batch, rank_slice
from dflash.config import DrafterConfig, TrainConfig
from dflash.distributed import Layout, all_reduce_sum
from dflash.model import DFlashConfig, DFlashDrafter
from dflash.objective import FrozenHeadCrossEntropy, position_accuracy
from dflash.target import Target, native_bf16


def drafter_config_for(target: Target, cfg: DrafterConfig) -> DFlashConfig:
    """The drafter's shape for ``target`` (the config's ``drafter`` section; the mask token defaults to an unused special token)."""
    mask_token_id = target.default_mask_token_id() if cfg.mask_token_id is None else cfg.mask_token_id
    return drafter_shape(target.config, cfg, mask_token_id)


def drafter_shape(target_config, cfg: DrafterConfig, mask_token_id: int) -> DFlashConfig:
    """The drafter's shape from the target's transformers config alone (no weights, no tokenizer)."""
    options = dataclasses.asdict(cfg) | {"mask_token_id": mask_token_id}
    del options["draft_vocab_size"]  # which tokens it drafts, not its shape: dflash.vocab
    return DFlashConfig.for_target(target_config, **options)


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


def drafter_loss(
    drafter_forward, target: Target, batch: Batch, attention_backend: str, head_chunk: int, head: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decayed loss of one batch through the frozen ``head`` (the target's LM head, or its draft-vocabulary
    rows, which the batch's labels index); also per-position correct and counted predictions."""
    device = target.device
    blocks = batch.blocks
    block_size = blocks.input_ids.shape[1] // batch.anchors.shape[1]
    mask = build_training_mask(batch.anchors.to(device), batch.valid.to(device), batch.input_ids.shape[1], block_size, attention_backend)
    with torch.no_grad():
        block_embeddings = target.embed(blocks.input_ids.to(device))
    context_positions = torch.arange(batch.input_ids.shape[1], device=device).expand(batch.input_ids.shape[0], -1)
    hidden = drafter_forward(batch.features.to(device), block_embeddings, context_positions, blocks.positions.to(device), mask)
    weights = blocks.weights.to(device).flatten()
    rows = weights.nonzero().squeeze(1)
    if blocks.soft_ids is not None:  # distillation: the target's top-k distribution
        labels, probs = blocks.soft_ids.to(device).flatten(0, 1)[rows], blocks.soft_probs.to(device).flatten(0, 1)[rows]
    else:
        labels, probs = blocks.labels.to(device).flatten()[rows], None
    loss, predictions = FrozenHeadCrossEntropy.apply(
        hidden.flatten(0, 1)[rows],
        target.lm_head.weight if head is None else head,
        labels,
        weights[rows],
        batch.weight_total.to(device),
        head_chunk,
        probs,
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
    """One optimizer step: loss, backward, clipping, update (``head`` as in ``drafter_loss``).

    ``forward`` is the (compiled) drafter, wrapped in DDP when several ranks
    train: its backward then leaves every rank with the averaged gradient.
    """
    device = target.device
    dtype = autocast_dtype(cfg.precision, device)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss, correct, counted = drafter_loss(forward, target, batch, cfg.attention_backend, cfg.head_chunk, head)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
    optimizer.step()
    return loss, correct, counted, grad_norm


@torch.no_grad()
def validation_accuracy(
    drafter, target: Target, head: torch.Tensor, samples, rows, config: DFlashConfig, cfg: TrainConfig, vocab, layout: Layout, seed: int
) -> list[float]:
    """Per-position accuracy of ``drafter`` on validation ``samples`` (``rows``: the target's, by index), every
    position weighted and anchors fixed by ``seed``, summed over the drafter ranks."""
    cfg = dataclasses.replace(cfg, sample_loss_positions=False)
    correct = torch.zeros(config.block_size, dtype=torch.float64)
    counted = torch.zeros_like(correct)
    dtype = autocast_dtype(cfg.precision, layout.device)
    width, n, span = len(config.target_layer_ids) * config.hidden_size, len(samples), cfg.batch_size * layout.drafter_world
    # The same batches on every rank, so that each takes part in every forward (FSDP gathers parameters in each).
    for begin in range(0, n, span):
        share = rank_slice(list(range(begin, min(n, begin + span))), layout.rank, layout.drafter_world)
        batch = make_batch(samples, share, [rows[i] for i in share], config, cfg, seed, 0, vocab) if share else idle_batch(samples, 0, width, config, cfg)
        with torch.autocast(layout.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            _, c, k = drafter_loss(drafter, target, batch, cfg.attention_backend, cfg.head_chunk, head)
        correct += c.double().cpu()
        counted += k.double().cpu()
    totals = all_reduce_sum(torch.cat([correct, counted]).to(layout.device), layout).cpu()
    return (totals[: correct.numel()] / totals[correct.numel() :].clamp(min=1)).tolist()
