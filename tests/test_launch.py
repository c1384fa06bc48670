"""The multi-node launcher (``python -m dflash.launch``): what it refuses before srun starts anything, each in one line.

Run as the train rule runs it, as a process; the cluster itself is tests/test_cluster.py's (``pytest -m slurm``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import dflash.launch
from dflash.errors import PreflightError
from dflash.launch import build_parser, job_plan, rendezvous_port, start_torchrun

TRAIN = ["-m", "dflash", "train", "--train", '{"epochs": 1}']


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | env
    return subprocess.run([sys.executable, "-m", "dflash.launch", *args], capture_output=True, text=True, env=environ, timeout=60)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash launch: error: "), result.stderr
    return lines[0]


def test_outside_a_slurm_job_it_says_how_to_submit():
    line = one_line_error(launch("--nnodes", "2", "--nproc-per-node", "8", *TRAIN))
    assert "this is not one (no SLURM_JOB_ID)" in line and "--profile workflow/profiles/slurm" in line and "sbatch --nodes 2" in line


def test_without_srun_on_path_it_names_the_missing_commands(tmp_path):
    line = one_line_error(launch("--nnodes", "2", "--nproc-per-node", "1", *TRAIN, SLURM_JOB_ID="17", PATH=str(tmp_path)))
    assert f"srun and scontrol not found on PATH on {socket.gethostname()}" in line and "topology.nnodes: 1" in line


def test_a_rendezvous_host_that_does_not_resolve_is_named_before_torchrun_starts():
    line = one_line_error(launch("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "no-such-node.invalid:29517", "--rdzv-id", "17", *TRAIN))
    assert "the rendezvous host 'no-such-node.invalid' does not resolve on" in line and "/etc/hosts" in line


def test_a_job_that_holds_no_nodes_is_named_not_sent_to_srun(monkeypatch):
    """scontrol's record of a job id that is not a running job here (pending, or another's) lists no nodes."""
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setattr(dflash.launch, "require_commands", lambda *names: None)
    monkeypatch.setattr(dflash.launch, "slurm_job", lambda job_id: {"JobId": job_id, "JobState": "PENDING", "NodeList": "(null)"})
    monkeypatch.setattr(dflash.launch, "hostnames", lambda nodelist: [])
    with pytest.raises(PreflightError, match=r"SLURM job 17 holds no nodes \(scontrol show job: NodeList='\(null\)'\): SLURM_JOB_ID must name"):
        job_plan(2)


def test_a_rendezvous_endpoint_needs_a_port_and_an_id():
    result = launch("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "dflash-n1", *TRAIN)
    assert result.returncode == 2 and "expected HOST:PORT, with --rdzv-id" in result.stderr


def test_the_node_part_starts_torchrun_with_the_program_and_its_arguments_unchanged():
    args = build_parser().parse_args(["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-endpoint", "localhost:29517", "--rdzv-id", "17", *TRAIN])
    command = start_torchrun(args)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[3:] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend=c10d", "--rdzv-id=17", "--rdzv-endpoint=localhost:29517", *TRAIN]


@pytest.mark.parametrize(("job_id", "port"), [("1", 29501), ("1000", 29500), ("123456", 29956)])
def test_jobs_sharing_a_first_node_meet_at_ports_of_their_own(job_id, port):
    assert rendezvous_port(job_id) == port
