"""Training the drafter on the target's hidden states.

Reads top to bottom: the sample order, hidden-state sources (a disk cache
computed once, the target online on the same rank, or target ranks sending
them), batch assembly, the loss through the target's frozen LM head,
resumable checkpoints, and the loop (AdamW, warmup + cosine, clipping,
metrics). One process per device; ``dflash.distributed`` holds everything
about ranks, so with one process this is a plain single-device loop.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.fx.experimental._config as fx_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from tqdm.auto import tqdm

from dflash import distributed
from dflash.attention import build_training_mask
from dflash.config import DrafterConfig, TrainConfig
from dflash.distributed import Incoming, Layout, all_reduce_sum, routes, send_rows
from dflash.model import DFlashConfig, DFlashDrafter
from dflash.objective import Blocks, build_blocks, default_gamma, position_accuracy, sample_anchors, sample_positions
from dflash.preflight.warmup import log_compile_cache_hits, use_warm_cache
from dflash.target import Target

log = logging.getLogger(__name__)


# -- data order ------------------------------------------------------------------------------


def _seeded(*parts: int) -> torch.Generator:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The order samples are seen in an epoch: a function of the seed and the epoch only, never of the topology."""
    return torch.randperm(num_samples, generator=_seeded(seed, epoch)).tolist()


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
    def for_run(cls, num_samples: int, cfg: TrainConfig, seed: int, max_steps: int | None = None) -> "Schedule":
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


# -- hidden states ---------------------------------------------------------------------------
#
# Three sources, any topology: a disk cache computed once before training
# (``train.hidden_states: cache``), or the target online (``online``): on the
# drafter's own rank when colocated, on the target ranks when split.


