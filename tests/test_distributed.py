"""Distributed training on the CPU: torchrun, gloo, a tiny random target, a few steps.

Each multi-process run is compared with one process training on the same data
(``tests/distributed_worker.py`` records what every drafter rank trained on).
Tolerance: losses and final weights agree with the one-process run to 1e-5
(relative for losses, absolute for weights); the only differences are float
summation orders (gradients summed over ranks, batches padded per rank).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import distributed_worker
import pandas as pd
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dflash.batch import Schedule
from dflash.checkpoint import complete_checkpoints
from dflash.distributed import Layout, Peer, lost_rank, naming_lost_ranks
from dflash.errors import LostRankError
from dflash.transport import routes

pytestmark = pytest.mark.slow

WORKER = Path(distributed_worker.__file__)
# 12 samples in batches of 5: the last batch of each epoch (2 samples) is smaller than
# the 3 drafter ranks of the split run, and than the 5 target ranks.
LENGTHS = [20, 27, 34, 41, 48, 25, 32, 39, 46, 23, 30, 37]
DRAFTER = {"num_hidden_layers": 1, "num_context_features": 2, "block_size": 4, "mask_token_id": distributed_worker.MASK}
# fp32: the runs are compared to 1e-5, which bf16 autocast (the default where the CPU has bf16) would not meet.
TRAIN = {"epochs": 2, "batch_size": 5, "max_anchors": 4, "compile": False, "checkpoint_every": 2, "log_every": 1, "precision": "fp32"}
SCHEDULE = Schedule(len(LENGTHS), TRAIN["batch_size"], seed=0, total=6)
LOSS_RTOL = WEIGHT_ATOL = 1e-5


def spec(out: Path, topology: dict, hidden_states: str, **extra) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    return {"out": str(out), "topology": topology, "lengths": LENGTHS, "drafter": DRAFTER, "train": TRAIN | {"hidden_states": hidden_states}, **extra}


def torchrun(nproc: int, run_spec: dict, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(WORKER), "--spec", json.dumps(run_spec)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def ranks(out: Path, count: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(count)]


def losses(out: Path) -> list[float]:
    return pd.read_csv(out / "metrics.csv")["loss"].tolist()


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "drafter" / "model.safetensors"))


def assert_same_training(out: Path, reference: Path) -> None:
    """The loss curve and the final drafter of a run match the one-process run's."""
    assert losses(out) == pytest.approx(losses(reference), rel=LOSS_RTOL)
    expected = weights(reference)
    for name, tensor in weights(out).items():
        torch.testing.assert_close(tensor, expected[name], atol=WEIGHT_ATOL, rtol=0, msg=name)


