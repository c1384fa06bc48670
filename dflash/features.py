"""Where the drafter's context features (the target's hidden states) come from during training.

Three sources, any topology: a disk cache computed once before training
(``train.hidden_states: cache``), the target on the drafter's own rank
(``online``, colocated), or target ranks computing them and sending them to the
drafter ranks (``online``, split). Each is a callable ``(step, indices) -> rows``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from dflash import distributed
from dflash.batch import Schedule, pad_rows
from dflash.distributed import Incoming, Layout, all_reduce_sum, routes, send_rows
from dflash.io import atomic_path, atomic_write_text
from dflash.target import Target

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
    ) -> HiddenStateCache:
        """Compute (or reuse) the cache; every rank calls this and computes one shard (one process: all of it).

        Shards and ``meta.json`` are written atomically, ``meta.json`` last: a
        crash, even kill -9, leaves no cache that would load.
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
            cls._write_shard(directory, layout.rank, shards[layout.rank], lengths, target, samples, layer_ids, meter, token_budget)
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
            atomic_write_text(meta_path, json.dumps(meta))
        distributed.barrier(layout)
        return cls(directory)

    @staticmethod
    def _write_shard(directory, shard, members, lengths, target, samples, layer_ids, meter, token_budget) -> None:
        ends = np.cumsum([lengths[i] for i in members])
        row_of = {i: int(end) - lengths[i] for i, end in zip(members, ends)}
        with atomic_path(directory / f"features-{shard:03d}.npy") as staging:
            shape = (int(ends[-1]), len(layer_ids) * target.hidden_size)
            store = np.lib.format.open_memmap(staging, mode="w+", dtype=np.float16, shape=shape)
            bar = tqdm(total=int(ends[-1]), desc=f"caching target hidden states (shard {shard})", unit="tok", unit_scale=True, disable=shard != 0)
            with bar:
                for group in length_groups([lengths[i] for i in members], token_budget):
                    indices = [members[g] for g in group]
                    rows = target_features(target, [samples["input_ids"].iloc[i] for i in indices], layer_ids, meter)
                    for i, feats in zip(indices, rows):
                        store[row_of[i] : row_of[i] + lengths[i]] = feats.float().cpu().numpy()
                    bar.update(sum(lengths[i] for i in indices))
            store.flush()
            del store


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
            [
                send_rows([computed[j] for j in positions], dst=d)
                for (t, d), positions in routes(len(batch), len(senders), layout.drafter_world).items()
                if t == me
            ]
        )
        while len(in_flight) > depth:
            for request, _ in in_flight.popleft():
                request.wait()
    for sends in in_flight:
        for request, _ in sends:
            request.wait()
