"""How a stage's processes start on several nodes: inside a SLURM job, srun starts one torchrun per node, and the
torchruns meet at a c10d rendezvous on the job's first node.

    python -m dflash.launch --nnodes 2 --nproc-per-node 8 -m dflash train ...

The train and prepare_data rules' ``launcher`` resource (``workflow/rules/common.smk``) is this command on a
topology of several nodes; the job's shell runs it on the job's first node (sbatch's batch step, or Snakemake's job
step). What the job is comes from SLURM by its id (``scontrol show job``), not from ``SLURM_*`` variables:
Snakemake's job-step executor removes all but ``SLURM_JOB_ID`` before it runs a rule.

It checks first what would otherwise fail late, in a traceback, or hang: that this is a SLURM job, that ``srun`` and
``scontrol`` are on PATH, and that the job holds exactly the topology's nodes. Each node's task then checks that it
resolves its own host name and the rendezvous host before torchrun starts (``--rdzv-endpoint`` given: the node's
part). Each problem is one line naming it and its fix, exit 1; ``srun --kill-on-bad-exit`` ends the other nodes'
tasks when one fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys

from dflash.errors import PreflightError

RDZV_BASE_PORT = 29500  # plus the job id modulo 1000: two jobs sharing a first node meet at different ports


def rendezvous_port(job_id: str) -> int:
    return RDZV_BASE_PORT + int(job_id) % 1000


def slurm_job(job_id: str) -> dict[str, str]:
    """SLURM's record of a job (``scontrol show job -o``), as its ``Key=Value`` fields."""
    shown = run_slurm("scontrol", "show", "job", "-o", job_id)
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list (``n[1-2]`` -> ``n1``, ``n2``), expanded by SLURM itself."""
    return run_slurm("scontrol", "show", "hostnames", nodelist).split()


def run_slurm(*argv: str) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise PreflightError(f"`{' '.join(argv)}` did not answer within 60 s: is slurmctld reachable from {socket.gethostname()}?") from None
    if result.returncode != 0:
        said = " ".join(result.stderr.split()) or f"exit {result.returncode}"
        raise PreflightError(f"`{' '.join(argv)}` failed on {socket.gethostname()}: {said}")
    return result.stdout


def require_commands(*names: str) -> None:
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        raise PreflightError(
            f"{' and '.join(missing)} not found on PATH on {socket.gethostname()}: a topology of several nodes starts its processes "
            "with srun inside a SLURM job; run it on the cluster (load the site's SLURM module or add SLURM's bin to PATH), "
            "or set topology.nnodes: 1"
        )


def job_plan(nnodes: int) -> tuple[str, list[str], int]:
    """This job's id, its hosts and the CPUs per node's task, checked against the topology's ``nnodes``."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id:
        raise PreflightError(
            f"topology.nnodes is {nnodes}: its processes start with srun inside a SLURM job, and this is not one (no SLURM_JOB_ID): "
            f"submit it with `snakemake --profile workflow/profiles/slurm ...` or `sbatch --nodes {nnodes} ...`, or set topology.nnodes: 1"
        )
    require_commands("srun", "scontrol")
    job = slurm_job(job_id)
    hosts = hostnames(job.get("NodeList", ""))
    if not hosts:
        raise PreflightError(
            f"SLURM job {job_id} holds no nodes (scontrol show job: NodeList={job.get('NodeList', '')!r}): SLURM_JOB_ID must name the "
            f"running job this is started in; submit it with `sbatch --nodes {nnodes} ...`, or set topology.nnodes: 1"
        )
    if len(hosts) != nnodes:
        raise PreflightError(
            f"SLURM job {job_id} holds {len(hosts)} node(s) ({job.get('NodeList', 'none')}) but topology.nnodes is {nnodes}: "
            f"submit it with --nodes {nnodes} (the rule's nodes resource asks for it), or set topology.nnodes: {len(hosts)}"
        )
    # What the job asked for per task (--cpus-per-task): srun would give each node's task one CPU, as where
    # SLURM_CPUS_PER_TASK is gone.
    asked = job.get("CPUs/Task", "")
    return job_id, hosts, int(asked) if asked.isdigit() and int(asked) > 0 else 1


def resolve(host: str, what: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        raise PreflightError(
            f"{what} {host!r} does not resolve on {socket.gethostname()} ({err.strerror}): every node must resolve every node's "
            "host name (fix the nodes' DNS or /etc/hosts)"
        ) from None


def start_nodes(args: argparse.Namespace) -> list[str]:
    """The job's part: the srun command line that starts this command's node part on every node."""
    job_id, hosts, cpus = job_plan(args.nnodes)
    endpoint = f"{hosts[0]}:{rendezvous_port(job_id)}"
    print(f"launch: SLURM job {job_id} on {','.join(hosts)}, {args.nnodes} x {args.nproc_per_node} processes, rendezvous at {endpoint}", flush=True)
    srun = ["srun", f"--nodes={args.nnodes}", f"--ntasks={args.nnodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1"]
    node_part = [sys.executable, "-m", "dflash.launch", "--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node)]
    node_part += ["--rdzv-endpoint", endpoint, "--rdzv-id", job_id]
    return srun + node_part + program(args)


def start_torchrun(args: argparse.Namespace) -> list[str]:
    """The node's part: torchrun's command line, once this node resolves itself and the rendezvous host."""
    host = args.rdzv_endpoint.rsplit(":", 1)[0]
    resolve(socket.gethostname(), "this node's own host name")
    resolve(host, "the rendezvous host")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node)]
    torchrun += ["--rdzv-backend=c10d", f"--rdzv-id={args.rdzv_id}", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    return torchrun + program(args)


def program(args: argparse.Namespace) -> list[str]:
    return (["-m"] if args.module else []) + [args.program, *args.program_args]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT: run the node's part (srun gives it)")
    parser.add_argument("--rdzv-id", help="the rendezvous id, the job's id (with --rdzv-endpoint)")
    parser.add_argument("-m", "--module", action="store_true", help="the program is a module, as python -m")
    parser.add_argument("program")
    parser.add_argument("program_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rdzv_endpoint is not None and (not re.fullmatch(r"[^:]+:\d+", args.rdzv_endpoint) or args.rdzv_id is None):
        parser.error(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected HOST:PORT, with --rdzv-id")
    try:
        command = start_torchrun(args) if args.rdzv_endpoint else start_nodes(args)
    except PreflightError as err:
        print(f"dflash launch: error: {err}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    os.execvp(command[0], command)
    return 1  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main())
