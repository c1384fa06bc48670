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

import csv
import hashlib
import json
import os
import re
import shutil
import signal
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
from dflash.distributed import check_in_seconds

pytestmark = pytest.mark.slurm

CLUSTER = ROOT / "tests" / "cluster" / "cluster.sh"
SITE_PROFILE = ROOT / "tests" / "cluster" / "profile"
OVERLAY = "config/slurm-cpu-2x1.yaml"
SPLIT_OVERLAY = "config/slurm-cpu-split-2x2.yaml"
CONFIGS = ["--configfile", "config/config.yaml", OVERLAY]
NODES = ("dflash-n1", "dflash-n2")
WEIGHT_ATOL = 1e-5  # as tests/test_distributed.py: only float summation orders differ
# Every stage but the local rules (prepare_target, all), each submitted as a job of its own.
STAGES_ON_NODES = ("env_check", "smoke_imports", "repro_fx_race", "prepare_data", "warmup_cache", "train", "evaluate", "report")
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


PROFILES = ["--profile", "workflow/profiles/slurm", "--profile", str(SITE_PROFILE)]
_SUBMITTED = re.compile(r"^Job \d+ has been submitted with SLURM jobid (\d+) \(log: \S*/slurm_logs/rule_(\w+)/", re.MULTILINE)
_RULE_HEADER = re.compile(r"^(local)?rule (\w+):$", re.MULTILINE)


def workflow_command(*args: str, configs: list[str] = CONFIGS) -> list[str]:
    """``snakemake --profile workflow/profiles/slurm --profile tests/cluster/profile ARGS`` on the submit host (the
    controller's namespace), as a user of the cluster runs it: the executor submits each job with sbatch and follows
    it with squeue."""
    return ["ip", "netns", "exec", "dflash-ctl", str(SNAKEMAKE), *PROFILES, *args, *configs]  # --configfile takes every word after it


