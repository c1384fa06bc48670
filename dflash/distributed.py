"""Parallelism for training: one process per device, started by torchrun, on torch.distributed.

Two topologies (``topology.kind``):

* ``colocated``: every rank holds the target and the drafter. Each rank computes
  the target's hidden states of its own share of the global batch; the drafter
  trains data-parallel (DDP, or FSDP) over all ranks.
* ``split``: ``topology.target_ranks`` ranks compute hidden states and send them,
  point to point, to the other ranks, which train the drafter data-parallel
  (they hold only the target's frozen embedding and LM head, not its layers).

With hidden states cached on disk (any topology), every rank holding the
target's layers computes a shard of the cache before training; split target
ranks then have nothing left to do.

Ranks ``0..D-1`` train the drafter, the rest (split only) compute hidden
states: global rank 0, which logs and writes checkpoints, always trains. Within
a global batch, position ``j`` is trained by drafter rank ``j % D`` (the strided
``rank_slice``) and, in the split topology, computed by target rank ``j % T``.

NCCL on GPU, gloo on CPU. With one process nothing here starts a process group.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dflash.config import TopologyConfig
from dflash.errors import LostRankError, PreflightError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    """Where one rank runs: its host name and the address its peers reach it at."""

    rank: int
    host: str
    address: str


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the topology: its rank, its device and its role."""

    device: torch.device
    kind: Literal["colocated", "split"] = "colocated"
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    drafter_world: int = 1  # D: ranks 0..D-1 train the drafter
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    group: Any = field(default=None, compare=False)  # the drafter ranks' process group; None with one process
    peers: tuple[Peer, ...] = field(default=(), compare=False)  # every rank's place, by rank; empty with one process
    timeout_s: float = 0.0  # how long a collective waits for the peers before it fails (topology.collective_timeout_s)
    store: Any = field(default=None, compare=False)  # the rendezvous store, a channel besides the process group; None with one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_drafter(self) -> bool:
        return self.rank < self.drafter_world

    @property
    def target_ranks(self) -> list[int]:
        """Split: the ranks after the drafter ranks, which compute hidden states and send them (none when colocated)."""
        return list(range(self.drafter_world, self.world))

    @property
    def layer_holders(self) -> list[int]:
        """The ranks that hold the target's decoder layers and compute its hidden states: every rank when colocated,
        the target ranks when split (whose drafter ranks hold only the embedding and the LM head)."""
        return list(range(self.world)) if self.kind == "colocated" else self.target_ranks


def single_process(device: torch.device | str = "cpu") -> Layout:
    return Layout(device=torch.device(device))


def init(topology: TopologyConfig) -> Layout:
    """Join the process group torchrun set up (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and create the drafter ranks' group."""
    world = topology.world
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world:
        raise PreflightError(
            f"the topology has {world} processes (nnodes {topology.nnodes} x nproc_per_node {topology.nproc_per_node}) but {launched} were "
            f"launched: start training with `torchrun --nnodes {topology.nnodes} --nproc-per-node {topology.nproc_per_node} -m dflash train ...` "
            "(the train rule's launcher resource does), or fix topology in the config"
        )
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if topology.device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise PreflightError(
                f"local rank {local_rank} needs CUDA device {local_rank} but {torch.cuda.device_count()} are visible: "
                f"set topology.nproc_per_node to at most {torch.cuda.device_count()}, or check CUDA_VISIBLE_DEVICES"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    drafter_world = topology.drafter_world
    group, store, peers = None, None, []
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=topology.collective_timeout_s)
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        drafters = dist.new_group(list(range(drafter_world)), timeout=timeout)  # every rank takes part in creating it
        group = drafters if rank < drafter_world else None
        # Every rank says where it runs: on several nodes, which host holds which role is the first thing to check.
        role = "drafter" if rank < drafter_world else "target"
        log.info("rank %d of %d (%s, local rank %d) on host %s", rank, world, role, local_rank, socket.gethostname())
        # Every rank's place, so that a lost peer, which torch names by its address only, can be named by rank and host.
        peers = [None] * world
        dist.all_gather_object(peers, Peer(rank, socket.gethostname(), own_address()))
        store = rendezvous_store(check_in_seconds(topology.collective_timeout_s))
    return Layout(
        device=device,
        kind=topology.kind,
        rank=rank,
        world=world,
        local_rank=local_rank,
        drafter_world=drafter_world,
        data_parallel=topology.data_parallel,
        group=group,
        peers=tuple(peers),
        timeout_s=topology.collective_timeout_s,
        store=store,
    )


