"""The run's plots, one PNG each, from the stages' artifacts: training curves, acceptance per step and per draft
position, speedup per set and arm, the drafter's calibration in decoding, the verify cost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

PLOTS = ("training_curves.png", "acceptance_histogram.png", "position_acceptance.png", "speedup.png", "calibration.png", "verify_cost.png")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_training_curves(metrics: pd.DataFrame, path: Path) -> None:
    """Loss; per-position accuracy on the training batches (solid) beside the validation samples' (dashed, markers); the
    validation samples' teacher-forced τ, what greedy speculative decoding at the training block size would get."""
    fig, (left, right, tau) = plt.subplots(1, 3, figsize=(15, 4))
    left.plot(metrics["step"], metrics["loss"], color="tab:blue")
    left.set(xlabel="step", ylabel="decayed loss", title="training loss")
    acc_columns = [c for c in metrics.columns if c.startswith("acc_")]
    for i, column in enumerate(acc_columns[:4] + acc_columns[-1:] if len(acc_columns) > 5 else acc_columns):
        position = column.split("_")[1]
        color = f"C{i}"
        right.plot(metrics["step"], metrics[column], color=color, label=f"position {position}")
        validated = metrics[["step", f"val_{column}"]].dropna() if f"val_{column}" in metrics else pd.DataFrame()
        if not validated.empty:
            right.plot(validated["step"], validated[f"val_{column}"], color=color, linestyle="--", marker="o", markersize=3)
    right.set(xlabel="step", ylabel="top-1 accuracy", title="accuracy per block position (dashed: validation)", ylim=(0, 1))
    right.legend(fontsize=8)
    validated = metrics[["step", "val_tau"]].dropna() if "val_tau" in metrics else pd.DataFrame()
    if not validated.empty:
        tau.plot(validated["step"], validated["val_tau"], color="tab:purple", marker="o", markersize=3)
    tau.set(xlabel="step", ylabel="τ", title="validation τ (teacher-forced, whole block)")
    _save(fig, path)


def _per_step(rows: pd.DataFrame, column: str) -> list[float]:
    return [float(x) for cell in rows[column].dropna() for x in str(cell).split()]


def plot_acceptance_histogram(per_prompt: dict[str, pd.DataFrame], path: Path) -> None:
    """How many tokens each verify step committed, per evaluation set."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in per_prompt.items():
        lengths = _per_step(rows, "acceptance_lengths")
        if lengths:
            top = int(max(lengths))
            ax.hist(lengths, bins=range(1, top + 2), alpha=0.5, density=True, label=name, align="left")
    ax.set(xlabel="tokens committed per verify step (acceptance length)", ylabel="fraction of steps", title="acceptance length")
    ax.legend()
    _save(fig, path)


def plot_position_acceptance(per_prompt: dict[str, pd.DataFrame], path: Path) -> None:
    """Fraction of verify steps that accepted draft position k."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in per_prompt.items():
        matrix = [[float(x) for x in str(cell).split()] for cell in rows["per_position_acceptance"].dropna()]
        if matrix:
            means = pd.DataFrame(matrix).mean().tolist()
            ax.plot(range(1, len(means) + 1), means, marker="o", label=name)
    ax.set(xlabel="draft position k", ylabel="acceptance rate", title="per-position acceptance", ylim=(0, 1))
    ax.legend()
    _save(fig, path)


@dataclass(frozen=True)
class ArmColumns:
    """An evaluation arm's columns: per prompt (``<set>.csv``) its time per output token; per set (``summary.csv``)
    its speedup, τ and losslessness."""

    label: str
    tpot: str
    speedup: str
    tau: str
    lossless: str
    color: str


ARMS = (
    ArmColumns("drafter", "tpot_dflash_ms", "speedup", "tau", "lossless", "tab:green"),
    ArmColumns("prompt lookup", "tpot_pld_ms", "pld_speedup", "pld_tau", "pld_lossless", "tab:gray"),
    ArmColumns("hybrid", "tpot_hybrid_ms", "hybrid_speedup", "hybrid_tau", "hybrid_lossless", "tab:blue"),
)


