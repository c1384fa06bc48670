"""Training state on disk: resumable checkpoints, and the trained drafter in the reference format.

Checkpoints live outside the workflow's declared outputs (Snakemake deletes
those before rerunning a job), one directory per run fingerprint, one
``step-<n>`` directory per checkpoint. Every drafter rank takes part in
gathering the full state (FSDP shards, each rank's RNG); rank 0 writes it
atomically and every drafter rank loads it (a filesystem shared by the nodes).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict

from dflash import distributed
from dflash.distributed import Layout
from dflash.errors import InputError
from dflash.io import atomic_path, discard, remove_leftovers
from dflash.model import DFlashConfig, DFlashDrafter
from dflash.optim import DrafterOptimizer
from dflash.vocab import DraftVocab

STEP_PREFIX = "step-"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class Progress:
    """What a resumed run needs besides weights and optimizer: the metric rows so far and the accuracy
    counts of the current logging window. The data position is the step: see ``dflash.batch.Schedule``."""

    rows: list[dict]
    correct: torch.Tensor  # [B], since the last logged row, over all ranks
    counted: torch.Tensor

    @classmethod
    def fresh(cls, block_size: int) -> Progress:
        return cls([], torch.zeros(block_size, dtype=torch.float64), torch.zeros(block_size, dtype=torch.float64))


def complete_checkpoints(directory: Path) -> list[Path]:
    """The checkpoints that would load, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def write_checkpoint(directory: Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and keep the ``keep`` newest (rank 0 only)."""
    final = directory / f"{STEP_PREFIX}{step:08d}"
    with atomic_path(final) as staging:
        staging.mkdir()
        torch.save(state, staging / "state.pt")
        (staging / "meta.json").write_text(json.dumps({"step": step}))
    for old in complete_checkpoints(directory)[:-keep]:
        discard(old)
    return final


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    directory: Path, step: int, drafter: torch.nn.Module, optimizer: DrafterOptimizer, progress: Progress, layout: Layout, keep: int = 2
) -> None:
    """Every drafter rank calls this: the full state is gathered (FSDP shards, each rank's RNG) and rank 0 writes it."""
    model_state, optimizer_state = get_state_dict(drafter, optimizer.parts, options=_FULL)
    rng = distributed.gather_to_main(_rng_state(layout.device), layout)
    if layout.is_main:
        state = {
            "drafter": model_state,
            "optimizer": optimizer_state,
            "schedules": optimizer.schedule_state(),
            "rng": rng,  # per drafter rank
            "progress": dataclasses.asdict(progress),
        }
        write_checkpoint(directory, step, state, keep)


def load_checkpoint(path: Path, drafter: torch.nn.Module, optimizer: DrafterOptimizer, layout: Layout) -> Progress:
    """Every drafter rank loads the checkpoint rank 0 wrote."""
    # weights_only: the restricted unpickler, which cannot run code from the file.
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    if len(state["rng"]) != layout.drafter_world:
        raise InputError(f"{path} was written by {len(state['rng'])} drafter ranks, this run has {layout.drafter_world}: checkpoints resume the same topology")
    if len(state["schedules"]) != len(optimizer.parts):
        raise InputError(
            f"{path} holds the state of {len(state['schedules'])} optimizer(s), this run has {len(optimizer.parts)}: checkpoints resume the same train.optimizer"
        )
    set_state_dict(drafter, optimizer.parts, model_state_dict=state["drafter"], optim_state_dict=state["optimizer"], options=_FULL)
    optimizer.load_schedule_state(state["schedules"])
    _set_rng_state(state["rng"][layout.rank], layout.device)
    return Progress(**state["progress"])


def resume_point(directory: Path, layout: Layout) -> tuple[int, Path | None]:
    """The step to start from and the checkpoint to load: rank 0 decides, every rank follows."""
    if layout.is_main:
        remove_leftovers(directory)  # of a crash mid-write or mid-delete
    checkpoints = complete_checkpoints(directory) if layout.is_main else []
    latest = distributed.broadcast_from_main(str(checkpoints[-1]) if checkpoints else None, layout)
    if latest is None:
        return 0, None
    return json.loads((Path(latest) / "meta.json").read_text())["step"], Path(latest)


def save_drafter(
    drafter: torch.nn.Module, config: DFlashConfig, out_dir: Path, layout: Layout, vocab: DraftVocab | None = None, lm_head_weight: torch.Tensor | None = None
) -> None:
    """The trained drafter in the reference format, from the full weights (gathered when FSDP shards them), with its
    draft vocabulary and its rows of the target's ``lm_head_weight``."""
    state = get_model_state_dict(drafter, options=_FULL)
    if layout.is_main:
        plain = DFlashDrafter(config)
        plain.load_state_dict(state)
        plain.draft_vocab = vocab
        plain.save_pretrained(out_dir, lm_head_weight)