def pad_rows(rows: list, pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad integer rows into ``[b, S]`` with an attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def length_groups(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Row indices grouped for batched target forwards: by length, at most ``token_budget`` padded tokens per group (or one row)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, begin = [], 0
    while begin < len(order):
        end = begin + 1
        while end < len(order) and (end - begin + 1) * lengths[order[end]] <= token_budget:
            end += 1
        groups.append(order[begin:end])
        begin = end
    return groups


@dataclass
class Meter:
    """Tokens and seconds of this rank's target forwards: the hidden-state throughput."""

    tokens: int = 0
    seconds: float = 0.0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def target_features(target: Target, rows: list[list[int]], layer_ids: list[int], meter: Meter, token_budget: int = 8192) -> list[torch.Tensor]:
    """The target's features of each row of token ids, ``[len(row), K*H]`` on the target's device."""
    start = time.perf_counter()
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for group in length_groups([len(r) for r in rows], token_budget):
        ids, mask = pad_rows([rows[i] for i in group], pad_value=0)
        feats = target.features(ids.to(target.device), mask.to(target.device), layer_ids)
        for r, i in enumerate(group):
            out[i] = feats[r, : len(rows[i])]
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)  # time the computation, not its launch
    meter.tokens += sum(len(r) for r in rows)
    meter.seconds += time.perf_counter() - start
    return out


class HiddenStateCache:
    """Target features of every sample, computed once and memory-mapped from disk (fp16, one row per token).

    Every rank of the run writes its own shard file, so a cache is built in
    parallel with no two processes writing one file (safe on any shared filesystem).
    """

    FORMAT = 2  # 1: one features.npy written by one process

    def __init__(self, directory: Path):
        meta = json.loads((directory / "meta.json").read_text())
        self.key = meta["key"]
        self.location = np.asarray(meta["location"], dtype=np.int64)  # per sample: shard, first row, end row
        self.shards = [np.load(directory / name, mmap_mode="r") for name in meta["shards"]]

    def __getitem__(self, index: int) -> torch.Tensor:
        shard, begin, end = self.location[index]
        return torch.from_numpy(np.asarray(self.shards[shard][begin:end], dtype=np.float32))

    @classmethod
    def _holds(cls, meta_path: Path, key: str) -> bool:
        if not meta_path.is_file():
            return False
        meta = json.loads(meta_path.read_text())
        return meta.get("format") == cls.FORMAT and meta.get("key") == key

    @staticmethod
    def cache_key(samples: pd.DataFrame, target_source: str, layer_ids: list[int]) -> str:
        digest = hashlib.sha256(json.dumps([target_source, list(layer_ids)]).encode())
        for ids in samples["input_ids"]:
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]

    @classmethod
    def build(
        cls,
        directory: Path,
        target: Target,
        samples: pd.DataFrame,
        layer_ids: list[int],
        layout: Layout | None = None,
        meter: Meter | None = None,
        token_budget: int = 8192,
    ) -> "HiddenStateCache":
        """Compute (or reuse) the cache; every rank calls this and computes one shard (one process: all of it).

        Shards and ``meta.json`` are written under temporary names and renamed,
        ``meta.json`` last: a crash, even kill -9, leaves no cache that would load.
        """
        layout = layout or distributed.single_process(target.device)
        meter = meter or Meter()
        key = cls.cache_key(samples, target.source, layer_ids)
        meta_path = directory / "meta.json"
        if distributed.broadcast_from_main(layout.is_main and cls._holds(meta_path, key), layout):
            log.info("hidden-state cache hit: %s", directory)
            return cls(directory)
        if layout.is_main:
            # Invalidate the old cache before any of its shards is overwritten.
            directory.mkdir(parents=True, exist_ok=True)
            meta_path.unlink(missing_ok=True)
            for old in directory.glob("features-*.npy"):
                old.unlink()
        distributed.barrier(layout)
        lengths = [len(ids) for ids in samples["input_ids"]]
        # Rank r's shard holds every world-th sample by length from the r-th, so that shards cost about the same.
        by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
        shards = [by_length[r :: layout.world] for r in range(min(layout.world, len(lengths)))]
        if layout.rank < len(shards):
            shard, mine = layout.rank, shards[layout.rank]
            ends = np.cumsum([lengths[i] for i in mine])
            tmp = directory / f"features-{shard:03d}.tmp.npy"
            store = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(int(ends[-1]), len(layer_ids) * target.hidden_size))
            row_of = {i: int(end) - lengths[i] for i, end in zip(mine, ends)}
            with tqdm(total=int(ends[-1]), desc=f"caching target hidden states (shard {shard})", unit="tok", unit_scale=True, disable=shard != 0) as bar:
                for group in length_groups([lengths[i] for i in mine], token_budget):
                    indices = [mine[g] for g in group]
                    rows = target_features(target, [samples["input_ids"].iloc[i] for i in indices], layer_ids, meter)
                    for i, feats in zip(indices, rows):
                        store[row_of[i] : row_of[i] + lengths[i]] = feats.float().cpu().numpy()
                    bar.update(sum(lengths[i] for i in indices))
            store.flush()
            del store
            tmp.replace(directory / f"features-{shard:03d}.npy")
        distributed.barrier(layout)  # every shard is in place
        if layout.is_main:
            location = np.zeros((len(lengths), 3), dtype=np.int64)
            for shard, members in enumerate(shards):
                begin = 0
                for i in members:
                    location[i] = (shard, begin, begin + lengths[i])
                    begin += lengths[i]
            names = [f"features-{shard:03d}.npy" for shard in range(len(shards))]
            meta = {"format": cls.FORMAT, "key": key, "layer_ids": list(layer_ids), "shards": names, "location": location.tolist()}
            (directory / "meta.tmp.json").write_text(json.dumps(meta))
            (directory / "meta.tmp.json").replace(meta_path)
        distributed.barrier(layout)
        return cls(directory)


class CachedFeatures:
    """Features read from the disk cache."""

    def __init__(self, store: HiddenStateCache):
        self.store = store

    def __call__(self, step: int, indices: list[int]) -> list[torch.Tensor]:
        return [self.store[i] for i in indices]


class OnlineFeatures:
    """Colocated: this rank's own target computes the features of its share."""

    def __init__(self, target: Target, samples: pd.DataFrame, layer_ids: list[int], meter: Meter):
        self.target, self.samples, self.layer_ids, self.meter = target, samples, layer_ids, meter

    def __call__(self, step: int, indices: list[int]) -> list[torch.Tensor]:
        return target_features(self.target, [self.samples["input_ids"].iloc[i] for i in indices], self.layer_ids, self.meter)


