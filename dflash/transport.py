"""The split topology's transport: target ranks send the rows of hidden states they compute, point to point,
to the drafter ranks that train on them.

Within a global batch, position ``j`` is computed by target rank ``j % T`` and
trained by drafter rank ``j % D`` (``routes``). Each (sender, receiver) pair
exchanges one message per field of a ``TargetRow`` and step; row lengths are
known to both sides from the samples, so no shapes travel. The receives of the
next step are posted before this step trains, and target ranks run up to a few
steps ahead, so transfers overlap training.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dflash.batch import Schedule, TargetRow
from dflash.distributed import Layout
from dflash.features import OnlineFeatures


def routes(count: int, senders: int, receivers: int) -> dict[tuple[int, int], list[int]]:
    """Positions in a global batch of ``count`` samples that sender ``t`` computes for receiver ``d``, in order.

    Sender ``t`` computes positions ``j % senders == t``; receiver ``d`` trains on
    ``j % receivers == d``. Every position travels exactly once.
    """
    found: dict[tuple[int, int], list[int]] = {}
    for j in range(count):
        found.setdefault((j % senders, j % receivers), []).append(j)
    return found


def send_rows(rows: list[torch.Tensor], dst: int) -> tuple[dist.Work, torch.Tensor]:
    """Send rows of one width as one message; returns the request and the packed tensor, which must live until it completes."""
    packed = torch.cat(rows).contiguous()
    return dist.isend(packed, dst), packed


@dataclass
class Incoming:
    """Rows being received as one message. Their lengths are known to both sides (from the
    samples), so shapes that vary per batch need no message of their own."""

    request: dist.Work
    buffer: torch.Tensor
    lengths: list[int]

    @classmethod
    def post(cls, lengths: list[int], width: int, dtype: torch.dtype, device: torch.device, src: int) -> Incoming:
        buffer = torch.empty(sum(lengths), width, dtype=dtype, device=device)
        return cls(dist.irecv(buffer, src), buffer, lengths)

    def wait(self) -> list[torch.Tensor]:
        self.request.wait()
        return list(self.buffer.split(self.lengths))


class ReceivedFeatures:
    """Split, drafter side: the target's rows of this rank's share, sent by the target ranks (one message per
    field and route).

    The receives of the next step are posted before this step trains, so the
    transfer overlaps training.
    """

    def __init__(self, layout: Layout, schedule: Schedule, lengths: list[int], width: int, dtype: torch.dtype, top_k: int = 0):
        self.layout, self.schedule, self.lengths = layout, schedule, lengths
        self.fields = _messages(width, dtype, top_k)
        self.pending: dict[int, list[tuple[list[int], dict[str, Incoming]]]] = {}

    def _post(self, step: int) -> None:
        batch, layout = self.schedule.batch(step), self.layout
        self.pending[step] = []
        for (t, d), positions in routes(len(batch), len(layout.target_ranks), layout.drafter_world).items():
            if d == layout.rank:
                lengths, src = [self.lengths[batch[j]] for j in positions], layout.target_ranks[t]
                incoming = {field: Incoming.post(lengths, width, dtype, layout.device, src) for field, (dtype, width) in self.fields.items()}
                self.pending[step].append((positions, incoming))

    def __call__(self, step: int, indices: list[int]) -> list[TargetRow]:
        if step not in self.pending:
            self._post(step)
        if step + 1 < self.schedule.total:
            self._post(step + 1)
        received = {}
        for positions, incoming in self.pending.pop(step):
            fields = {field: message.wait() for field, message in incoming.items()}
            for n, j in enumerate(positions):
                row = {field: rows[n] for field, rows in fields.items()}
                row["greedy"] = row["greedy"].squeeze(1)
                received[j] = TargetRow(**row)
        return [received[j] for j in sorted(received)]  # position order is share order


def _messages(width: int, dtype: torch.dtype, top_k: int) -> dict[str, tuple[torch.dtype, int]]:
    """The fields of a ``TargetRow`` as sent between ranks, in order: dtype and width of one token's entry."""
    fields = {"features": (dtype, width), "greedy": (torch.long, 1)}
    if top_k:
        fields |= {"top_ids": (torch.long, top_k), "top_probs": (torch.float32, top_k)}
    return fields


def serve_features(layout: Layout, features: OnlineFeatures, schedule: Schedule, first: int, depth: int = 2) -> None:
    """Split, target side: compute this rank's positions of every global batch and send each to the
    drafter rank that trains on it. Up to ``depth`` steps are in flight, so the target runs ahead of training."""
    senders = layout.target_ranks
    me = senders.index(layout.rank)
    fields = _messages(len(features.layer_ids) * features.target.hidden_size, features.target.dtype, features.top_k)
    in_flight: deque[list] = deque()
    for step in tqdm(range(first, schedule.total), desc=f"serving hidden states (rank {layout.rank})", unit="step", disable=me != 0):
        batch = schedule.batch(step)
        mine = list(range(me, len(batch), len(senders)))
        computed = dict(zip(mine, features.rows([batch[j] for j in mine]))) if mine else {}
        sends = []
        for (t, d), positions in routes(len(batch), len(senders), layout.drafter_world).items():
            if t == me:
                for field, (dtype, _) in fields.items():
                    values = [getattr(computed[j], field).to(dtype) for j in positions]
                    sends.append(send_rows([v[:, None] if v.dim() == 1 else v for v in values], dst=d))
        in_flight.append(sends)
        while len(in_flight) > depth:
            for request, _ in in_flight.popleft():
                request.wait()
    for sends in in_flight:
        for request, _ in sends:
            request.wait()
