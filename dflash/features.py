"""Where the drafter's training inputs from the target come from: its hidden states and greedy tokens.

One teacher-forced forward pass over a sample gives both (``TargetRow``). Three
sources, any topology: a disk cache computed once before training
(``train.hidden_states: cache``), the target on the drafter's own rank
(``online``, colocated), or target ranks computing them and sending them to the
drafter ranks (``online``, split: ``dflash.transport``). Each is a callable
``(step, indices) -> rows``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from dflash import distributed
from dflash.batch import TargetRow, pad_rows
from dflash.distributed import Layout, all_reduce_sum
from dflash.errors import InputError
from dflash.io import atomic_path, atomic_write_text
from dflash.target import Target

FP16_MAX = float(np.finfo(np.float16).max)

log = logging.getLogger(__name__)


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


def total_rate(meter: Meter, layout: Layout) -> float:
    """The target's tokens per second over every rank that runs it (every rank takes part)."""
    rate = all_reduce_sum(torch.tensor([meter.rate()], dtype=torch.float64, device=layout.device), layout, everyone=True)
    return float(rate[0])


def target_features(target: Target, rows: list[list[int]], layer_ids: list[int], meter: Meter, top_k: int = 0, token_budget: int = 8192) -> list[TargetRow]:
    """The target's pass over each row of token ids, on the target's device (with its top-``top_k`` next tokens if asked)."""
    start = time.perf_counter()
    out: list[TargetRow] = [None] * len(rows)  # type: ignore[list-item]
    for group in length_groups([len(r) for r in rows], token_budget):
        ids, mask = pad_rows([rows[i] for i in group], pad_value=0)
        result = target.features(ids.to(target.device), mask.to(target.device), layer_ids, top_k)
        for r, i in enumerate(group):
            n = len(rows[i])
            top = (result.top_ids[r, :n], result.top_probs[r, :n]) if top_k else (None, None)
            out[i] = TargetRow(result.features[r, :n], result.greedy[r, :n], *top)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)  # time the computation, not its launch
    meter.tokens += sum(len(r) for r in rows)
    meter.seconds += time.perf_counter() - start
    return out


