"""Plots and an HTML summary of a run, from the artifacts the stages wrote under ``results/``."""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

PLOTS = ("training_curves.png", "acceptance_histogram.png", "position_acceptance.png", "speedup.png")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_training_curves(metrics: pd.DataFrame, path: Path) -> None:
    """Loss, and per-position accuracy on the training batches (solid) beside the validation samples' (dashed, markers)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
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


def plot_speedup(summary: pd.DataFrame, path: Path) -> None:
    """The drafter's speedup per set beside prompt lookup's (which needs no training), τ on each bar."""
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(summary))
    width = 0.38
    arms = (("dflash", "speedup", "tau", "tab:green", -width / 2), ("prompt lookup", "pld_speedup", "pld_tau", "tab:gray", width / 2))
    for label, speedup, tau, color, offset in arms:
        bars = ax.bar([i + offset for i in x], summary[speedup], width, color=color, label=label)
        for bar, value in zip(bars, summary[tau]):
            ax.annotate(f"τ={value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(list(x), summary["set"])
    ax.set(ylabel="speedup in time per output token", title="speedup over autoregressive decoding")
    ax.legend(fontsize=8)
    _save(fig, path)


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, float_format=lambda x: f"{x:.3f}", border=0, classes="table")


def build_report(metrics_csv: Path, train_summary_json: Path, card_json: Path, eval_summary_csv: Path, out_dir: Path) -> list[Path]:
    """The stages' artifacts → plots and ``summary.html``; per-prompt rows are read from ``<set>.csv`` beside the eval summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = pd.read_csv(metrics_csv)
    summary = pd.read_csv(eval_summary_csv)
    per_prompt = {name: pd.read_csv(eval_summary_csv.parent / f"{name}.csv") for name in summary["set"]}
    plot_training_curves(metrics, out_dir / PLOTS[0])
    plot_acceptance_histogram(per_prompt, out_dir / PLOTS[1])
    plot_position_acceptance(per_prompt, out_dir / PLOTS[2])
    plot_speedup(summary, out_dir / PLOTS[3])
    card = json.loads(card_json.read_text())
    train_summary = json.loads(train_summary_json.read_text())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>DFlash run summary</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}} .table td,.table th{{padding:.2em .8em;text-align:right}}</style></head>
<body><h1>DFlash run summary</h1>
<h2>Evaluation</h2>{_table(summary)}
<h2>Training</h2>{_table(pd.DataFrame([train_summary]))}
<h2>Data</h2><pre>{html.escape(json.dumps(card, indent=2))}</pre>
</body></html>
"""
    (out_dir / "summary.html").write_text(page)
    return [out_dir / name for name in PLOTS] + [out_dir / "summary.html"]
