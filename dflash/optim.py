"""The drafter's optimizer and its learning-rate schedule: AdamW, or Muon for the matrices and AdamW for the rest.

Muon (``torch.optim.Muon``) replaces a matrix's update by the nearest
semi-orthogonal matrix to its momentum (Newton–Schulz iterations), which is
meant for feature-to-feature matrices: the drafter's projections and MLPs.
Norm gains and other vectors stay with AdamW. The drafter has no embedding or
LM head of its own (it reads the target's, frozen), so every other matrix is
Muon's. ``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to AdamW's
RMS, so ``muon_lr`` reads on AdamW's scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash.config import TrainConfig


def lr_factor(step: int, total_steps: int, warmup_ratio: float, decay: str = "cosine") -> float:
    """Linear warmup over ``warmup_ratio`` of the steps, then ``decay`` (cosine or linear) to zero at the last step."""
    warmup = max(1, int(math.ceil(warmup_ratio * total_steps)))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if decay == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def muon_matrices(drafter: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The trainable parameters Muon updates (2-D, both sides above 1) and those AdamW updates (the rest)."""
    matrices, rest = [], []
    for parameter in drafter.parameters():
        if parameter.requires_grad:
            (matrices if parameter.ndim == 2 and min(parameter.shape) > 1 else rest).append(parameter)
    return matrices, rest


@dataclass
class DrafterOptimizer:
    """The optimizers of one run, each with its schedule, stepped together: one for AdamW, two for Muon."""

    parts: list[torch.optim.Optimizer]
    schedules: list[torch.optim.lr_scheduler.LRScheduler]

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=True)

    def step(self) -> None:
        """One update of every parameter, then every schedule one step on."""
        for part in self.parts:
            part.step()
        for schedule in self.schedules:
            schedule.step()

    @property
    def lr(self) -> float:
        """The learning rate of the first part (Muon's, where it is used), as the schedule sets it now."""
        return self.schedules[0].get_last_lr()[0]

    def schedule_state(self) -> list[dict]:
        return [schedule.state_dict() for schedule in self.schedules]

    def load_schedule_state(self, states: list[dict]) -> None:
        for schedule, state in zip(self.schedules, states, strict=True):
            schedule.load_state_dict(state)


def build_optimizer(drafter: torch.nn.Module, cfg: TrainConfig, total_steps: int) -> DrafterOptimizer:
    """The config's optimizer over ``drafter``'s trainable parameters, its schedule spanning ``total_steps``."""
    if cfg.optimizer == "muon":
        matrices, rest = muon_matrices(drafter)
        parts: list[torch.optim.Optimizer] = [torch.optim.Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay, adjust_lr_fn="match_rms_adamw")]
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay))
    else:
        parts = [torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(part, lambda s: lr_factor(s, total_steps, cfg.warmup_ratio, cfg.lr_schedule)) for part in parts]
    return DrafterOptimizer(parts, schedules)
