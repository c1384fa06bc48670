"""Experiment tracking with wandb: one run per training job, grouped by a hash of the config, rank 0 only.

Offline by default: runs land under ``results/wandb`` and can be synced later
with ``wandb sync``. ``disabled`` turns tracking off entirely.
"""

from __future__ import annotations

import os
from pathlib import Path


class Tracker:
    def __init__(self, mode: str, project: str, group: str, directory: Path, config: dict, name: str | None = None):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            mode=mode,
            project=project,
            group=group,
            name=name or f"train-{group}",
            dir=str(directory),
            config=config,
            reinit="finish_previous",
        )

    def log(self, row: dict, step: int) -> None:
        self.run.log(row, step=step)

    def summary(self, values: dict) -> None:
        self.run.summary.update(values)

    def finish(self) -> None:
        self.run.finish()


def open_tracker(mode: str, project: str, group: str, directory: Path, config: dict, rank: int = 0) -> Tracker | None:
    """A tracker on rank 0 unless tracking is disabled; ``None`` elsewhere."""
    if mode == "disabled" or rank != 0:
        return None
    return Tracker(mode, project, group, directory, config)