def assert_every_sample_once_per_epoch(records: list[dict]) -> None:
    for step in range(SCHEDULE.total):
        trained = sorted(i for record in records for i in record["steps"][step]["indices"])
        assert trained == sorted(SCHEDULE.batch(step)), f"step {step}"
    for epoch in range(SCHEDULE.total // SCHEDULE.steps_per_epoch):
        steps = range(epoch * SCHEDULE.steps_per_epoch, (epoch + 1) * SCHEDULE.steps_per_epoch)
        assert sorted(i for record in records for s in steps for i in record["steps"][s]["indices"]) == list(range(len(LENGTHS)))


def assert_replicas_identical(records: list[dict]) -> None:
    """The drafter ranks' full weights are bit-identical after every step they ran."""
    for step, on_ranks in enumerate(zip(*(record["steps"] for record in records))):
        assert len({record["weights"] for record in on_ranks}) == 1, f"drafter replicas differ after step {step} of the run"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, colocated: the reference, with hidden states online and from the cache."""
    runs = {}
    for source in ("online", "cache"):
        out = tmp_path_factory.mktemp(f"one-{source}")
        distributed_worker.run(spec(out, {}, source))
        runs[source] = out
    return runs


@pytest.fixture(scope="module")
def colocated_2(tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated-2")
    torchrun(2, spec(out, {"kind": "colocated", "nproc_per_node": 2}, "cache"))
    return out


def test_routes_send_every_position_once_to_the_rank_that_trains_it():
    for count in range(1, 12):
        sent = routes(count, senders=5, receivers=3)
        assert sorted(j for positions in sent.values() for j in positions) == list(range(count))
        assert all(j % 5 == t and j % 3 == d for (t, d), positions in sent.items() for j in positions)


def test_split_5_plus_3_on_8_processes_matches_one_process(tmp_path, one_process):
    """5 target ranks send hidden states to 3 drafter ranks, which train data-parallel."""
    out = tmp_path / "split"
    torchrun(8, spec(out, {"kind": "split", "nproc_per_node": 8, "target_ranks": 5}, "online"))
    records = ranks(out, 3)
    assert not (out / "rank3.json").exists()  # ranks 3..7 computed hidden states only
    assert_every_sample_once_per_epoch(records)
    assert any(record["steps"][2]["indices"] == [] for record in records)  # an idle drafter rank at the epoch's end
    # What each drafter rank trained on is the target's own hidden states of those samples, bit for bit.
    assert all(step["feature_error"] == 0.0 for record in records for step in record["steps"])
    assert_replicas_identical(records)
    assert_same_training(out, one_process["online"])
    assert records[0]["target_tokens_per_second"] > 0


def test_colocated_on_2_processes_matches_one_process(colocated_2, one_process):
    """Both ranks hold the target: the cache is built in two shards, the drafter trains on both."""
    assert sorted(p.name for p in (colocated_2 / "cache" / "hidden-states").glob("features-*.npy")) == ["features-000.npy", "features-001.npy"]
    records = ranks(colocated_2, 2)
    assert_every_sample_once_per_epoch(records)
    assert all(step["feature_error"] < 1e-3 for record in records for step in record["steps"])  # fp16 cache
    assert_replicas_identical(records)
    assert_same_training(colocated_2, one_process["cache"])


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_colocated_2_processes_resume_after_a_crash(tmp_path, colocated_2, one_process, data_parallel):
    """Both ranks die between steps 3 and 4 (after the step-2 checkpoint); the rerun resumes from it.
    With DDP it ends with the uninterrupted run's weights and metrics, bit for bit; with FSDP (the
    drafter's parameters and optimizer state sharded over the two ranks) it matches one process."""
    out = tmp_path / "crashed"
    topology = {"kind": "colocated", "nproc_per_node": 2, "data_parallel": data_parallel}
    crashed = torchrun(2, spec(out, topology, "cache", crash_at=3), check=False)
    assert crashed.returncode != 0
    assert [p.name for p in complete_checkpoints(out / "cache" / "checkpoints")] == ["step-00000002"]
    assert not (out / "drafter").exists()
    torchrun(2, spec(out, topology, "cache"))
    records = ranks(out, 2)
    assert [record["resumed_from"] for record in records] == [2, 2]
    assert_replicas_identical(records)
    if data_parallel == "fsdp":
        assert_same_training(out, one_process["cache"])
        return
    expected = weights(colocated_2)
    for name, tensor in weights(out).items():
        assert torch.equal(tensor, expected[name]), name
    resumed, uninterrupted = pd.read_csv(out / "metrics.csv"), pd.read_csv(colocated_2 / "metrics.csv")
    pd.testing.assert_frame_equal(resumed.drop(columns="tokens_per_s"), uninterrupted.drop(columns="tokens_per_s"))


def test_a_rank_that_hangs_is_named_once_the_collective_times_out(tmp_path):
    """Rank 1 stops answering before its step 3 (alive, asleep); rank 0 waits in the step's gradient all-reduce for
    topology.collective_timeout_s, hears within the check-in time that no other rank timed out, and ends with one error
    of ours naming rank 1 and its host. The step-2 checkpoint is whole, and the rerun resumes from it."""
    out = tmp_path / "hung"
    topology = {"kind": "colocated", "nproc_per_node": 2, "collective_timeout_s": 10}
    hung = torchrun(2, spec(out, topology, "cache", hang_at=3, hang_rank=1), check=False)
    assert hung.returncode != 0
    said = re.findall(r"^\[rank0\]: dflash\.errors\.LostRankError: (.*)$", hung.stderr, re.MULTILINE)
    assert len(said) == 1 and re.match(r"rank 0 on \S+ heard nothing from rank 1 on \S+ \(\S+\) for 10 s during training ", said[0]), hung.stderr[-4000:]
    assert [p.name for p in complete_checkpoints(out / "cache" / "checkpoints")] == ["step-00000002"]
    torchrun(2, spec(out, topology, "cache"))
    assert [record["resumed_from"] for record in ranks(out, 2)] == [2, 2]


def test_a_timeout_names_the_ranks_that_did_not_say_theirs_timed_out_too():
    """Through the store (an in-process one here): rank 0 timed out, rank 2 said so too, rank 1 is silent."""
    store = dist.HashStore()
    three = tuple(Peer(r, f"n{r}", f"10.200.7.{11 + r}") for r in range(3))
    on_n0 = Layout(device=torch.device("cpu"), rank=0, world=3, drafter_world=3, peers=three, timeout_s=10, store=store)
    store.set("timed-out/2", "n2")
    timed_out = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete")
    with pytest.raises(LostRankError, match=r"^rank 0 on \S+ heard nothing from rank 1 on n1 \(10.200.7.12\) for 10 s during training "):
        with naming_lost_ranks(on_n0, "training"):
            raise timed_out
    assert store.get("timed-out/0")  # and it said so itself, for the others
    # Every rank timed out: they wait for each other in different collectives, a bug, which keeps torch's error.
    store.set("timed-out/1", "n1")
    with pytest.raises(RuntimeError, match="Timed out waiting") as raised:
        with naming_lost_ranks(on_n0, "training"):
            raise timed_out
    assert not isinstance(raised.value, LostRankError)


TWO_NODES = (Peer(0, "dflash-n1", "10.200.7.11"), Peer(1, "dflash-n2", "10.200.7.12"))
GLOO_CLOSED = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.200.7.12]:31969"


