"""Why a submitted job waits: SLURM's pending reasons, in the log of the Snakemake that submitted the job.

Snakemake's SLURM executor follows each job's state (PENDING, RUNNING, ...) but never says why a job pends, so a
job waiting for a node that never comes up looks like any queued job, for as long as the site lets it wait. The
workflow's ``onstart`` hook (``Snakefile``) starts ``watch_pending`` under that executor: a daemon thread that asks
squeue for the pending jobs whose working directory is the workflow's, and logs each job's reason when it first
pends and whenever the reason changes:

    SLURM job 12 (rule train) is pending: Nodes required for job are DOWN, DRAINED or reserved for jobs in higher
    priority partitions; nodes out of service: dflash-n2 down* (Not responding) ...

with the nodes SLURM holds out of service (``sinfo --list-reasons``), which the job's reason does not name.

It only reads the queue: the job keeps waiting (SLURM starts it once the node is back) unless the user cancels it.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

POLL_S = 30.0  # SLURM re-evaluates pending reasons on its scheduling cycles, about once a minute
SQUEUE = ["squeue", "--me", "--states=PENDING", "--noheader", "--format=%i|%k|%Z|%r"]
SINFO_REASONS = ["sinfo", "--noheader", "--list-reasons", "--format=%N|%T|%E"]
# Reasons every queued job passes through; the watcher names them too, once per job and change.
NO_REASON = {"", "None"}


def pending_jobs(squeue_output: str, workdir: Path) -> dict[str, tuple[str, str]]:
    """The pending jobs of the workflow at ``workdir``, from squeue's ``%i|%k|%Z|%r`` lines: job id -> (rule, reason).
    The executor gives each job the comment ``rule_<name>`` (``rule_<name>_wildcards_<...>`` with wildcards)."""
    jobs = {}
    for line in squeue_output.splitlines():
        fields = line.split("|", 3)
        if len(fields) != 4:
            continue
        job_id, comment, job_dir, reason = (field.strip() for field in fields)
        if not comment.startswith("rule_") or Path(job_dir).resolve() != workdir.resolve():
            continue
        jobs[job_id] = (comment.removeprefix("rule_").split("_wildcards_")[0], reason)
    return jobs


def out_of_service(sinfo_output: str) -> list[str]:
    """The nodes SLURM holds out of service, from ``sinfo --list-reasons`` lines ``%N|%T|%E``: ``nodes state (why)``."""
    held = []
    for line in sinfo_output.splitlines():
        fields = [field.strip() for field in line.split("|", 2)]
        if len(fields) == 3 and fields[0]:
            held.append(f"{fields[0]} {fields[1]} ({fields[2]})" if fields[2] else f"{fields[0]} {fields[1]}")
    return held


def describe(job_id: str, rule: str, reason: str, held: list[str]) -> str:
    nodes = f"; nodes out of service: {', '.join(held)}" if held else ""
    return (
        f"SLURM job {job_id} (rule {rule}) is pending: {reason}{nodes} (from squeue and sinfo; it starts when SLURM can "
        f"place it, `scontrol show job {job_id}` says more, `scancel {job_id}` gives up on it)"
    )


class PendingWatch:
    """Logs each pending job's reason once, and again when it changes."""

    def __init__(self, workdir: Path, say: Callable[[str], None]):
        self.workdir = workdir
        self.say = say
        self.told: dict[str, str] = {}

    def poll(self, squeue_output: str, held: Callable[[], list[str]] = list) -> None:
        """Tell what changed in the pending jobs of ``squeue_output``; ``held`` gives the nodes out of service, asked
        only when there is something to tell."""
        pending = pending_jobs(squeue_output, self.workdir)
        news = {job_id: told for job_id, told in pending.items() if told[1] not in NO_REASON and self.told.get(job_id) != told[1]}
        nodes = held() if news else []
        for job_id, (rule, reason) in news.items():
            self.say(describe(job_id, rule, reason, nodes))
            self.told[job_id] = reason
        self.told = {job_id: reason for job_id, reason in self.told.items() if job_id in pending}

    def run(self, stop: threading.Event, poll_s: float) -> None:
        while not stop.wait(poll_s):
            queue = ask(SQUEUE)
            if queue is not None:  # an unreachable controller: the executor's own status checks report it
                self.poll(queue, lambda: out_of_service(ask(SINFO_REASONS) or ""))


def ask(argv: list[str]) -> str | None:
    """A SLURM command's output, or None where it fails."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def watch_pending(workdir: Path, say: Callable[[str], None], poll_s: float = POLL_S) -> threading.Event:
    """Start the watcher in a daemon thread; setting the returned event stops it."""
    stop = threading.Event()
    watch = PendingWatch(workdir, say)
    threading.Thread(target=watch.run, args=(stop, poll_s), name="slurm-pending-watch", daemon=True).start()
    return stop
