"""What a training step trains on: the sample order, the global batch of each step, and a rank's padded batch.

The order is a function of the seed and the epoch only, and every random draw
of a sample (its anchors, its sampled loss positions) a function of the seed,
the epoch and the sample's index: a run sees the same batches whatever the
topology, and a resumed run the same as an uninterrupted one.

Rows are padded to a multiple of ``train.pad_multiple``, so that a run's batches
take a few shapes that ``step_shapes`` lists in advance: the compile-cache
warmup compiles each of them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass, field

import pandas as pd
import torch

from dflash.config import TrainConfig
from dflash.model import DFlashConfig
from dflash.objective import Blocks, build_blocks, decay_weights, default_gamma, loss_normaliser, sample_anchors, sample_positions
from dflash.vocab import DraftVocab


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded by a hash of ``parts``: independent streams for (seed, epoch, sample, ...)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The order samples are seen in an epoch: a function of the seed and the epoch only, never of the topology."""
    return torch.randperm(num_samples, generator=seeded_generator(seed, epoch)).tolist()


def global_batches(num_samples: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices of each optimizer step of an epoch; the last partial batch is kept."""
    order = epoch_order(num_samples, seed, epoch)
    return [order[i : i + batch_size] for i in range(0, num_samples, batch_size)]


def rank_slice(batch: list[int], rank: int, world: int) -> list[int]:
    """A data-parallel rank's share of a global batch (strided, so shares differ by at most one sample)."""
    return batch[rank::world]


@functools.lru_cache(maxsize=2)  # the current epoch, and the next one that prefetching reaches into
def _epoch_batches(num_samples: int, batch_size: int, seed: int, epoch: int) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, global_batches(num_samples, batch_size, seed, epoch)))