class ReceivedFeatures:
    """Split, drafter side: the features of this rank's share, sent by the target ranks.

    The receives of the next step are posted before this step trains, so the
    transfer overlaps training.
    """

    def __init__(self, layout: Layout, schedule: Schedule, lengths: list[int], width: int, dtype: torch.dtype):
        self.layout, self.schedule, self.lengths, self.width, self.dtype = layout, schedule, lengths, width, dtype
        self.pending: dict[int, list[tuple[list[int], Incoming]]] = {}

    def _post(self, step: int) -> None:
        batch, layout = self.schedule.batch(step), self.layout
        self.pending[step] = [
            (positions, Incoming.post([self.lengths[batch[j]] for j in positions], self.width, self.dtype, layout.device, layout.target_ranks[t]))
            for (t, d), positions in routes(len(batch), len(layout.target_ranks), layout.drafter_world).items()
            if d == layout.rank
        ]

    def __call__(self, step: int, indices: list[int]) -> list[torch.Tensor]:
        if step not in self.pending:
            self._post(step)
        if step + 1 < self.schedule.total:
            self._post(step + 1)
        received = {j: rows for positions, incoming in self.pending.pop(step) for j, rows in zip(positions, incoming.wait())}
        return [received[j] for j in sorted(received)]  # position order is share order


def serve_features(
    layout: Layout, target: Target, samples: pd.DataFrame, layer_ids: list[int], schedule: Schedule, first: int, meter: Meter, depth: int = 2
) -> None:
    """Split, target side: compute this rank's positions of every global batch and send each to the
    drafter rank that trains on it. Up to ``depth`` steps are in flight, so the target runs ahead of training."""
    senders = layout.target_ranks
    me = senders.index(layout.rank)
    in_flight: deque[list] = deque()
    for step in tqdm(range(first, schedule.total), desc=f"serving hidden states (rank {layout.rank})", unit="step", disable=me != 0):
        batch = schedule.batch(step)
        mine = list(range(me, len(batch), len(senders)))
        computed = dict(zip(mine, target_features(target, [samples["input_ids"].iloc[batch[j]] for j in mine], layer_ids, meter))) if mine else {}
        in_flight.append(
            [send_rows([computed[j] for j in positions], dst=d) for (t, d), positions in routes(len(batch), len(senders), layout.drafter_world).items() if t == me]
        )
        while len(in_flight) > depth:
            for request, _ in in_flight.popleft():
                request.wait()
    for sends in in_flight:
        for request, _ in sends:
            request.wait()


# -- one batch ---------------------------------------------------------------------------------


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S] bool
    features: torch.Tensor  # [b, S, K*H]
    anchors: torch.Tensor  # [b, A]
    valid: torch.Tensor  # [b, A]
    blocks: Blocks
    weight_total: torch.Tensor  # the loss normaliser: the decay weights' sum before any position sampling
    indices: list[int] = field(default_factory=list)  # the samples of the rows (none for an idle rank's placeholder)


def make_batch(
    samples: pd.DataFrame,
    indices: list[int],
    features: list[torch.Tensor],
    config: DFlashConfig,
    max_anchors: int,
    gamma: float,
    seed: int,
    epoch: int,
    sample_loss_positions: bool = False,
) -> Batch:
    """Pad the samples and draw their anchors (and sampled loss positions); all randomness of a
    sample depends on (seed, epoch, sample index) only, never on the batch or the topology."""
    ids, _ = pad_rows([samples["input_ids"].iloc[i] for i in indices], pad_value=0)
    loss_mask, _ = pad_rows([samples["loss_mask"].iloc[i] for i in indices], pad_value=0)
    loss_mask = loss_mask.bool()
    width = ids.shape[1]
    # On the features' device: online features stay on the GPU they were computed on.
    feats = features[0].new_zeros(len(indices), width, features[0].shape[-1], dtype=torch.float32)
    anchors, valid = [], []
    for row, (i, f) in enumerate(zip(indices, features)):
        feats[row, : f.shape[0]] = f
        length = len(samples["input_ids"].iloc[i])
        a, v = sample_anchors(loss_mask[row : row + 1, :length], max_anchors, _seeded(seed, epoch, i))
        anchors.append(a)
        valid.append(v)
    anchors, valid = torch.cat(anchors), torch.cat(valid)
    blocks = build_blocks(ids, loss_mask, anchors, valid, config.block_size, config.mask_token_id, gamma)
    weight_total = blocks.weights.sum()
    if sample_loss_positions:
        blocks.weights = torch.cat([sample_positions(w[None], _seeded(seed, epoch, i, 1)) for i, w in zip(indices, blocks.weights)])
    return Batch(ids, loss_mask, feats, anchors, valid, blocks, weight_total, list(indices))