def rendezvous_store(timeout_s: float) -> dist.Store:
    """A client of the store torchrun's rendezvous serves (``MASTER_ADDR:MASTER_PORT``, on the rendezvous host): where
    ranks whose collective timed out say so, since the process group's own connections are closed by the timeout.
    Its keys are this launch's (a restarted worker group starts afresh)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"dflash/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def check_in_seconds(timeout_s: float) -> float:
    """How long a rank whose collective timed out waits for the others to say theirs did too: a tenth of the timeout,
    from 5 s to a minute. Ranks waiting in the same collective entered it within about a step of each other, which the
    timeout exceeds many times over."""
    return min(60.0, max(5.0, timeout_s / 10))


def own_address() -> str:
    """This host's address as its host name resolves (gloo binds to it unless GLOO_SOCKET_IFNAME says otherwise)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


# How gloo and NCCL say that the connection to a peer broke: the peer's address in brackets, then its port.
_LOST_CONNECTION = re.compile(r"(closed by peer|reset by peer|Connection refused|Broken pipe|Socket closed|remote process exited)", re.IGNORECASE)
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")


# How gloo says a collective or a receive waited longer than the process group's timeout (the first error), and what
# any later operation on the connection the timeout closed says. Neither names a peer.
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms|Application timeout caused pair closure")


def lost_rank(error: BaseException, layout: Layout) -> str | None:
    """Who a collective's error says was lost, by rank and host (torch names only an address), or None where the
    error is not a lost connection. Ranks sharing the address are named together, this one excepted."""
    text = str(error)
    found = _PEER_ADDRESS.search(text)
    if not layout.peers or found is None or not _LOST_CONNECTION.search(text):
        return None
    address = found.group(1)
    ranks = [peer for peer in layout.peers if peer.address == address and peer.rank != layout.rank]
    if not ranks:
        return f"the rank at {address}"
    return named(ranks, alternatives=True)


def named(peers: list[Peer], alternatives: bool = False) -> str:
    """``rank 1 on n2 (10.0.0.2)``; several: ``ranks 1, 3 on n2 (10.0.0.2)``, or ``one of ranks ...`` where only one of
    them is meant."""
    ranks = ", ".join(str(peer.rank) for peer in peers)
    which = f"rank {ranks}" if len(peers) == 1 else f"one of ranks {ranks}" if alternatives else f"ranks {ranks}"
    hosts = ", ".join(sorted({peer.host for peer in peers}))
    addresses = ", ".join(sorted({peer.address for peer in peers}))
    return f"{which} on {hosts} ({addresses})"


def silent_ranks(layout: Layout) -> str | None:
    """After this rank's collective timed out: the ranks that did not say within ``check_in_seconds`` that theirs
    timed out too (a rank that hangs, is stopped, or is cut off), named; None where every rank did (they wait for each
    other in different collectives: a bug). Said through the rendezvous store, whose host may be cut off too."""
    wait = check_in_seconds(layout.timeout_s)
    try:
        layout.store.set(f"timed-out/{layout.rank}", socket.gethostname())
        deadline = time.monotonic() + wait
        waiting = [peer for peer in layout.peers if peer.rank != layout.rank]
        while waiting and time.monotonic() < deadline:
            time.sleep(0.2)
            waiting = [peer for peer in waiting if not layout.store.check([f"timed-out/{peer.rank}"])]
    except RuntimeError as error:  # the store's errors (DistStoreError) derive from RuntimeError
        return f"every peer: the rendezvous store does not answer either ({' '.join(str(error).split())[:120]}): this node or its link may be down"
    return named(waiting) if waiting else None


