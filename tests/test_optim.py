"""The drafter's optimizers and schedules on known answers: the schedules' values, Muon's orthogonalised step of a
known matrix against a hand computation, and which of the drafter's parameters each optimizer updates."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dflash.config import TrainConfig
from dflash.model import DFlashDrafter
from dflash.optim import build_optimizer, lr_factor, muon_matrices


def test_learning_rate_warms_up_then_decays_to_zero_by_cosine_or_linearly():
    total, warmup = 100, 0.04  # 4 warmup steps, then 96 of decay
    for decay in ("cosine", "linear"):
        assert lr_factor(0, total, warmup, decay) == pytest.approx(0.25)
        assert lr_factor(3, total, warmup, decay) == pytest.approx(1.0)
        assert lr_factor(4, total, warmup, decay) == pytest.approx(1.0)
        assert lr_factor(100, total, warmup, decay) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(52, total, warmup, "cosine") == pytest.approx(0.5, abs=1e-6)  # half way: cos(pi/2)
    assert lr_factor(28, total, warmup, "linear") == pytest.approx(0.75)  # a quarter of the decay done
    assert lr_factor(28, total, warmup, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def newton_schulz_by_hand(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration (Keller Jordan's coefficients), in float64: ``X <- aX + (bA + cA²)X``
    with ``A = XXᵀ``, from ``G / |G|_F``, on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double() / g.double().norm()
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


def test_muon_steps_a_matrix_along_its_orthogonalised_gradient_and_adamw_steps_the_rest():
    """One step from a known state: the matrix moves by -lr·0.2·sqrt(max side)·NS(g) after decoupled decay (Muon on
    AdamW's scale), the vector by -lr·sign(g) (AdamW's first step), each after its own decay."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.matrix = torch.nn.Parameter(torch.randn(3, 5))
    model.gain = torch.nn.Parameter(torch.randn(5))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {"matrix": torch.randn(3, 5), "gain": torch.randn(5)}
    cfg = TrainConfig(optimizer="muon", lr=0.01, weight_decay=0.5, muon_lr=0.02, muon_weight_decay=0.1, warmup_ratio=0.0)
    optimizer = build_optimizer(model, cfg, total_steps=10)
    assert [type(part).__name__ for part in optimizer.parts] == ["Muon", "AdamW"]
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    optimizer.step()

    decayed = before["matrix"] * (1 - 0.02 * 0.1)
    step = (model.matrix.detach() - decayed) / -(0.02 * 0.2 * math.sqrt(5))
    expected = newton_schulz_by_hand(grads["matrix"])
    # Muon iterates in bf16: entries within a few hundredths, the direction within a thousandth.
    torch.testing.assert_close(step.double(), expected, rtol=0, atol=6e-2)
    assert torch.nn.functional.cosine_similarity(step.double().flatten(), expected.flatten(), dim=0) > 0.999
    singular = torch.linalg.svdvals(expected)
    assert singular.min() > 0.5 and singular.max() < 1.5  # nearly orthogonal: US'Vᵀ with S' near 1
    torch.testing.assert_close(model.gain.detach(), before["gain"] * (1 - 0.01 * 0.5) - 0.01 * grads["gain"].sign(), rtol=0, atol=1e-6)
    # The schedule stepped every part: 10 steps, no warmup, cosine.
    assert optimizer.lr == pytest.approx(0.02 * lr_factor(1, 10, 0.0))
    assert optimizer.parts[1].param_groups[0]["lr"] == pytest.approx(0.01 * lr_factor(1, 10, 0.0))


def test_muon_takes_the_drafters_matrices_and_adamw_its_norm_gains(tiny_drafter_config):
    drafter = DFlashDrafter(tiny_drafter_config)
    matrices, rest = muon_matrices(drafter)
    names = {id(p): name for name, p in drafter.named_parameters()}
    assert {names[id(p)].rsplit(".", 2)[-2] for p in matrices} == {"fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(names[id(p)].endswith("norm.weight") for p in rest)
    assert len(matrices) + len(rest) == len(list(drafter.parameters()))
    adamw = build_optimizer(drafter, dataclasses.replace(TrainConfig(), optimizer="adamw"), total_steps=10)
    assert [type(part).__name__ for part in adamw.parts] == ["AdamW"]