def idle_batch(samples: pd.DataFrame, stand_in: int, width: int, config: DFlashConfig, max_anchors: int, gamma: float) -> Batch:
    """A drafter rank with no sample in a step (a global batch smaller than the drafter ranks, at an
    epoch's end) still runs the step, because every rank must join the gradient all-reduce: one
    stand-in row with zero weight, which adds nothing to the loss or the gradient."""
    length = len(samples["input_ids"].iloc[stand_in])
    batch = make_batch(samples, [stand_in], [torch.zeros(length, width)], config, max_anchors, gamma, seed=0, epoch=0)
    batch.blocks.weights.zero_()
    return dataclasses.replace(batch, weight_total=torch.zeros(()), indices=[])


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """Weighted cross-entropy through a frozen LM head, in row chunks.

    Never holds more than ``chunk`` rows of logits: the gradient with respect to
    the hidden states is computed in the forward pass (the head is frozen, so
    nothing else needs the logits). Also returns the top-1 predictions.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, total, chunk):
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        predictions = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for begin in range(0, hidden.shape[0], chunk):
            h = hidden[begin : begin + chunk]
            logits = (h @ head_weight.to(h.dtype).t()).float()
            y, w = labels[begin : begin + chunk], weights[begin : begin + chunk]
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, y[:, None]).squeeze(1)) * w).sum()
            predictions[begin : begin + chunk] = logits.argmax(-1)
            if grad is not None:
                probs = torch.exp(logits - lse[:, None])
                probs[torch.arange(len(y), device=y.device), y] -= 1.0
                probs *= (w / total)[:, None]
                grad[begin : begin + chunk] = (probs.to(h.dtype) @ head_weight.to(h.dtype))
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(predictions)
        return loss / total, predictions

    @staticmethod
    def backward(ctx, grad_loss, _grad_predictions):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def compile_drafter(drafter: DFlashDrafter, enabled: bool):
    """The drafter's forward as training runs it: compiled with dynamic shapes (sequence lengths vary per batch).

    The compile-cache warmup compiles exactly this, so that training starts warm.
    """
    # Without duck shaping, two dimensions that happen to be equal in one batch (rows = block size, say)
    # are not tied into one symbol, which would make a later batch fail the guard and compile cold.
    fx_config.use_duck_shape = False
    return torch.compile(drafter, dynamic=True) if enabled else drafter


def drafter_loss(
    drafter_forward,
    target: Target,
    batch: Batch,
    attention_backend: str,
    head_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decayed loss of one batch; also per-position correct and counted predictions."""
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
    loss, predictions = FrozenHeadCrossEntropy.apply(
        hidden.flatten(0, 1)[rows],
        target.lm_head.weight,
        blocks.labels.to(device).flatten()[rows],
        weights[rows],
        batch.weight_total.to(device),
        head_chunk,
    )
    all_predictions = torch.full_like(weights, -1, dtype=torch.long)
    all_predictions[rows] = predictions
    correct, counted = position_accuracy(all_predictions.view_as(blocks.labels), blocks.labels.to(device), blocks.weights.to(device), block_size)
    return loss, correct, counted


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU (fp32 master weights), none on CPU, unless the config says otherwise."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def train_step(forward, drafter: torch.nn.Module, optimizer, target: Target, batch: Batch, cfg: TrainConfig):
    """One optimizer step: loss, backward, clipping, update. The compile-cache warmup runs exactly this.

    ``forward`` is the (compiled) drafter, wrapped in DDP when several ranks
    train: its backward then leaves every rank with the averaged gradient.
    """
    device = target.device
    dtype = autocast_dtype(cfg.precision, device)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss, correct, counted = drafter_loss(forward, target, batch, cfg.attention_backend, cfg.head_chunk)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
    optimizer.step()
    return loss, correct, counted, grad_norm


def normalise_globally(batch: Batch, layout: Layout) -> None:
    """Divide every rank's weighted loss by the weight total of the whole global batch, times the
    drafter ranks because DDP and FSDP average gradients over ranks: the data-parallel gradient is
    then the one-process gradient of the global batch, whatever the topology."""
    total = all_reduce_sum(batch.weight_total.to(layout.device, torch.float32), layout)
    batch.weight_total = total / layout.drafter_world


