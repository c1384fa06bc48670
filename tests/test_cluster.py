"""Training on a real SLURM cluster: two nodes on this machine, one job, the launcher as a GPU site runs it.

``tests/cluster/cluster.sh`` starts SLURM here: slurmctld, and two compute nodes, each a slurmd in a network namespace
of its own with its own address and host name, sharing the filesystem as cluster nodes share NFS. The train job is
submitted with ``sbatch`` from the controller's namespace, asking SLURM for what the repository's SLURM profile asks
(with the cluster's site values, ``tests/cluster/profile``); inside it, Snakemake runs the train rule's own command on
the job's first node through the executor's own job step (``--executor slurm-jobstep``, which removes every
``SLURM_*`` variable but the job's id): the ``launcher`` (``dflash.launch``) starts one torchrun per node with srun,
meeting at a c10d rendezvous at the first node's address, gloo between the nodes.

Each drafter trained on the cluster is compared with one process training on the same data and config, to the
tolerance of tests/test_distributed.py. Needs root, network namespaces, and SLURM (installed from Debian's packages by
the script): ``pytest -m slurm``. Without them the tests skip, saying why; with DFLASH_REQUIRE_SLURM=1 (as .ci/run
sets) they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_workflow import ROOT, SNAKEMAKE, TEST_CONFIG, _planned_resources, make_workdir, readable, run_snakemake, snakemake_env
from tiny_chat_target import build_tiny_inputs

from dflash.checkpoint import STEP_PREFIX, complete_checkpoints
from dflash.config import canonical_json, load_config, to_dict

pytestmark = pytest.mark.slurm

CLUSTER = ROOT / "tests" / "cluster" / "cluster.sh"
SITE_PROFILE = ROOT / "tests" / "cluster" / "profile"
OVERLAY = "config/slurm-cpu-2x1.yaml"
CONFIGS = ["--configfile", "config/config.yaml", OVERLAY]
NODES = ("dflash-n1", "dflash-n2")
WEIGHT_ATOL = 1e-5  # as tests/test_distributed.py: only float summation orders differ
# Long enough to cancel after a checkpoint and before the end; checkpoints often enough that the rerun resumes.
LONG_TRAIN = {"epochs": 150, "checkpoint_every": 25, "validate_every": 100, "log_every": 10}


def _missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the cluster needs root (network namespaces, slurmd)"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) for network namespaces"
    probe = f"dflash-probe-{uuid.uuid4().hex[:6]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` fails here: no network namespaces"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "no SLURM, and no apt-get to install it from Debian's packages"
    return None


def require_cluster() -> None:
    reason = _missing()
    if reason is not None:
        if os.environ.get("DFLASH_REQUIRE_SLURM") == "1":
            pytest.fail(f"DFLASH_REQUIRE_SLURM=1 but {reason}")
        print(f"skipping the SLURM tests: {reason}")
        pytest.skip(reason)


def cluster_sh(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def root_network() -> dict[str, object]:
    """The machine's own network, as the root namespace shows it: links, addresses, routes (no counters)."""
    shown = {}
    for what in ("link", "addr", "route"):
        shown[what] = json.loads(subprocess.run(["ip", "-j", what, "show"], capture_output=True, text=True, check=True).stdout)
    return shown