def row_fields(width: int, top_k: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The fields of a ``TargetRow`` as stored on disk: dtype and the shape of one token's entry."""
    fields = {"features": (np.float16, (width,)), "greedy": (np.int32, ())}
    if top_k:
        fields |= {"top_ids": (np.int32, (top_k,)), "top_probs": (np.float16, (top_k,))}
    return fields


def reserve(path: Path) -> None:
    """Allocate every block of a memory-mapped file now. Its pages are written later through the map, and a page the
    disk cannot hold then raises SIGBUS and kills the process; allocated up front, a full disk is an error here."""
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise InputError(f"no space left for {path}: free disk space, or set train.hidden_states: online") from err
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem that cannot allocate ahead: the free-space check stands
                raise


def check_fp16_range(features: torch.Tensor) -> None:
    """The cache stores features in fp16, whose largest finite value is 65504; a target whose hidden states exceed it
    (massive activations grow with model size) would be stored as infinities."""
    largest = float(features.abs().max()) if features.numel() else 0.0
    if not largest <= FP16_MAX:
        raise InputError(
            f"the target's hidden states reach {largest:.4g}, beyond fp16's range ({FP16_MAX:g}) in which the hidden-state cache stores them: "
            "set train.hidden_states: online (the drafter then reads them as the target computes them)"
        )


class HiddenStateCache:
    """The target's pass over every sample, computed once and memory-mapped from disk, one entry per token:
    features in fp16, greedy tokens in int32 (and the top-k next tokens, for distillation).

    Every rank of the run writes its own shard files, so a cache is built in
    parallel with no two processes writing one file (safe on any shared filesystem).
    """

    FORMAT = 3  # 2: features only

    def __init__(self, directory: Path):
        meta = json.loads((directory / "meta.json").read_text())
        self.key = meta["key"]
        self.location = np.asarray(meta["location"], dtype=np.int64)  # per sample: shard, first row, end row
        self.shards = [{field: np.load(directory / f"{field}-{shard:03d}.npy", mmap_mode="r") for field in meta["fields"]} for shard in range(meta["shards"])]

    def __getitem__(self, index: int) -> TargetRow:
        shard, begin, end = self.location[index]
        stored = {field: torch.from_numpy(np.asarray(array[begin:end])) for field, array in self.shards[shard].items()}
        stored["features"] = stored["features"].float()
        stored["greedy"] = stored["greedy"].long()
        if "top_ids" in stored:
            stored["top_ids"], stored["top_probs"] = stored["top_ids"].long(), stored["top_probs"].float()
        return TargetRow(**stored)

    @classmethod
    def _holds(cls, meta_path: Path, key: str) -> bool:
        if not meta_path.is_file():
            return False
        meta = json.loads(meta_path.read_text())
        return meta.get("format") == cls.FORMAT and meta.get("key") == key

    @staticmethod
    def cache_key(samples: pd.DataFrame, target: Target | str, layer_ids: list[int], top_k: int = 0) -> str:
        """A digest of what the cache holds: the samples' tokens, the target (source and dtype), the layers and top-k."""
        described = [target, None] if isinstance(target, str) else [target.source, str(target.dtype)]
        digest = hashlib.sha256(json.dumps([*described, list(layer_ids), top_k]).encode())
        for ids in samples["input_ids"]:
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]

    @classmethod
    def build(cls, directory: Path, features: OnlineFeatures, layout: Layout | None = None, token_budget: int = 8192) -> HiddenStateCache:
        """Compute (or reuse) the cache of what ``features`` computes over all its samples; every rank calls this, and
        each holding the target's layers computes one shard.

        Shards and ``meta.json`` are written atomically, ``meta.json`` last: a
        crash, even kill -9, leaves no cache that would load.
        """
        target, samples, layer_ids, top_k = features.target, features.samples, features.layer_ids, features.top_k
        layout = layout or distributed.single_process(target.device)
        key = cls.cache_key(samples, target, layer_ids, top_k)
        meta_path = directory / "meta.json"
        if distributed.broadcast_from_main(layout.is_main and cls._holds(meta_path, key), layout):
            log.info("hidden-state cache hit: %s", directory)
            return cls(directory)
        if layout.is_main:
            # Invalidate the old cache before any of its shards is overwritten.
            directory.mkdir(parents=True, exist_ok=True)
            meta_path.unlink(missing_ok=True)
            for old in directory.glob("*-[0-9][0-9][0-9].npy"):
                old.unlink()
        distributed.barrier(layout)
        lengths = [len(ids) for ids in samples["input_ids"]]
        # The ranks holding the target's layers write one shard each: every n-th sample by length, so that shards cost about the same.
        holders = layout.layer_holders
        by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
        shards = [by_length[r :: len(holders)] for r in range(min(len(holders), len(lengths)))]
        fields = row_fields(len(layer_ids) * target.hidden_size, top_k)
        if layout.rank in holders[: len(shards)]:
            shard = holders.index(layout.rank)
            cls._write_shard(directory, shard, shards[shard], fields, features, token_budget)
        distributed.barrier(layout)  # every shard is in place
        if layout.is_main:
            location = np.zeros((len(lengths), 3), dtype=np.int64)
            for shard, members in enumerate(shards):
                begin = 0
                for i in members:
                    location[i] = (shard, begin, begin + lengths[i])
                    begin += lengths[i]
            meta = {
                "format": cls.FORMAT,
                "key": key,
                "layer_ids": list(layer_ids),
                "fields": list(fields),
                "shards": len(shards),
                "location": location.tolist(),
            }
            atomic_write_text(meta_path, json.dumps(meta))
        distributed.barrier(layout)
        return cls(directory)

    @staticmethod
    def _write_shard(directory: Path, shard: int, members: list[int], fields: dict, features: OnlineFeatures, token_budget: int) -> None:
        lengths = [len(ids) for ids in features.samples["input_ids"]]
        ends = np.cumsum([lengths[i] for i in members])
        row_of = {i: int(end) - lengths[i] for i, end in zip(members, ends)}
        tokens = int(ends[-1])
        needed = tokens * sum(np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)) for dtype, shape in fields.values())
        free = shutil.disk_usage(directory).free
        if needed > free:
            raise InputError(
                f"the hidden-state cache's shard {shard} needs {needed / 1e9:.2f} GB under {directory}, where {free / 1e9:.2f} GB are free: "
                "free disk space, or set train.hidden_states: online (the target computes them at every step instead)"
            )
        with ExitStack() as stack:
            paths = {field: stack.enter_context(atomic_path(directory / f"{field}-{shard:03d}.npy")) for field in fields}
            stores = {
                field: np.lib.format.open_memmap(paths[field], mode="w+", dtype=dtype, shape=(tokens, *shape)) for field, (dtype, shape) in fields.items()
            }
            for path in paths.values():
                reserve(path)
            bar = tqdm(total=tokens, desc=f"caching target hidden states (shard {shard})", unit="tok", unit_scale=True, disable=shard != 0)
            with bar:
                for group in length_groups([lengths[i] for i in members], token_budget):
                    indices = [members[g] for g in group]
                    rows = features.rows(indices, token_budget)
                    for i, row in zip(indices, rows):
                        check_fp16_range(row.features)
                        for field, store in stores.items():
                            store[row_of[i] : row_of[i] + lengths[i]] = getattr(row, field).float().cpu().numpy()
                    bar.update(sum(lengths[i] for i in indices))
            for store in stores.values():
                store.flush()
            del stores


class CachedFeatures:
    """The target's rows read from the disk cache."""

    def __init__(self, store: HiddenStateCache):
        self.store = store

    def __call__(self, step: int, indices: list[int]) -> list[TargetRow]:
        return [self.store[i] for i in indices]


class OnlineFeatures:
    """The target on this rank computing the rows of samples: what a colocated rank trains on, what the cache stores,
    what a split target rank sends."""

    def __init__(self, target: Target, samples: pd.DataFrame, layer_ids: list[int], meter: Meter | None = None, top_k: int = 0):
        self.target, self.samples, self.layer_ids, self.meter, self.top_k = target, samples, layer_ids, meter or Meter(), top_k

    def rows(self, indices: list[int], token_budget: int = 8192) -> list[TargetRow]:
        return target_features(self.target, [self.samples["input_ids"].iloc[i] for i in indices], self.layer_ids, self.meter, self.top_k, token_budget)

    def __call__(self, step: int, indices: list[int]) -> list[TargetRow]:
        return self.rows(indices)
