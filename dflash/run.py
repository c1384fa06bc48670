"""A training run: what it trains (``RunSettings``), where it writes (``RunPaths``), what a drafter rank's loop reads
(``RunContext``), what it returns (``TrainResult``), and which settings a checkpoint belongs to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from dflash.batch import Schedule
from dflash.config import DrafterConfig, TrainConfig
from dflash.distributed import Layout
from dflash.model import DFlashConfig
from dflash.target import Target
from dflash.vocab import DraftVocab


@dataclass(frozen=True)
class TrainResult:
    steps: int
    resumed_from: int
    final_loss: float
    seconds: float
    tokens_per_second: float  # training: sample tokens (no padding) of the global batches per second, after the first step
    first_step_seconds: float  # the first step alone: compiling (or loading compiled graphs) and warming up
    target_tokens_per_second: float  # hidden states: tokens per second of target forward, summed over the ranks that run it
    world: int  # processes
    threads: int  # intra-op threads per process
    compile_cache: dict  # hits and misses of the whole run: a miss is a graph the warmup did not compile
    draft_vocab: int | None = None  # tokens the drafter drafts (None: the target's whole vocabulary)
    draft_vocab_coverage: float = 1.0  # the share of the training responses' tokens it holds
    validation_accuracy: list[float] | None = None  # per block position 1..B-1 on the validation samples, at the end
    validation_tau: float | None = None  # teacher-forced acceptance length on them, at the end
    peak_memory_gb: float | None = None  # CUDA: the most this rank's device held


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes: the hidden-state caches, its checkpoints (one run's), the drafter, the metrics CSV."""

    hidden_cache: Path
    checkpoints: Path
    drafter: Path
    metrics: Path


@dataclass(frozen=True)
class RunSettings:
    """What a run trains: the drafter's shape, the training settings, the seed, and (for benchmarks) a step limit."""

    drafter: DrafterConfig
    train: TrainConfig
    seed: int = 0
    max_steps: int | None = None


@dataclass(frozen=True)
class RunContext:
    """What a drafter rank's loop reads: the run's inputs and settings, where it writes, its place in the topology."""

    target: Target
    samples: pd.DataFrame
    config: DFlashConfig
    cfg: TrainConfig
    schedule: Schedule
    layout: Layout
    paths: RunPaths
    vocab: DraftVocab | None = None

    def head(self) -> torch.Tensor:
        """The frozen LM head rows the drafter projects onto."""
        weight = self.target.lm_head.weight
        return weight if self.vocab is None else self.vocab.head(weight)


# Settings that change what is logged or how often state is saved, never what is trained: a run resumes across them.
OBSERVATION_KEYS = {"train": ("log_every", "validate_every", "checkpoint_every"), "topology": ("collective_timeout_s",), "tracking": None}


def resumable_settings(run_config: dict) -> dict:
    """The settings a checkpoint belongs to: the run's config without ``OBSERVATION_KEYS``."""
    kept = {}
    for section, value in run_config.items():
        dropped = OBSERVATION_KEYS.get(section, ())
        if dropped is None:
            continue
        kept[section] = {k: v for k, v in value.items() if k not in dropped} if isinstance(value, dict) else value
    return kept