# -- the run's settings ---------------------------------------------------------------------------


def lr_factor(step: int, total_steps: int, warmup_ratio: float) -> float:
    """Linear warmup then cosine decay to zero."""
    warmup = max(1, int(math.ceil(warmup_ratio * total_steps)))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def drafter_config_for(target: Target, cfg: DrafterConfig) -> DFlashConfig:
    mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token_id(target)
    return DFlashConfig.for_target(
        target.config,
        mask_token_id=mask_token_id,
        num_hidden_layers=cfg.num_hidden_layers,
        num_context_features=cfg.num_context_features,
        block_size=cfg.block_size,
        layer_ids=cfg.layer_ids,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
    )


def default_mask_token_id(target: Target) -> int:
    """A special token the chat template never emits: the highest-id added special token not used for chat."""
    tokenizer = target.tokenizer
    used = set(target.eos_token_ids) | {tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", "") or ""
    candidates = [
        token_id
        for token_id in sorted(getattr(tokenizer, "all_special_ids", []) + list(getattr(tokenizer, "added_tokens_decoder", {})))
        if token_id not in used and tokenizer.convert_ids_to_tokens(token_id) not in template and token_id < target.config.vocab_size
    ]
    if not candidates:
        raise ValueError(f"target {target.source!r} has no unused special token to serve as the mask; set drafter.mask_token_id")
    return max(candidates)


@dataclass
class TrainResult:
    steps: int
    resumed_from: int
    final_loss: float
    seconds: float
    tokens_per_second: float  # training: sample tokens (no padding) of the global batches per second, after the first step
    first_step_seconds: float  # the first step alone: compiling (or loading compiled graphs) and warming up
    target_tokens_per_second: float  # hidden states: tokens per second of target forward, summed over the ranks that run it (0: all cached)
    world: int  # processes
    compile_cache: dict  # hits and misses after the first step: misses mean the warmup did not cover a graph


def write_metrics_row(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


# -- resumable checkpoints ---------------------------------------------------------------------
#
# They live outside the workflow's declared outputs (Snakemake deletes those before
# rerunning a job), one directory per run fingerprint. Rank 0 writes; every drafter
# rank loads (a filesystem shared by the nodes). A checkpoint directory is written
# under a temporary name, synced and renamed into place; old ones are renamed away
# before they are deleted: a crash, even kill -9, at any point leaves only
# directories that are never loaded.

_STEP_PREFIX = "step-"


@dataclass
class Progress:
    """What a resumed run needs besides weights and optimizer: the metric rows so far and the accuracy
    counts of the current logging window. The data position is the step: see ``Schedule``."""

    rows: list[dict]
    correct: torch.Tensor  # [B], since the last logged row, over all ranks
    counted: torch.Tensor

    @classmethod
    def fresh(cls, block_size: int) -> "Progress":
        return cls([], torch.zeros(block_size, dtype=torch.float64), torch.zeros(block_size, dtype=torch.float64))


def complete_checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_STEP_PREFIX) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_STEP_PREFIX) :]))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Delete a directory so that no crash leaves a part of it under its name: rename, then delete."""
    trash = path.with_name(f".trash-{path.name}")
    path.rename(trash)
    shutil.rmtree(trash)


def write_checkpoint(directory: Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and keep the ``keep`` newest (rank 0 only)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{_STEP_PREFIX}{step:08d}"
    staging = directory / f".tmp-{final.name}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    torch.save(state, staging / "state.pt")
    (staging / "meta.json").write_text(json.dumps({"step": step}))
    for path in (staging / "state.pt", staging / "meta.json", staging):
        _fsync(path)  # on disk before the rename makes it a checkpoint, should the machine go down
    staging.rename(final)
    _fsync(directory)
    for old in complete_checkpoints(directory)[:-keep]:
        _discard(old)
    return final


def remove_incomplete(directory: Path) -> None:
    """Leftovers of a crash mid-write or mid-delete (rank 0, before training)."""
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(path)


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(directory: Path, step: int, drafter: torch.nn.Module, optimizer, scheduler, progress: Progress, layout: Layout, keep: int = 2) -> None:
    """Every drafter rank calls this: the full state is gathered (FSDP shards, each rank's RNG) and rank 0 writes it."""
    model_state, optimizer_state = get_state_dict(drafter, optimizer, options=_FULL)
    rng = distributed.gather_to_main(_rng_state(layout.device), layout)
    if layout.is_main:
        state = {
            "drafter": model_state,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "rng": rng,  # per drafter rank
            "progress": dataclasses.asdict(progress),
        }
        write_checkpoint(directory, step, state, keep)


def load_checkpoint(path: Path, drafter: torch.nn.Module, optimizer, scheduler, layout: Layout) -> Progress:
    """Every drafter rank loads the checkpoint rank 0 wrote."""
    # weights_only: the restricted unpickler, which cannot run code from the file.
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    set_state_dict(drafter, optimizer, model_state_dict=state["drafter"], optim_state_dict=state["optimizer"], options=_FULL)
    scheduler.load_state_dict(state["scheduler"])
    if len(state["rng"]) != layout.drafter_world:
        raise RuntimeError(f"{path} was written by {len(state['rng'])} drafter ranks, this run has {layout.drafter_world}: checkpoints resume the same topology")
    _set_rng_state(state["rng"][layout.rank], layout.device)
    return Progress(**state["progress"])


def resume_point(directory: Path, layout: Layout) -> tuple[int, Path | None]:
    """The step to start from and the checkpoint to load: rank 0 decides, every rank follows."""
    if layout.is_main:
        remove_incomplete(directory)
    checkpoints = complete_checkpoints(directory) if layout.is_main else []
    latest = distributed.broadcast_from_main(str(checkpoints[-1]) if checkpoints else None, layout)
    if latest is None:
        return 0, None
    return json.loads((Path(latest) / "meta.json").read_text())["step"], Path(latest)


def save_drafter(drafter: torch.nn.Module, config: DFlashConfig, out_dir: Path, layout: Layout) -> None:
    """The trained drafter in the reference format, from the full weights (gathered when FSDP shards them)."""
    state = get_model_state_dict(drafter, options=_FULL)
    if layout.is_main:
        plain = DFlashDrafter(config)
        plain.load_state_dict(state)
        plain.save_pretrained(out_dir)


# -- the loop ------------------------------------------------------------------------------------


def train_drafter(
    target: Target,
    samples: pd.DataFrame,
    drafter_cfg: DrafterConfig,
    cfg: TrainConfig,
    seed: int,
    hidden_cache_dir: Path,
    checkpoint_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    tracker=None,
    max_steps: int | None = None,
    layout: Layout | None = None,
) -> TrainResult:
    """Train on this rank's part of the topology (one process: the whole run); resumes from the last complete checkpoint.

    Every rank of the run calls this. Rank 0 writes the metrics, the checkpoints and the drafter.
    """
    layout = layout or distributed.single_process(target.device)
    config = drafter_config_for(target, drafter_cfg)
    schedule = Schedule.for_run(len(samples), cfg, seed, max_steps)
    meter = Meter()
    first, checkpoint = resume_point(checkpoint_dir, layout)
    width = len(config.target_layer_ids) * config.hidden_size
    if cfg.hidden_states == "cache":
        # Every rank holds the target, so every rank builds a shard; that is all the target does in this run, so
        # its throughput is summed now, and a split run's target ranks are free to leave.
        source = CachedFeatures(HiddenStateCache.build(hidden_cache_dir, target, samples, config.target_layer_ids, layout, meter))
        target_rate = total_rate(meter, layout)
    elif layout.kind == "colocated":
        source = OnlineFeatures(target, samples, config.target_layer_ids, meter)
    else:
        source = ReceivedFeatures(layout, schedule, [len(ids) for ids in samples["input_ids"]], width, target.dtype)
    start = time.perf_counter()
    if layout.is_drafter:
        result = _train(target, samples, config, cfg, schedule, source, first, checkpoint, checkpoint_dir, out_dir, metrics_path, tracker, layout)
    else:
        if cfg.hidden_states == "online":
            serve_features(layout, target, samples, config.target_layer_ids, schedule, first, meter)
        result = TrainResult(schedule.total, first, float("nan"), time.perf_counter() - start, 0.0, 0.0, 0.0, layout.world, {})
    if cfg.hidden_states == "online":
        target_rate = total_rate(meter, layout)
    result.target_tokens_per_second = target_rate
    return result


def total_rate(meter: Meter, layout: Layout) -> float:
    """The target's tokens per second over every rank that runs it (every rank takes part)."""
    rate = all_reduce_sum(torch.tensor([meter.rate()], dtype=torch.float64, device=layout.device), layout, everyone=True)
    return float(rate[0])


def _train(
    target: Target,
    samples: pd.DataFrame,
    config: DFlashConfig,
    cfg: TrainConfig,
    schedule: Schedule,
    source,
    first: int,
    checkpoint: Path | None,
    checkpoint_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    tracker,
    layout: Layout,
) -> TrainResult:
    """A drafter rank's loop."""
    torch.manual_seed(schedule.seed)
    drafter = DFlashDrafter(config).to(layout.device)
    distributed.shard(drafter, layout)
    forward = distributed.replicate(compile_drafter(drafter, cfg.compile), layout)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, schedule.total, cfg.warmup_ratio))
    gamma = cfg.gamma or default_gamma(config.block_size)
    width = len(config.target_layer_ids) * config.hidden_size
    lengths = [len(ids) for ids in samples["input_ids"]]
    progress = Progress.fresh(config.block_size)
    if checkpoint is not None:
        progress = load_checkpoint(checkpoint, drafter, optimizer, scheduler, layout)
        log.info("resuming from %s (step %d of %d)", checkpoint, first, schedule.total)
    if layout.is_main:
        # The rows of the run so far (a resumed run's are the checkpoint's; a fresh run's, none).
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        metrics_path.unlink(missing_ok=True)
        for row in progress.rows:
            write_metrics_row(metrics_path, row)
    start, tokens_seen, loss_value, compile_cache = time.perf_counter(), 0, float("nan"), {}
    first_step_seconds, steady = 0.0, (start, 0)  # throughput is measured from the end of the first step
    with tqdm(total=schedule.total, initial=first, desc="training drafter", unit="step", disable=not layout.is_main) as bar:
        for step in range(first, schedule.total):
            epoch, global_batch = schedule.epoch(step), schedule.batch(step)
            share = rank_slice(global_batch, layout.rank, layout.drafter_world)
            rows = source(step, share)
            if share:
                batch = make_batch(samples, share, rows, config, cfg.max_anchors, gamma, schedule.seed, epoch, cfg.sample_loss_positions)
            else:
                batch = idle_batch(samples, global_batch[0], width, config, cfg.max_anchors, gamma)
            normalise_globally(batch, layout)
            loss, correct, counted, grad_norm = train_step(forward, drafter, optimizer, target, batch, cfg)
            scheduler.step()
            # One all-reduce for the metrics: each rank's loss is its share of the global loss, times the ranks.
            stats = torch.cat([loss.detach().reshape(1).double(), correct.double(), counted.double()])
            stats = all_reduce_sum(stats, layout).cpu()
            loss_value = float(stats[0]) / layout.drafter_world
            progress.correct += stats[1 : 1 + config.block_size]
            progress.counted += stats[1 + config.block_size :]
            tokens_seen += sum(lengths[i] for i in global_batch)
            elapsed = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_seen / elapsed:.0f}")
            done = step + 1
            if step == first:
                first_step_seconds, steady = elapsed, (time.perf_counter(), tokens_seen)
                if cfg.compile:
                    compile_cache = log_compile_cache_hits(log)
            if done % cfg.log_every == 0 or done == schedule.total:
                acc = (progress.correct / progress.counted.clamp(min=1)).tolist()
                row = {"step": done, "epoch": epoch, "loss": loss_value, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_seen / elapsed}
                row.update({f"acc_{k}": acc[k] for k in range(1, config.block_size)})
                progress.rows.append(row)
                progress.correct.zero_()
                progress.counted.zero_()
                if layout.is_main:
                    write_metrics_row(metrics_path, row)
                    if tracker is not None:
                        tracker.log(row, step=done)
            if done % cfg.checkpoint_every == 0 and done < schedule.total:
                save_checkpoint(checkpoint_dir, done, drafter, optimizer, scheduler, progress, layout)
    end = time.perf_counter()
    save_drafter(drafter, config, out_dir, layout)
    if layout.is_main:
        # The run is complete: its checkpoints would only let a later rerun (of changed code, say) resume stale state.
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    steady_tokens = tokens_seen - steady[1]
    return TrainResult(
        steps=schedule.total,
        resumed_from=first,
        final_loss=loss_value,
        seconds=end - start,
        tokens_per_second=steady_tokens / (end - steady[0]) if steady_tokens else tokens_seen / max(end - start, 1e-9),
        first_step_seconds=first_step_seconds,
        target_tokens_per_second=0.0,
        world=layout.world,
        compile_cache=compile_cache,
    )