def test_a_lost_connection_names_the_rank_and_host_behind_the_address():
    on_n1 = Layout(device=torch.device("cpu"), rank=0, world=2, drafter_world=2, peers=TWO_NODES)
    assert lost_rank(RuntimeError(GLOO_CLOSED), on_n1) == "rank 1 on dflash-n2 (10.200.7.12)"
    reset = "[../gloo/transport/tcp/pair.cc:598] Read error [10.200.7.12]:40712: Connection reset by peer"
    assert lost_rank(RuntimeError(reset), on_n1) == "rank 1 on dflash-n2 (10.200.7.12)"
    # Several ranks behind one address (one host): all are named but this one.
    one_host = Layout(device=torch.device("cpu"), rank=0, world=3, drafter_world=3, peers=tuple(Peer(r, "n1", "127.0.0.1") for r in range(3)))
    assert lost_rank(RuntimeError(GLOO_CLOSED.replace("10.200.7.12", "127.0.0.1")), one_host) == "one of ranks 1, 2 on n1 (127.0.0.1)"
    # Not a lost connection, or no roster (one process): left alone.
    assert lost_rank(RuntimeError("CUDA out of memory"), on_n1) is None
    assert lost_rank(RuntimeError(GLOO_CLOSED), Layout(device=torch.device("cpu"))) is None


def test_naming_lost_ranks_turns_only_a_lost_connection_into_an_error_of_ours():
    on_n1 = Layout(device=torch.device("cpu"), rank=0, world=2, drafter_world=2, peers=TWO_NODES)
    with pytest.raises(LostRankError, match=r"lost rank 1 on dflash-n2 \(10.200.7.12\) during training \(closed by peer\): ") as raised:
        with naming_lost_ranks(on_n1, "training"):
            raise RuntimeError(GLOO_CLOSED)
    assert isinstance(raised.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="out of memory"):
        with naming_lost_ranks(on_n1, "training"):
            raise RuntimeError("out of memory")