def run_workflow(workdir: Path, env: dict, *args: str, configs: list[str] = CONFIGS, timeout: float = 900) -> subprocess.CompletedProcess:
    start = time.monotonic()
    result = subprocess.run(workflow_command(*args, configs=configs), cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    result.seconds = time.monotonic() - start
    result.output = result.stdout + result.stderr
    assert result.returncode == 0, f"snakemake {' '.join(args)} exited {result.returncode}:\n{readable(result.output, 120)}"
    return result


def submitted(result: subprocess.CompletedProcess) -> dict[str, str]:
    """The rule of each job the run submitted to SLURM, by SLURM job id (from the SLURM log path the executor names)."""
    return {job_id: rule for job_id, rule in _SUBMITTED.findall(result.output)}


def ran_locally(result: subprocess.CompletedProcess) -> set[str]:
    return {m.group(2) for m in _RULE_HEADER.finditer(result.output) if m.group(1)}


def slurm_records() -> dict[str, dict[str, str]]:
    """slurmctld's record of every job it still holds (MinJobAge), by job id: each job's comment (the executor's
    ``rule_<name>``), state, nodes, CPUs, memory and time limit as sbatch asked, and its elapsed time."""
    fields = ("id", "comment", "state", "nodes", "cpus", "memory", "limit", "elapsed", "nodelist")
    shown = cluster_sh("submit", "squeue", "--states=all", "--noheader", "--format=%i|%k|%T|%D|%C|%m|%l|%M|%N").stdout
    return {row[0]: dict(zip(fields, row)) for row in (line.split("|") for line in shown.splitlines())}


@pytest.fixture(scope="module")
def prepared(cluster, tmp_path_factory):
    """The whole workflow, run from nothing on the cluster through the repository's SLURM profile and the cluster's site
    values: the local rules on the submit host, every other job submitted by the executor."""
    base = tmp_path_factory.mktemp("cluster")
    workdir = make_workdir(base / "work", yaml.safe_load(TEST_CONFIG.read_text()), build_tiny_inputs(base / "tiny"))
    for overlay in (OVERLAY, SPLIT_OVERLAY):
        shutil.copy2(ROOT / overlay, workdir / overlay)
    env = snakemake_env(base / "scratch")
    return {"workdir": workdir, "env": env, "base": base, "run": run_workflow(workdir, env)}


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
    # --forcerun: the plan of a train job, whether or not the workflow has run train already.
    args = ["train", "-n", "--forcerun", "train", *PROFILES, *CONFIGS, *config]
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


def test_the_whole_workflow_runs_through_the_slurm_executor_and_equals_one_process(prepared):
    """Local rules on the submit host; the preflight jobs, evaluate and the report each a job of one node;
    prepare_data and train each one job of both nodes, started by the launcher, with a rank on each; the drafter equal
    to one process's on the same data, and every evaluation arm lossless."""
    run, workdir = prepared["run"], prepared["workdir"]
    jobs = submitted(run)
    assert sorted(jobs.values()) == sorted(STAGES_ON_NODES), readable(run.output, 120)
    assert ran_locally(run) == {"prepare_target", "all"}, readable(run.output, 120)
    records = slurm_records()
    for job_id, rule in jobs.items():
        record = records[job_id]
        assert (record["comment"], record["state"]) == (f"rule_{rule}", "COMPLETED"), record
        expected = ("2", "dflash-n[1-2]") if rule in ("prepare_data", "train") else ("1", None)
        assert record["nodes"] == expected[0] and expected[1] in (None, record["nodelist"]), record
    for rule in ("prepare_data", "train"):
        job_id = next(job for job, r in jobs.items() if r == rule)
        log = (workdir / "results" / "logs" / f"{rule}.log").read_text()
        # The launcher on the first node, one torchrun per node, the rendezvous at the first node.
        assert re.search(
            rf"^launch: SLURM job {job_id} on dflash-n1,dflash-n2, 2 x 1 processes, rendezvous at dflash-n1:{29500 + int(job_id) % 1000}$", log, re.M
        ), readable(log)
        for rank, node in enumerate(NODES):
            assert re.search(rf"rank {rank} of 2 \(drafter, local rank 0\) on host {node}$", log, re.MULTILINE), readable(log)
    summary = json.loads((workdir / "results" / "train" / "summary.json").read_text())
    assert summary["topology"] == "colocated 2x1 cpu"
    evaluation = list(csv.DictReader((workdir / "results" / "eval" / "summary.csv").open()))
    assert evaluation and all(row[arm] == "True" for row in evaluation for arm in ("lossless", "pld_lossless", "hybrid_lossless")), evaluation
    print(f"the whole workflow on the cluster: {run.seconds:.0f} s; " + ", ".join(f"{rule} {records[job]['elapsed']}" for job, rule in jobs.items()))
    assert_same_drafter(workdir / "results" / "train" / "drafter" / "model.safetensors", train_one_process(prepared, "one-process"))


def test_a_rerun_submits_nothing_and_an_evaluation_change_submits_only_evaluate_and_the_report(prepared):
    again = run_workflow(prepared["workdir"], prepared["env"])
    assert submitted(again) == {} and "Nothing to be done" in again.output, readable(again.output, 120)
    changed = run_workflow(prepared["workdir"], prepared["env"], "--config", "eval={'max_new_tokens': 7}")
    assert sorted(submitted(changed).values()) == ["evaluate", "report"], readable(changed.output, 120)
    print(f"a rerun with nothing changed: {again.seconds:.0f} s; with eval.max_new_tokens changed: {changed.seconds:.0f} s")


def test_the_split_topology_puts_the_target_ranks_on_one_node_and_the_drafter_ranks_on_the_other(prepared):
    """Split 2 + 2 on two nodes of two processes: the drafter ranks (0, 1) on one node, the target ranks (2, 3) on the
    other, every hidden state sent between the nodes over TCP; the drafter equal to one process's on the same data."""
    workdir = prepared["workdir"]
    run = run_workflow(workdir, prepared["env"], "train", configs=["--configfile", "config/config.yaml", SPLIT_OVERLAY])
    job_id = next(job for job, rule in submitted(run).items() if rule == "train")
    record = slurm_records()[job_id]
    assert (record["state"], record["nodes"], record["nodelist"]) == ("COMPLETED", "2", "dflash-n[1-2]"), record
    log = (workdir / "results" / "logs" / "train.log").read_text()
    assert re.search(rf"^launch: SLURM job {job_id} on dflash-n1,dflash-n2, 2 x 2 processes, ", log, re.M), readable(log)
    found = re.findall(r"rank (\d) of 4 \((\w+), local rank \d\) on host (\S+)$", log, re.MULTILINE)
    placed = {int(rank): (role, host) for rank, role, host in found}
    assert sorted(placed) == [0, 1, 2, 3], readable(log)
    drafter_hosts = {placed[r][1] for r in (0, 1)}
    target_hosts = {placed[r][1] for r in (2, 3)}
    assert [placed[r][0] for r in range(4)] == ["drafter", "drafter", "target", "target"], placed
    assert len(drafter_hosts) == len(target_hosts) == 1 and drafter_hosts | target_hosts == set(NODES), placed
    summary = json.loads((workdir / "results" / "train" / "summary.json").read_text())
    assert summary["topology"].startswith("split"), summary
    split = yaml.safe_load((workdir / SPLIT_OVERLAY).read_text())
    reference = train_one_process(prepared, "one-process-split", train=split["train"], topology=split["topology"])
    print(f"split 2 + 2 on 2 nodes: train {record['elapsed']}, the whole run {run.seconds:.0f} s; summary topology {summary['topology']!r}")
    assert_same_drafter(workdir / "results" / "train" / "drafter" / "model.safetensors", reference)


def node_state(node: str) -> str:
    return cluster_sh("submit", "sinfo", "--noheader", "--nodes", node, "--format=%t").stdout.strip()


def test_a_node_that_never_comes_up_leaves_train_pending_with_slurms_reason_in_the_log(prepared):
    """dflash-n2's slurmd stopped before submission: SLURM marks the node down, the two-node train job pends, and the
    submitting Snakemake's log says why (dflash/slurm_queue.py); once the node is back, the job runs and the workflow
    ends as usual. Never a traceback of ours."""
    workdir, log = prepared["workdir"], prepared["base"] / "node-down.log"
    cluster_sh("stop-node", "2")
    run, restarted = None, False
    try:
        start = time.monotonic()
        wait_until(lambda: node_state(NODES[1]).startswith("down"), 180, f"{NODES[1]} marked down", every=2)
        noticed = time.monotonic() - start
        with log.open("w") as out:
            run = subprocess.Popen(workflow_command("train", "--forcerun", "train"), cwd=workdir, env=prepared["env"], stdout=out, stderr=subprocess.STDOUT)
        told = wait_until(lambda: re.search(r"^SLURM job (\d+) \(rule train\) is pending: (.+)$", log.read_text(), re.M), 240, "the reason in the log", every=2)
        print(f"{NODES[1]} marked {node_state(NODES[1])} {noticed:.0f} s after its slurmd stopped; the log said: {told.group(0)}")
        assert slurm_records()[told.group(1)]["state"] == "PENDING"
        assert f"; nodes out of service: {NODES[1]} down* (Not responding) " in told.group(2), told.group(0)
        cluster_sh("start-node", "2")
        restarted = True
        assert run.wait(600) == 0, readable(log.read_text(), 120)
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        if not restarted:
            subprocess.run(["bash", str(CLUSTER), "start-node", "2"], capture_output=True)
    assert "Traceback" not in log.read_text()
    assert slurm_records()[told.group(1)]["state"] == "COMPLETED"


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


LONG = ("--config", f"train={LONG_TRAIN}")


@pytest.fixture(scope="module")
def uninterrupted(prepared, request_for_train) -> Path:
    """The drafter of LONG_TRAIN's uninterrupted run on the two nodes: what an interrupted run must end with.

    It is the two-node job's, not one process's: over 300 steps, Adam carries the float summation order's differences
    from one process to two (1e-7 after a step) to 2e-5."""
    job = Job(prepared, "train-uninterrupted", request_for_train, *LONG, "--forcerun", "train")
    assert job.wait()["JobState"] == "COMPLETED", job.log()
    return shutil.copy2(prepared["workdir"] / "results" / "train" / "drafter" / "model.safetensors", prepared["base"] / "uninterrupted.safetensors")


def finished_results(workdir: Path) -> dict[str, str]:
    """A digest of every file the workflow's finished stages wrote, by path: all of results/ but what a train job
    writes (its outputs, its log, its checkpoints)."""
    checkpoints = checkpoint_dir(workdir)
    kept = {}
    for path in sorted((workdir / "results").rglob("*")):
        written_by_train = path.is_relative_to(workdir / "results" / "train") or path.name == "train.log"
        if path.is_file() and not written_by_train and (checkpoints is None or not path.is_relative_to(checkpoints)):
            kept[str(path.relative_to(workdir))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return kept


def assert_nothing_lost(workdir: Path, before: dict[str, str]) -> list[Path]:
    """After a fault: every other stage's results as they were, and every checkpoint on disk complete and loadable.
    Returns the checkpoints."""
    assert finished_results(workdir) == before
    kept = complete(workdir)
    found = checkpoint_dir(workdir)
    assert kept and sorted(p for p in found.iterdir() if p.name.startswith(STEP_PREFIX)) == sorted(kept), sorted(p.name for p in found.iterdir())
    for step in kept:
        torch.load(step / "state.pt", weights_only=False)
    return kept


def interrupt_and_resume(prepared: dict, request: list[str], uninterrupted: Path, name: str, interrupt, ended: str) -> tuple[Job, float]:
    """LONG_TRAIN submitted, ``interrupt(job)`` after its first checkpoint, the job ending in state ``ended``; nothing
    lost (assert_nothing_lost); the rerun resumes from one of the checkpoints and ends with the uninterrupted run's
    weights. Returns the interrupted job and the seconds from the interruption to its end."""
    workdir = prepared["workdir"]
    job = Job(prepared, f"train-{name}", request, *LONG, "--forcerun", "train")
    wait_until(lambda: complete(workdir) or job.record()["JobState"] not in ("PENDING", "RUNNING"), 600, "a first checkpoint")
    assert job.record()["JobState"] == "RUNNING", job.log()
    before = finished_results(workdir)
    start = time.monotonic()
    interrupt(job)
    assert job.wait(180)["JobState"] == ended, job.log()
    noticed = time.monotonic() - start
    job.ended_log = job.train_log()  # the rerun writes train.log anew
    kept = assert_nothing_lost(workdir, before)
    rerun = Job(prepared, f"train-{name}-resumed", request, *LONG)
    assert rerun.wait()["JobState"] == "COMPLETED", rerun.log()
    summary = json.loads((workdir / "results" / "train" / "summary.json").read_text())
    assert summary["resumed_from"] >= int(kept[0].name.removeprefix(STEP_PREFIX)) > 0, summary
    assert re.search(r"resuming from \S+step-\d+ \(step \d+ of \d+\)", rerun.train_log()), rerun.log()
    print(f"{name}: ended {noticed:.0f} s later, after {kept[-1].name}; the rerun resumed from step {summary['resumed_from']} and took {rerun.seconds:.0f} s")
    assert_same_drafter(workdir / "results" / "train" / "drafter" / "model.safetensors", uninterrupted)
    return job, noticed


def test_a_cancelled_job_resumes_from_its_checkpoint_across_nodes(prepared, request_for_train, uninterrupted):
    """scancel after the first checkpoint, resubmit: the rerun resumes from it and ends with the weights of an
    uninterrupted run on the same two nodes. Every checkpoint left on disk is whole."""
    interrupt_and_resume(prepared, request_for_train, uninterrupted, "cancelled", lambda job: cluster_sh("submit", "scancel", job.id), "CANCELLED")


def training_process(rank: int) -> int:
    """The pid of the training process of ``rank`` (torchrun's worker, ``python -m dflash train`` with RANK set)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
        if b"dflash" in argv and b"train" in argv and f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
            return int(proc.name)
    raise AssertionError(f"no training process of rank {rank}")


def test_a_killed_rank_ends_the_job_at_once_naming_the_rank_and_its_node(prepared, request_for_train, uninterrupted):
    """kill -9 of rank 1's training process on dflash-n2 mid-training: rank 0 ends with one line of ours naming rank 1
    and its node, within seconds, never waiting for the time limit; the rerun resumes to the uninterrupted weights."""
    job, noticed = interrupt_and_resume(
        prepared, request_for_train, uninterrupted, "killed", lambda job: os.kill(training_process(1), signal.SIGKILL), "FAILED"
    )
    errors = [line for line in job.ended_log.splitlines() if line.startswith("dflash train: error:")]
    assert errors and re.match(r"dflash train: error: rank 0 on dflash-n1 lost rank 1 on dflash-n2 \(10\.200\.7\.12\) during training \(", errors[0]), readable(
        job.ended_log, 120
    )
    print(f"the killed rank's job ended {noticed:.0f} s after kill -9, saying: {errors[0]}")
    assert noticed < 60, noticed


def test_a_stopped_rank_ends_the_job_within_the_collective_timeout_naming_the_rank_and_its_node(prepared, request_for_train, uninterrupted):
    """kill -STOP of rank 1's training process on dflash-n2 mid-training: it neither dies nor answers, and its
    connections stay open. Rank 0 waits in the step's collective for topology.collective_timeout_s (60 s in the
    overlay), hears through the rendezvous store that no other rank timed out, and ends with one line of ours naming
    rank 1 and its node, never waiting for the time limit; the rerun resumes to the uninterrupted weights."""
    timeout_s = yaml.safe_load((ROOT / OVERLAY).read_text())["topology"]["collective_timeout_s"]
    job, noticed = interrupt_and_resume(
        prepared, request_for_train, uninterrupted, "stopped", lambda job: os.kill(training_process(1), signal.SIGSTOP), "FAILED"
    )
    errors = [line for line in job.ended_log.splitlines() if line.startswith("dflash train: error:")]
    assert errors and re.match(
        rf"dflash train: error: rank 0 on dflash-n1 heard nothing from rank 1 on dflash-n2 \(10\.200\.7\.12\) for {timeout_s} s during training ", errors[0]
    ), readable(job.ended_log, 120)
    print(f"the stopped rank's job ended {noticed:.0f} s after kill -STOP (collective timeout {timeout_s} s), saying: {errors[0]}")
    # The timeout, the check-in, then srun's end of the stopped task (KillWait): never the job's time limit.
    assert timeout_s <= noticed < timeout_s + check_in_seconds(timeout_s) + 45, noticed


def test_a_cut_link_is_noticed_by_slurm_and_the_requeued_job_resumes_on_its_own(prepared, uninterrupted):
    """dflash-n2's link cut after train's first checkpoint, in the workflow the profile submits (slurm-requeue): SLURM
    marks the node down within SlurmdTimeout and requeues the job (the cluster's JobRequeue=0 leaves that to the job's
    own --requeue), which pends until the link is mended and then resumes from the last complete checkpoint by itself.
    The submitting Snakemake sees no failure and ends as usual, with the uninterrupted run's weights; nothing lost."""
    workdir, log = prepared["workdir"], prepared["base"] / "link-cut.log"
    run, mended = None, False
    try:
        with log.open("w") as out:
            run = subprocess.Popen(
                workflow_command("train", "--forcerun", "train", *LONG), cwd=workdir, env=prepared["env"], stdout=out, stderr=subprocess.STDOUT
            )
        wait_until(lambda: complete(workdir) or run.poll() is not None, 600, "a first checkpoint")
        assert run.poll() is None, readable(log.read_text(), 120)
        job_id = next(job for job, rule in _SUBMITTED.findall(log.read_text()) if rule == "train")
        before = finished_results(workdir)
        cluster_sh("cut-link", "2")
        start = time.monotonic()
        wait_until(lambda: node_state(NODES[1]).startswith("down"), 180, f"{NODES[1]} marked down", every=1)
        noticed = time.monotonic() - start
        wait_until(lambda: slurm_records()[job_id]["state"] == "PENDING", 120, f"job {job_id} requeued", every=1)
        requeued = time.monotonic() - start
        assert_nothing_lost(workdir, before)
        cluster_sh("mend-link", "2")
        mended, mended_at = True, time.monotonic()
        wait_until(lambda: slurm_records()[job_id]["state"] != "PENDING", 600, f"job {job_id} started again", every=1)
        restarted = time.monotonic() - mended_at
        assert run.wait(900) == 0, readable(log.read_text(), 120)
        ended = time.monotonic() - start
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        if not mended:
            subprocess.run(["bash", str(CLUSTER), "mend-link", "2"], capture_output=True)
    output = log.read_text()
    assert [job for job, rule in _SUBMITTED.findall(output) if rule == "train"] == [job_id], readable(output, 120)  # requeued, not resubmitted
    record = dict(field.split("=", 1) for field in cluster_sh("submit", "scontrol", "show", "job", "-o", job_id).stdout.split() if "=" in field)
    assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), record
    summary = json.loads((workdir / "results" / "train" / "summary.json").read_text())
    assert summary["resumed_from"] > 0, summary
    said = re.findall(rf"^SLURM job {job_id} \(rule train\) is pending: .*$", output, re.M)
    print(
        f"{NODES[1]}'s link cut: marked down {noticed:.0f} s later, job {job_id} requeued at {requeued:.0f} s; link mended, the job started "
        f"again {restarted:.0f} s later and resumed from step {summary['resumed_from']}; the workflow ended {ended:.0f} s after the cut; "
        f"the log said: {said or 'nothing (the job did not pend at a watch)'}"
    )
    assert "Traceback" not in output
    assert_same_drafter(workdir / "results" / "train" / "drafter" / "model.safetensors", uninterrupted)
