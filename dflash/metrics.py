"""What a training run observes: its metric rows (loss, accuracy per draft position, validation where due) in a CSV
and the tracker, and the sample tokens per second it trains."""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.checkpoint import Progress
from dflash.distributed import all_reduce_sum
from dflash.run import RunContext
from dflash.step import ValidationData, validation_metrics


def validation_due(previous: int, done: int, every: int, total: int) -> bool:
    """Whether the metrics row of step ``done`` (the last row was at ``previous``) carries validation accuracy:
    the first row at or after each multiple of ``every``, and the last row of the run."""
    return done // every > previous // every or done == total


def write_metrics_row(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


class Validator:
    """Per-position accuracy and teacher-forced τ of the drafter on the validation samples, on the metric rows due."""

    def __init__(self, run: RunContext, data: ValidationData):
        self.run, self.data = run, data

    def due(self, previous: int, done: int) -> bool:
        return validation_due(previous, done, self.run.cfg.validate_every, self.run.schedule.total)

    def __call__(self, drafter) -> tuple[list[float], float]:
        run = self.run
        return validation_metrics(drafter, run.target, run.head(), self.data, run.config, run.cfg, run.layout)


class MetricsLog:
    """The run's metric rows: the accuracy counts of the logging window, each row's validation, the CSV and the
    tracker (rank 0). A resumed run starts from the rows and window of its checkpoint."""

    def __init__(self, run: RunContext, progress: Progress, validator: Validator | None = None, tracker=None):
        self.run, self.progress, self.validator, self.tracker = run, progress, validator, tracker
        if run.layout.is_main:
            run.paths.metrics.parent.mkdir(parents=True, exist_ok=True)
            run.paths.metrics.unlink(missing_ok=True)
            for row in progress.rows:
                write_metrics_row(run.paths.metrics, row)

    def count(self, loss: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor) -> float:
        """One step's loss and accuracy counts, summed over the drafter ranks (one all-reduce); the global loss."""
        layout, block = self.run.layout, self.run.config.block_size
        # Each rank's loss is its share of the global loss, times the ranks.
        stats = all_reduce_sum(torch.cat([loss.detach().reshape(1).double(), correct.double(), counted.double()]), layout).cpu()
        self.progress.correct += stats[1 : 1 + block]
        self.progress.counted += stats[1 + block :]
        return float(stats[0]) / layout.drafter_world

    def log(self, done: int, drafter, values: dict) -> None:
        """The row of step ``done``: ``values``, the window's accuracy per position, and validation where due."""
        progress, block = self.progress, self.run.config.block_size
        accuracy = (progress.correct / progress.counted.clamp(min=1)).tolist()
        row = {"step": done} | values | {f"acc_{k}": accuracy[k] for k in range(1, block)}
        previous = progress.rows[-1]["step"] if progress.rows else 0
        validated, tau = [float("nan")] * block, float("nan")
        if self.validator is not None and self.validator.due(previous, done):
            validated, tau = self.validator(drafter)
        row |= {f"val_acc_{k}": validated[k] for k in range(1, block)} | {"val_tau": tau}
        progress.rows.append(row)
        progress.correct.zero_()
        progress.counted.zero_()
        if self.run.layout.is_main:
            write_metrics_row(self.run.paths.metrics, row)
            if self.tracker is not None:
                self.tracker.log(row, step=done)

    def final_validation(self) -> tuple[list[float] | None, float | None]:
        if self.validator is None or not self.progress.rows:
            return None, None
        last = self.progress.rows[-1]
        return [last[f"val_acc_{k}"] for k in range(1, self.run.config.block_size)], last["val_tau"]


@dataclass
class TokenRate:
    """Sample tokens per second of the global batches, measured from the end of the first step (which compiles)."""

    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    first_step_seconds: float = 0.0
    steady: tuple[float, int] | None = None  # (time, tokens) at the end of the first step

    def step(self, tokens: int) -> float:
        """Count a step's tokens; the running rate."""
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        if self.steady is None:
            self.first_step_seconds, self.steady = elapsed, (time.perf_counter(), self.tokens)
        return self.tokens / elapsed

    def steady_rate(self, end: float) -> float:
        tokens = self.tokens - self.steady[1] if self.steady else 0
        return tokens / (end - self.steady[0]) if tokens else self.tokens / max(end - self.start, 1e-9)