@dataclass(frozen=True)
class Schedule:
    """The steps of a run and the global batch of each; the data position of a checkpoint is its step."""

    num_samples: int
    batch_size: int
    seed: int
    total: int  # optimizer steps of the whole run

    @classmethod
    def for_run(cls, num_samples: int, cfg: TrainConfig, seed: int, max_steps: int | None = None) -> Schedule:
        total = math.ceil(num_samples / cfg.batch_size) * cfg.epochs
        return cls(num_samples, cfg.batch_size, seed, total if max_steps is None else min(max_steps, total))

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def batch(self, step: int) -> list[int]:
        epoch, index = divmod(step, self.steps_per_epoch)
        return list(_epoch_batches(self.num_samples, self.batch_size, self.seed, epoch)[index])


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def pad_rows(rows: list, pad_value: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad integer rows into ``[b, S]`` with an attention mask; ``S`` is the longest row rounded up to ``multiple``."""
    width = padded_length(max(len(r) for r in rows), multiple)
    ids = torch.full((len(rows), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


@dataclass
class TargetRow:
    """The target's teacher-forced pass over one sample (``dflash.target.TargetPass``, one row of it)."""

    features: torch.Tensor  # [S, K*H]
    greedy: torch.Tensor  # [S] long
    top_ids: torch.Tensor | None = None  # [S, k]: the target's most likely next tokens (distillation)
    top_probs: torch.Tensor | None = None  # [S, k]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S] bool
    features: torch.Tensor  # [b, S, K*H]
    greedy: torch.Tensor  # [b, S]: the target's greedy next token after each position
    anchors: torch.Tensor  # [b, A]
    valid: torch.Tensor  # [b, A]
    blocks: Blocks
    weight_total: torch.Tensor  # the loss normaliser (train.loss_normaliser), taken before any position sampling
    indices: list[int] = field(default_factory=list)  # the samples of the rows (none for an idle rank's placeholder)


def make_batch(
    samples: pd.DataFrame,
    indices: list[int],
    rows: list[TargetRow],
    config: DFlashConfig,
    cfg: TrainConfig,
    seed: int,
    epoch: int,
    vocab: DraftVocab | None = None,
) -> Batch:
    """Pad the samples, draw their anchors (and sampled loss positions) and label their blocks with the target's
    greedy tokens (as indices of the draft vocabulary ``vocab``, if the drafter has one). All randomness of a
    sample depends on (seed, epoch, sample index) only, never on the batch or the topology."""
    ids, _ = pad_rows([samples["input_ids"].iloc[i] for i in indices], pad_value=0, multiple=cfg.pad_multiple)
    loss_mask, _ = pad_rows([samples["loss_mask"].iloc[i] for i in indices], pad_value=0, multiple=cfg.pad_multiple)
    loss_mask = loss_mask.bool()
    width = ids.shape[1]
    # On the features' device: online features stay on the GPU they were computed on.
    feats = rows[0].features.new_zeros(len(indices), width, rows[0].features.shape[-1], dtype=torch.float32)
    greedy = torch.zeros_like(ids)
    top_k = rows[0].top_ids.shape[-1] if rows[0].top_ids is not None else 0
    top_ids = torch.zeros(*ids.shape, top_k, dtype=torch.long)
    top_probs = torch.zeros(*ids.shape, top_k)
    anchors, valid = [], []
    for row, (i, target_row) in enumerate(zip(indices, rows)):
        length = target_row.features.shape[0]
        feats[row, :length] = target_row.features
        greedy[row, :length] = target_row.greedy.cpu()
        if top_k:
            top_ids[row, :length] = target_row.top_ids.cpu()
            top_probs[row, :length] = target_row.top_probs.cpu().float()
        length = len(samples["input_ids"].iloc[i])
        a, v = sample_anchors(loss_mask[row : row + 1, :length], cfg.max_anchors, seeded_generator(seed, epoch, i))
        anchors.append(a)
        valid.append(v)
    anchors, valid = torch.cat(anchors), torch.cat(valid)
    # D-PACE weighs the positions during the step, from the drafter's own confidence: every trained position starts at 1.
    gamma = math.inf if cfg.position_weights == "dpace" else cfg.gamma or default_gamma(config.block_size)
    position_weights = decay_weights(config.block_size, gamma)
    soft = (top_ids, top_probs) if top_k else None
    blocks = build_blocks(ids, loss_mask, anchors, valid, position_weights, config.mask_token_id, greedy, soft, greedy_path_only=cfg.labels == "greedy_path")
    if vocab is not None:
        # A label outside the draft vocabulary cannot be drafted: it trains nothing (and has no probability to learn).
        drafted = vocab.index[blocks.labels]
        blocks.weights = blocks.weights * (drafted >= 0)
        blocks.labels = drafted.clamp(min=0)
        if top_k:
            soft = vocab.index[blocks.soft_ids]
            probs = blocks.soft_probs * (soft >= 0)
            blocks.soft_ids, blocks.soft_probs = soft.clamp(min=0), probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
    weight_total = loss_normaliser(blocks.weights, cfg.loss_normaliser)
    if cfg.sample_loss_positions:
        blocks.weights = torch.cat([sample_positions(w[None], seeded_generator(seed, epoch, i, 1)) for i, w in zip(indices, blocks.weights)])
    return Batch(
        input_ids=ids,
        loss_mask=loss_mask,
        features=feats,
        greedy=greedy,
        anchors=anchors,
        valid=valid,
        blocks=blocks,
        weight_total=weight_total,
        indices=list(indices),
    )


def idle_batch(samples: pd.DataFrame, stand_in: int, width: int, config: DFlashConfig, cfg: TrainConfig) -> Batch:
    """A drafter rank with no sample in a step (a global batch smaller than the drafter ranks, at an
    epoch's end) still runs the step, because every rank must join the gradient all-reduce: one
    stand-in row with zero weight, which adds nothing to the loss or the gradient."""
    length = len(samples["input_ids"].iloc[stand_in])
    batch = make_batch(samples, [stand_in], [TargetRow(torch.zeros(length, width), torch.zeros(length, dtype=torch.long))], config, cfg, seed=0, epoch=0)
    batch.blocks.weights.zero_()
    return dataclasses.replace(batch, weight_total=torch.zeros(()), indices=[])


def step_shapes(lengths: list[int], cfg: TrainConfig, drafter_world: int) -> list[tuple[int, int]]:
    """Every (rows, padded length) a drafter rank's batch can take in a run over samples of these lengths,
    whatever the seed and the epochs: what the compile-cache warmup must compile. Full batches first.

    A rank's rows are its share of a full global batch or of an epoch's last, smaller one (an empty share
    runs one stand-in row); the padded length of ``r`` rows is that of any sample at least as long as the
    ``r``-th shortest, since the longest of them sets it.
    """
    count = len(lengths)
    global_sizes = {min(cfg.batch_size, count)} | ({count % cfg.batch_size} if count > cfg.batch_size and count % cfg.batch_size else set())
    rows = {max(1, len(range(rank, size, drafter_world))) for size in global_sizes for rank in range(drafter_world)}
    ordered = sorted(lengths)
    return [(r, length) for r in sorted(rows, reverse=True) for length in sorted({padded_length(n, cfg.pad_multiple) for n in ordered[r - 1 :]})]
