"""Plots and an HTML summary of a run, from the artifacts the stages wrote under ``results/``."""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from dflash.errors import InputError  # noqa: E402

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


def plot_speedup(summary: pd.DataFrame, path: Path) -> None:
    """Each arm's speedup per set: the drafter, prompt lookup (which needs no training), the hybrid; τ on each bar."""
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(summary))
    width = 0.27
    arms = (
        ("dflash", "speedup", "tau", "tab:green", -width),
        ("prompt lookup", "pld_speedup", "pld_tau", "tab:gray", 0.0),
        ("hybrid", "hybrid_speedup", "hybrid_tau", "tab:blue", width),
    )
    for label, speedup, tau, color, offset in arms:
        bars = ax.bar([i + offset for i in x], summary[speedup], width, color=color, label=label)
        for bar, value in zip(bars, summary[tau]):
            ax.annotate(f"τ={value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(list(x), summary["set"])
    ax.set(ylabel="speedup in time per output token", title="speedup over autoregressive decoding")
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


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, float_format=lambda x: f"{x:.3f}", border=0, classes="table")


def _require(*paths: Path) -> None:
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise InputError(f"the report reads {', '.join(missing)}, which do not exist: rerun the stages that write them (`snakemake --cores 1 report` does)")


def build_report(metrics_csv: Path, train_summary_json: Path, card_json: Path, eval_summary_csv: Path, out_dir: Path) -> list[Path]:
    """The stages' artifacts → plots and ``summary.html``; per-prompt rows (``<set>.csv``) and the verify cost
    (``verify_cost.json``) are read beside the eval summary."""
    _require(metrics_csv, train_summary_json, card_json, eval_summary_csv)
    summary = pd.read_csv(eval_summary_csv)
    evaluated = eval_summary_csv.parent
    _require(*(evaluated / f"{name}.csv" for name in summary["set"]), evaluated / "verify_cost.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = pd.read_csv(metrics_csv)
    per_prompt = {name: pd.read_csv(evaluated / f"{name}.csv") for name in summary["set"]}
    plot_training_curves(metrics, out_dir / PLOTS[0])
    plot_acceptance_histogram(per_prompt, out_dir / PLOTS[1])
    plot_position_acceptance(per_prompt, out_dir / PLOTS[2])
    plot_speedup(summary, out_dir / PLOTS[3])
    calibration = calibration_table(per_prompt)
    calibration.to_csv(out_dir / "calibration.csv", index=False)
    plot_calibration(calibration, out_dir / PLOTS[4])
    plot_verify_cost(json.loads((evaluated / "verify_cost.json").read_text()), out_dir / PLOTS[5])
    card = json.loads(card_json.read_text())
    train_summary = json.loads(train_summary_json.read_text())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>DFlash run summary</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}} .table td,.table th{{padding:.2em .8em;text-align:right}}</style></head>
<body><h1>DFlash run summary</h1>
<h2>Evaluation</h2>{_table(summary)}
<h2>Calibration in decoding</h2>{_table(calibration)}
<h2>Training</h2>{_table(pd.DataFrame([train_summary]))}
<h2>Data</h2><pre>{html.escape(json.dumps(card, indent=2))}</pre>
</body></html>
"""
    (out_dir / "summary.html").write_text(page)
    return [out_dir / name for name in PLOTS] + [out_dir / "summary.html"]