def per_prompt_speedups(rows: pd.DataFrame, arm: ArmColumns) -> pd.Series:
    """Each prompt's own speedup in one arm: its plain decoding's time per output token over the arm's."""
    return rows["tpot_ar_ms"] / rows[arm.tpot]


def plot_speedup(summary: pd.DataFrame, per_prompt: dict[str, pd.DataFrame], path: Path) -> None:
    """Each arm's speedup per set (bars: the set's mean time per output token against plain decoding's; τ on each
    bar) with each prompt's own speedup as a dot: the drafter, prompt lookup (which needs no training), the hybrid."""
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for offset, arm in zip((-width, 0.0, width), ARMS):
        positions = [i + offset for i in range(len(summary))]
        bars = ax.bar(positions, summary[arm.speedup], width, color=arm.color, label=arm.label)
        for bar, value in zip(bars, summary[arm.tau]):
            ax.annotate(f"τ={value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
        for x, name in zip(positions, summary["set"]):
            dots = per_prompt_speedups(per_prompt[name], arm)
            ax.scatter([x] * len(dots), dots, s=6, color="black", alpha=0.45, zorder=3)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(list(range(len(summary))), summary["set"])
    ax.set(ylabel="speedup vs plain decoding (×)", title="speedup over plain decoding (dots: single prompts)")
    ax.legend(fontsize=8)
    _save(fig, path)


def calibration_table(per_prompt: dict[str, pd.DataFrame], bins: int = 10) -> pd.DataFrame:
    """The drafter arm's predicted acceptance (calibrated on validation data) against what decoding observed, per draft
    position and bin of prediction: ``position, predicted, observed, count``."""
    records = [
        (int(k), float(p), int(a))
        for rows in per_prompt.values()
        for cell in rows["predictions"].dropna()
        for k, p, a in (item.split(":") for item in str(cell).split())
    ]
    frame = pd.DataFrame(records, columns=["position", "predicted", "accepted"])
    if frame.empty:
        return pd.DataFrame(columns=["position", "predicted", "observed", "count"])
    frame["bin"] = (frame["predicted"] * bins).clip(upper=bins - 1).astype(int)
    table = frame.groupby(["position", "bin"]).agg(predicted=("predicted", "mean"), observed=("accepted", "mean"), count=("accepted", "size"))
    return table.reset_index().drop(columns="bin")


def plot_calibration(table: pd.DataFrame, path: Path) -> None:
    """Reliability: predicted against observed acceptance in decoding, per draft position (marker area: count)."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
    for position, rows in table.groupby("position"):
        ax.scatter(rows["predicted"], rows["observed"], s=10 + 200 * rows["count"] / max(1, table["count"].max()), label=f"position {position}")
        ax.plot(rows["predicted"], rows["observed"], linewidth=0.8)
    ax.set(xlabel="predicted acceptance (calibrated on validation)", ylabel="observed acceptance in decoding", xlim=(0, 1), ylim=(0, 1))
    ax.set_title("calibration of the drafter's confidence")
    if len(table):
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_verify_cost(cost: dict, path: Path) -> None:
    """The target's verify of k tokens relative to a plain step: the table measured at the start of evaluation, the
    widths decoding verified as it paid them (marker area: how many verifies), and the table the gate ended with,
    learnt from the two."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    measured = cost["relative"]
    ax.plot(range(1, len(measured) + 1), measured, marker="o", color="tab:blue", label="measured at the start")
    decoded = cost.get("decoded", {})
    if decoded:
        most = max(d["verifies"] for d in decoded.values())
        widths = [int(k) for k in decoded]
        ax.scatter(
            widths,
            [d["relative"] for d in decoded.values()],
            s=[10 + 200 * d["verifies"] / most for d in decoded.values()],
            color="tab:orange",
            label="as decoding paid it",
        )
    if cost.get("learnt"):
        ax.plot(range(1, len(cost["learnt"]) + 1), cost["learnt"], linestyle="--", color="tab:green", label="the gate's at the end (learnt)")
    ax.set(xlabel="verify width k (tokens)", ylabel="c(k) / c(1)", title=f"verify cost (c(1) = {cost.get('step_ms') or float('nan'):.1f} ms)")
    ax.legend(fontsize=8)
    _save(fig, path)