def check_preflight(paths: list[Path], topology) -> dict[str, dict]:
    """Training refuses to start unless every preflight verdict says ok and the race verdict says the
    configured execution is safe. Returns the verdicts by stage (warmups by device)."""
    from dflash.preflight.race import execution_is_safe
    from dflash.preflight.verdict import read_verdict

    verdicts = {}
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist: run the preflight stages first (snakemake runs them before train)")
        stage = json.loads(Path(path).read_text()).get("stage", "?")
        verdict = read_verdict(path, stage) | {"path": str(path)}
        verdicts[f"warmup_cache/{verdict['device']}" if stage == "warmup_cache" else stage] = verdict
    if "repro_fx_race" in verdicts:
        # One process per device, one thread each calling compiled code: the FX flag is never shared.
        safe, reason = execution_is_safe(verdicts["repro_fx_race"], topology, threads_per_process=1)
        if not safe:
            raise RuntimeError(f"training would hit the torch.compile FX-tracing race: {reason}")
        log.info("repro_fx_race: %s", reason)
    return verdicts


def device_name(kind: str, local_rank: int = 0) -> str:
    """The device wildcard of the preflight stages: ``cpu`` or ``cuda<local rank>``."""
    return "cpu" if kind == "cpu" else f"cuda{local_rank}"


