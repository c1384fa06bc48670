"""What every preflight stage hands on: a JSON verdict and one readable summary line.

Every verdict has ``ok`` and ``torch_version``; ``problems`` holds one
message per failure, each saying what is wrong and how to fix it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.errors import InputError, MissingInputError, PreflightError
from dflash.io import atomic_write_text


@dataclass
class Verdict:
    stage: str
    ok: bool = True
    torch_version: str = field(default_factory=lambda: torch.__version__)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0  # how long the stage took
    summary: str = ""

    def fail(self, problem: str) -> None:
        self.problems.append(problem)
        self.ok = False

    def summarize(self, details: str) -> str:
        status = "ok" if self.ok else f"FAILED ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''})"
        self.summary = f"{self.stage}: {status}, {details} [{self.seconds:.1f} s]"
        return self.summary

    def report(self) -> str:
        """The summary, then each problem on its own line."""
        return "\n".join([self.summary] + [f"  - {p}" for p in self.problems])


def write_verdict(verdict: Verdict, path: str | Path) -> Path:
    """``path`` gets the JSON, ``path`` with ``.txt`` the summary line; each written atomically."""
    path = Path(path)
    atomic_write_text(path, json.dumps(dataclasses.asdict(verdict), indent=2) + "\n")
    atomic_write_text(path.with_suffix(".txt"), verdict.report() + "\n")
    return path


def read_verdict(path: str | Path, stage: str) -> dict:
    """A verdict written by ``write_verdict``; an error when it is missing, from another stage, or not ok."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path} does not exist: run the preflight stage {stage} first (snakemake {path})")
    data = json.loads(path.read_text())
    if data.get("stage") != stage:
        raise InputError(f"{path} is the verdict of stage {data.get('stage')!r}, expected {stage!r}")
    if not data.get("ok"):
        problems = "\n  - ".join(data.get("problems") or ["(no problem recorded)"])
        raise PreflightError(f"preflight stage {stage} failed ({path}):\n  - {problems}")
    return data
