"""The pending-reason watcher (dflash/slurm_queue.py) on squeue output of known content."""

from __future__ import annotations

from pathlib import Path

from dflash.slurm_queue import PendingWatch, out_of_service, pending_jobs


def squeue(*rows: tuple[str, str, str, str]) -> str:
    return "".join("|".join(row) + "\n" for row in rows)


def test_only_the_workflows_own_jobs_are_read_with_their_rules(tmp_path):
    other = tmp_path / "other"
    output = (
        squeue(
            ("12", "rule_train", str(tmp_path), "ReqNodeNotAvail, UnavailableNodes:dflash-n2"),
            ("13", "rule_fetch_dataset_wildcards_owner--name--train", str(tmp_path / "." / ""), "Priority"),
            ("14", "rule_train", str(other), "Resources"),  # another workflow's
            ("15", "an interactive job", str(tmp_path), "Resources"),  # not submitted by the executor
        )
        + "a line squeue did not format\n"
    )
    assert pending_jobs(output, tmp_path) == {
        "12": ("train", "ReqNodeNotAvail, UnavailableNodes:dflash-n2"),
        "13": ("fetch_dataset", "Priority"),
    }


def test_each_reason_is_told_once_and_again_when_it_changes(tmp_path):
    said: list[str] = []
    watch = PendingWatch(Path(tmp_path), said.append)
    down = ("12", "rule_train", str(tmp_path), "ReqNodeNotAvail, UnavailableNodes:dflash-n2")
    watch.poll(squeue(("12", "rule_train", str(tmp_path), "None")))  # not yet evaluated: nothing to say
    asked = []

    def held() -> list[str]:
        asked.append(1)
        return ["dflash-n2 down* (Not responding)"]

    watch.poll(squeue(down), held)
    watch.poll(squeue(down), held)
    assert said == [
        "SLURM job 12 (rule train) is pending: ReqNodeNotAvail, UnavailableNodes:dflash-n2; nodes out of service: dflash-n2 "
        "down* (Not responding) (from squeue and sinfo; it starts when SLURM can place it, `scontrol show job 12` says "
        "more, `scancel 12` gives up on it)"
    ]
    assert len(asked) == 1  # sinfo is asked only when there is something to tell
    watch.poll(squeue(("12", "rule_train", str(tmp_path), "Resources")))
    assert len(said) == 2 and "pending: Resources" in said[1]
    watch.poll("")  # it started: forgotten, so a requeued job 12 that pends again is told again
    watch.poll(squeue(("12", "rule_train", str(tmp_path), "Resources")))
    assert len(said) == 3


def test_the_nodes_out_of_service_are_read_from_sinfos_reasons():
    output = "dflash-n2|down*|Not responding\ngpu[03-04]|drained|bad DIMM, ticket 77\nn9|draining|\n\n"
    assert out_of_service(output) == ["dflash-n2 down* (Not responding)", "gpu[03-04] drained (bad DIMM, ticket 77)", "n9 draining"]
    assert out_of_service("") == []
