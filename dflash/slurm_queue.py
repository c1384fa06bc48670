"""Why a submitted job waits: SLURM's pending reasons, in the log of the Snakemake that submitted the job.

Snakemake's SLURM executor follows each job's state (PENDING, RUNNING, ...) but never says why a job pends, so a
job waiting for a node that never comes up looks like any queued job, for as long as the site lets it wait. The
workflow's ``onstart`` hook (``Snakefile``) starts ``watch_pending`` under that executor: a daemon thread that asks
squeue for the pending jobs whose working directory is the workflow's, and logs each job's reason when it first
pends and whenever the reason changes:

    SLURM job 12 (rule train) is pending: ReqNodeNotAvail, UnavailableNodes:dflash-n2 ...

It only reads the queue: the job keeps waiting (SLURM starts it once the node is back) unless the user cancels it.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

POLL_S = 30.0  # SLURM re-evaluates pending reasons on its scheduling cycles, about once a minute
SQUEUE = ["squeue", "--me", "--states=PENDING", "--noheader", "--format=%i|%k|%Z|%r"]
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


def describe(job_id: str, rule: str, reason: str) -> str:
    return (
        f"SLURM job {job_id} (rule {rule}) is pending: {reason} (from squeue; it starts when SLURM can place it, "
        f"`scontrol show job {job_id}` says more, `scancel {job_id}` gives up on it)"
    )


class PendingWatch:
    """Logs each pending job's reason once, and again when it changes."""

    def __init__(self, workdir: Path, say: Callable[[str], None]):
        self.workdir = workdir
        self.say = say
        self.told: dict[str, str] = {}

    def poll(self, squeue_output: str) -> None:
        pending = pending_jobs(squeue_output, self.workdir)
        for job_id, (rule, reason) in pending.items():
            if reason not in NO_REASON and self.told.get(job_id) != reason:
                self.say(describe(job_id, rule, reason))
                self.told[job_id] = reason
        self.told = {job_id: reason for job_id, reason in self.told.items() if job_id in pending}

    def run(self, stop: threading.Event, poll_s: float) -> None:
        while not stop.wait(poll_s):
            try:
                result = subprocess.run(SQUEUE, capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                continue  # the executor's own status checks report an unreachable controller
            if result.returncode == 0:
                self.poll(result.stdout)


def watch_pending(workdir: Path, say: Callable[[str], None], poll_s: float = POLL_S) -> threading.Event:
    """Start the watcher in a daemon thread; setting the returned event stops it."""
    stop = threading.Event()
    watch = PendingWatch(workdir, say)
    threading.Thread(target=watch.run, args=(stop, poll_s), name="slurm-pending-watch", daemon=True).start()
    return stop