RESUME = "checkpoints are written whole or not at all: rerun to resume from the last complete one"


@contextmanager
def naming_lost_ranks(layout: Layout, stage: str) -> Iterator[None]:
    """A collective that fails because a peer is gone, or times out because a peer is silent, becomes a
    ``LostRankError`` naming that rank and its host."""
    try:
        yield
    except LostRankError:
        raise
    except RuntimeError as error:
        this = f"rank {layout.rank} on {socket.gethostname()}"
        who = lost_rank(error, layout)
        if who is not None:
            reason = _LOST_CONNECTION.search(str(error)).group(1)
            raise LostRankError(f"{this} lost {who} during {stage} ({reason}): its process died, or its node or link went down; {RESUME}") from error
        if layout.store is None or not _TIMED_OUT.search(str(error)):
            raise
        silent = silent_ranks(layout)
        if silent is None:
            raise
        raise LostRankError(
            f"{this} heard nothing from {silent} for {layout.timeout_s:.0f} s during {stage} (topology.collective_timeout_s): "
            f"its process hangs or is stopped, or its node or link is down; {RESUME}"
        ) from error


def join(topology: TopologyConfig) -> Layout:
    """Join however many processes torchrun started (one, without torchrun), each on the topology's kind of device:
    for a stage whose result does not depend on the number of processes, such as data regeneration."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    return init(TopologyConfig(device=topology.device, nproc_per_node=launched, collective_timeout_s=topology.collective_timeout_s))


def shutdown(layout: Layout) -> None:
    """Leave the process group; a rank leaves once it has done its last collective or send, others may still train."""
    if layout.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


# -- collectives (no-ops with one process) ---------------------------------------------------------


def all_reduce_sum(tensor: torch.Tensor, layout: Layout, everyone: bool = False) -> torch.Tensor:
    """Sum over the drafter ranks (or over every rank), in place."""
    if layout.world > 1:
        dist.all_reduce(tensor, group=None if everyone else layout.group)
    return tensor


def broadcast_from_main(value, layout: Layout):
    """Rank 0's value, on every rank (a picklable object)."""
    if layout.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_main(value, layout: Layout) -> list | None:
    """Every drafter rank's value, as a list on rank 0 (``None`` elsewhere)."""
    if layout.drafter_world == 1:
        return [value]
    gathered = [None] * layout.drafter_world if layout.is_main else None
    dist.gather_object(value, gathered, dst=0, group=layout.group)
    return gathered


def barrier(layout: Layout) -> None:
    if layout.world > 1:
        dist.barrier()


# -- data parallelism for the drafter --------------------------------------------------------------


def shard(drafter: torch.nn.Module, layout: Layout) -> None:
    """FSDP: shard the drafter's parameters, gradients and optimizer state over the drafter ranks, in place.

    Call before creating the optimizer (it must see the sharded parameters).
    """
    if layout.drafter_world > 1 and layout.data_parallel == "fsdp":
        fully_shard(drafter, mesh=DeviceMesh.from_group(layout.group, layout.device.type))


def replicate(forward: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """DDP: gradients all-reduced (averaged) over the drafter ranks after each backward.

    ``forward`` may be the compiled drafter: DDP then runs the very graphs the
    compile-cache warmup compiled (compiling DDP itself would split them at
    gradient-bucket boundaries into graphs the warmup never saw).
    """
    if layout.drafter_world == 1 or layout.data_parallel != "ddp":
        return forward
    device_ids = [layout.device] if layout.device.type == "cuda" else None
    return DistributedDataParallel(forward, device_ids=device_ids, process_group=layout.group)