def cluster_processes() -> list[str]:
    ps = subprocess.run(["ps", "-e", "-o", "stat=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if re.search(r"\b(slurmctld|slurmd|slurmstepd)\b|dflash-cluster", line) and not line.startswith("Z")]


def test_the_cluster_comes_up_and_goes_down_leaving_the_machines_network_alone():
    """Both nodes idle; a two-node step runs rank 0 on one node and rank 1 on the other, each at its own address;
    the root namespace's links, addresses and routes are the same before, during and after; down leaves nothing
    running and can be run twice."""
    require_cluster()
    before = root_network()
    cluster_sh("up", timeout=600)
    try:
        during = root_network()
        step = cluster_sh("submit", "srun", "--nodes=2", "--ntasks=2", "bash", "-c", "echo $SLURM_PROCID $(hostname) $(getent hosts $(hostname))")
        placed = sorted(line.split()[:3] for line in step.stdout.splitlines())
        assert placed == [["0", "dflash-n1", "10.200.7.11"], ["1", "dflash-n2", "10.200.7.12"]], step.stdout
    finally:
        cluster_sh("down")
    cluster_sh("down")
    assert during == before
    assert root_network() == before
    assert cluster_processes() == []
    namespaces = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert [name for name in namespaces if name.startswith("dflash-")] == []


@pytest.fixture(scope="module")
def cluster():
    require_cluster()
    cluster_sh("up", timeout=600)
    yield
    cluster_sh("down")


@pytest.fixture(scope="module")
def prepared(cluster, tmp_path_factory):
    """A project whose stages before train have run on the submit host: prepare_data on one process (its data does
    not depend on the topology), then the preflight stages with the two-node overlay."""
    base = tmp_path_factory.mktemp("cluster")
    workdir = make_workdir(base / "work", yaml.safe_load(TEST_CONFIG.read_text()), build_tiny_inputs(base / "tiny"))
    shutil.copy2(ROOT / OVERLAY, workdir / OVERLAY)
    env = snakemake_env(base / "scratch")
    run_snakemake(workdir, env, "--cores", "2", "prepare_data")
    run_snakemake(workdir, env, "--cores", "2", "train", "--omit-from", "train", *CONFIGS)
    return {"workdir": workdir, "env": env, "base": base}


def config_of(workdir: Path, **overrides: dict) -> dict:
    """The config the workflow sees: config/config.yaml, the overlay over it, then ``overrides`` over each section."""
    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    for section, values in [*yaml.safe_load((workdir / OVERLAY).read_text()).items(), *overrides.items()]:
        config[section] = config.get(section, {}) | values
    return config


def train_one_process(prepared: dict, name: str, **overrides: dict) -> Path:
    """One process trains on the workflow's data, target and config (``overrides`` over it): the reference drafter.

    It reads the hidden-state cache the cluster's ranks wrote. Each rank computes the target's hidden states of its
    share of the samples, in batches whose padding differs from one process's: the tiny random target's logits hold
    near-ties, and one flipped greedy token changes a sample's labels (seen: 1 of 585 positions, gradients 5% apart).
    That is the target's arithmetic, not the training's; from the same cache the two trainings agree to 1e-7."""
    workdir, out = prepared["workdir"], prepared["base"] / name
    checkpoints = out.parent / f"{out.name}-checkpoints"
    for cache in (workdir / "results" / "cache" / "train").glob("hidden-states*"):
        shutil.copytree(cache, checkpoints / cache.name)
    c = load_config(config_of(workdir, **overrides))
    preflight = sorted(str(p.relative_to(workdir)) for p in (workdir / "results" / "preflight").glob("*.json"))
    args = ["--drafter", canonical_json(to_dict(c.drafter)), "--train", canonical_json(to_dict(c.train))]
    args += ["--topology", canonical_json({"device": "cpu"}), "--tracking", canonical_json(to_dict(c.tracking)), "--seed", str(c.seed)]
    args += ["--target-manifest", "results/target/target.json", "--samples", "results/data/train.parquet"]
    args += ["--validation", "results/data/validation.parquet", "--preflight", *preflight]
    args += ["--out-dir", str(out), "--checkpoint-dir", str(checkpoints)]
    env = prepared["env"] | {"PATH": os.environ["PATH"]}
    result = subprocess.run([sys.executable, "-m", "dflash", "train", *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, readable(result.stdout + result.stderr)
    return out / "drafter" / "model.safetensors"


def assert_same_drafter(trained: Path, reference: Path) -> None:
    expected = load_file(str(reference))
    weights = load_file(str(trained))
    assert weights.keys() == expected.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], atol=WEIGHT_ATOL, rtol=0, msg=name)


def profile_request(prepared: dict, *config: str) -> list[str]:
    """The sbatch options the SLURM profile asks for the train job: the rule's resources as a dry run with the
    repository's profile and the cluster's site values plans them."""
    args = ["train", "-n", "--profile", "workflow/profiles/slurm", "--profile", str(SITE_PROFILE), *CONFIGS, *config]
    planned = dict(_planned_resources(run_snakemake(prepared["workdir"], prepared["env"], *args, timeout=300)))
    train = planned["train"]
    assert train.get("mpi") == "srun" and train.get("tasks_per_gpu") == "0", train  # the job's shell starts its own tasks
    return [
        f"--partition={train['slurm_partition']}",
        f"--nodes={train['nodes']}",
        f"--ntasks={train['tasks']}",
        f"--cpus-per-task={train['cpus_per_task']}",
        f"--mem={train['mem_mb']}",
        f"--time={train['runtime']}",
    ]


class Job:
    """``snakemake train`` submitted with sbatch from the controller's namespace: on the job's first node, Snakemake
    runs the train rule's own command through the SLURM executor's job step (``--executor slurm-jobstep``), as a job
    the profile submits does."""

    def __init__(self, prepared: dict, name: str, request: list[str], *config: str):
        self.workdir = prepared["workdir"]
        self.output = prepared["base"] / f"{name}.out"
        script = prepared["base"] / f"{name}.sh"
        # The executor's own job step: it runs the rule's shell with every SLURM_* variable but the job's id removed.
        snakemake = [str(SNAKEMAKE), "--executor", "slurm-jobstep", "--jobs", "1", "--rerun-incomplete", "train", *CONFIGS, *config]
        script.write_text(f"#!/bin/bash\ncd {self.workdir}\nexec {' '.join(map(_quote, snakemake))}\n")
        submitted = cluster_sh("submit", "sbatch", "--parsable", f"--output={self.output}", "--job-name", name, *request, str(script), env=prepared["env"])
        self.id = submitted.stdout.strip().split(";")[0]
        self.submitted = time.monotonic()

    def record(self) -> dict[str, str]:
        """SLURM's record of the job (slurmctld keeps it for MinJobAge)."""
        shown = cluster_sh("submit", "scontrol", "show", "job", "-o", self.id).stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def wait(self, timeout: float = 900) -> dict[str, str]:
        record = wait_until(
            lambda: (r := self.record())["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") and r, timeout, f"job {self.id} ending"
        )
        self.seconds = time.monotonic() - self.submitted
        return record

    def log(self) -> str:
        return f"--- {self.output.name}\n{readable(self.output.read_text())}\n--- train.log\n{readable(self.train_log())}"

    def train_log(self) -> str:
        path = self.workdir / "results" / "logs" / "train.log"
        return path.read_text() if path.exists() else ""


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def wait_until(condition, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.fixture(scope="module")
def request_for_train(prepared) -> list[str]:
    return profile_request(prepared)


def test_one_training_job_on_two_nodes_equals_one_process(prepared, request_for_train):
    job = Job(prepared, "train-2-nodes", request_for_train)
    record = job.wait()
    assert record["JobState"] == "COMPLETED", job.log()
    assert (record["NumNodes"], record["NodeList"]) == ("2", "dflash-n[1-2]"), record
    log = job.train_log()
    # The launcher on the first node, one torchrun per node, the rendezvous at the first node.
    assert re.search(
        rf"launch: SLURM job {job.id} on dflash-n1,dflash-n2, 2 x 1 processes, rendezvous at dflash-n1:{29500 + int(job.id) % 1000}$", log, re.M
    ), log
    for rank, node in enumerate(NODES):
        assert re.search(rf"rank {rank} of 2 \(drafter, local rank 0\) on host {node}$", log, re.MULTILINE), readable(log)
    summary = json.loads((prepared["workdir"] / "results" / "train" / "summary.json").read_text())
    assert summary["topology"] == "colocated 2x1 cpu"
    print(f"train on 2 nodes: {job.seconds:.0f} s from sbatch to the end")
    assert_same_drafter(prepared["workdir"] / "results" / "train" / "drafter" / "model.safetensors", train_one_process(prepared, "one-process"))


def checkpoint_dir(workdir: Path) -> Path | None:
    """The run's checkpoint directory (one per fingerprint, beside the hidden-state caches)."""
    runs = [p for p in (workdir / "results" / "cache" / "train").glob("*") if p.is_dir() and not p.name.startswith("hidden-states")]
    return runs[0] if len(runs) == 1 else None


def complete(workdir: Path) -> list[Path]:
    found = checkpoint_dir(workdir)
    return complete_checkpoints(found) if found is not None else []


# Before the long runs: on the config test_one_training_job_on_two_nodes_equals_one_process ran, only train reruns.
def test_a_job_of_fewer_nodes_than_the_topology_fails_at_once_naming_both(prepared, request_for_train):
    one_node = [("--nodes=1" if r.startswith("--nodes=") else "--ntasks=1" if r.startswith("--ntasks=") else r) for r in request_for_train]
    job = Job(prepared, "train-one-node", one_node, "--forcerun", "train")
    record = job.wait(300)
    assert record["JobState"] == "FAILED", job.log()
    errors = [line for line in job.train_log().splitlines() if line.startswith("dflash launch: error:")]
    assert errors == [
        f"dflash launch: error: SLURM job {job.id} holds 1 node(s) (dflash-n1) but topology.nnodes is 2: submit it with --nodes 2 "
        "(the rule's nodes resource asks for it), or set topology.nnodes: 1"
    ], job.log()
    assert "Traceback" not in job.train_log()
    print(f"a job of one node: failed {job.seconds:.0f} s after sbatch")


def test_a_cancelled_job_resumes_from_its_checkpoint_across_nodes(prepared, request_for_train):
    """scancel after the first checkpoint, resubmit: the rerun resumes from it and ends with the weights of an
    uninterrupted run on the same two nodes. Every checkpoint left on disk is whole.

    The uninterrupted run is the two-node job's, not one process's: over 300 steps, Adam carries the float summation
    order's differences from one process to two (1e-7 after a step) to 2e-5."""
    workdir = prepared["workdir"]
    drafter = workdir / "results" / "train" / "drafter" / "model.safetensors"
    long = ("--config", f"train={LONG_TRAIN}")
    uninterrupted = Job(prepared, "train-uninterrupted", request_for_train, *long)
    assert uninterrupted.wait()["JobState"] == "COMPLETED", uninterrupted.log()
    reference = shutil.copy2(drafter, prepared["base"] / "uninterrupted.safetensors")

    job = Job(prepared, "train-cancelled", request_for_train, *long, "--forcerun", "train")
    wait_until(lambda: complete(workdir) or job.record()["JobState"] not in ("PENDING", "RUNNING"), 600, "a first checkpoint")
    assert job.record()["JobState"] == "RUNNING", job.log()
    cluster_sh("submit", "scancel", job.id)
    assert job.wait(120)["JobState"] == "CANCELLED"
    kept = complete(workdir)
    found = checkpoint_dir(workdir)
    assert kept and sorted(p for p in found.iterdir() if p.name.startswith(STEP_PREFIX)) == sorted(kept), sorted(p.name for p in found.iterdir())
    for step in kept:
        torch.load(step / "state.pt", weights_only=False)

    rerun = Job(prepared, "train-resumed", request_for_train, *long)
    assert rerun.wait()["JobState"] == "COMPLETED", rerun.log()
    summary = json.loads((workdir / "results" / "train" / "summary.json").read_text())
    assert summary["resumed_from"] >= int(kept[0].name.removeprefix(STEP_PREFIX)) > 0, summary
    assert re.search(r"resuming from \S+step-\d+ \(step \d+ of \d+\)", rerun.train_log()), rerun.log()
    print(f"cancelled after {kept[-1].name}; the rerun resumed from step {summary['resumed_from']} and took {rerun.seconds:.0f} s")
    assert_same_drafter(drafter, reference)