def run_train_stage(sections: dict, args) -> TrainResult:
    """The ``train`` stage, on every rank torchrun started: drafter, metrics CSV, summary JSON under
    ``args.out_dir`` (rank 0); checkpoints and the hidden-state cache under ``args.checkpoint_dir``."""
    from dflash.config import canonical_json, config_hash
    from dflash.data import read_samples
    from dflash.target import load_from_manifest
    from dflash.tracking import open_tracker

    topology = sections["topology"]
    # An error on one rank ends its process; torchrun then stops the others, so no rank waits for it.
    layout = distributed.init(topology)
    verdicts = check_preflight(args.preflight, topology)
    if sections["train"].compile and layout.is_drafter:
        warmup = verdicts.get(f"warmup_cache/{device_name(topology.device, layout.local_rank)}")
        if warmup is None:
            log.warning("no compile-cache warmup for this device: the first training step compiles cold")
        else:
            use_warm_cache(warmup["path"])
    target = load_from_manifest(args.target_manifest, device=layout.device)
    samples = read_samples(args.samples)
    run_config = {key: json.loads(canonical_json(value)) for key, value in sections.items()} | {"seed": args.seed}
    fingerprint = config_hash(run_config | {"samples": HiddenStateCache.cache_key(samples, target.source, [])})
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tracking = sections["tracking"]
    tracker = open_tracker(tracking.wandb_mode, tracking.project, fingerprint, out_dir.parent / "wandb", run_config, rank=layout.rank)
    result = train_drafter(
        target,
        samples,
        sections["drafter"],
        sections["train"],
        args.seed,
        hidden_cache_dir=args.checkpoint_dir / "hidden-states",
        checkpoint_dir=args.checkpoint_dir / fingerprint,
        out_dir=out_dir / "drafter",
        metrics_path=out_dir / "metrics.csv",
        tracker=tracker,
        layout=layout,
    )
    if layout.is_main:
        where = f"{topology.kind} {topology.nnodes}x{topology.nproc_per_node} {topology.device}"
        summary = dataclasses.asdict(result) | {"fingerprint": fingerprint, "samples": len(samples), "topology": where}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if tracker is not None:
            tracker.summary(summary)
            tracker.finish()
        log.info(
            "trained %d steps in %.0f s (%.0f tokens/s; target %.0f tokens/s) on %d process(es); drafter at %s",
            result.steps, result.seconds, result.tokens_per_second, result.target_tokens_per_second, layout.world, out_dir / "drafter",
        )
    distributed.shutdown(layout)
    return result
