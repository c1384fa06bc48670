"""The run's report, from the artifacts its stages wrote under ``results/``: the plots, and ``summary.html``, one page
that shows them beside the results in a table with units, the training, the machine, the config's key values and
each stage's duration."""

from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from dflash.errors import InputError
from dflash.io import atomic_write_text
from dflash.report import plots
from dflash.report.page import Cell, Section, Table, duration, figure, key_values, render_page

PAGE = "summary.html"
CAPTIONS = {
    "speedup.png": "Speedup in time per output token over plain decoding (the same loop verifying one token per step), per "
    "evaluation set and arm; each dot is one prompt. Below the dashed line an arm is slower than plain decoding.",
    "position_acceptance.png": "How often the target accepted the draft's token at each position of the block.",
    "acceptance_histogram.png": "Tokens committed per verify step.",
    "training_curves.png": "Training loss; accuracy per block position on the training batches (solid) and the validation "
    "samples (dashed); validation τ, the tokens a greedy decode at the training block size would accept per step.",
    "calibration.png": "The drafter's predicted acceptance (calibrated on validation data) against what decoding observed.",
    "verify_cost.png": "The target's verify of k tokens relative to a plain step: measured at the start, as decoding paid it, and as the gate learnt it.",
}
# Benchmark files of the jobs that read the page rather than make what it shows: a previous run of them is stale.
AFTER_THE_PAGE = ("report", "check_report")
# Flags that decide how fast this CPU computes bf16 (native instructions or emulation).
CPU_FEATURES = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


@dataclass(frozen=True)
class RunArtifacts:
    """The files the report reads. Beside ``eval_summary``: each set's per-prompt rows (``<set>.csv``) and the verify
    cost (``verify_cost.json``). ``benchmarks``: Snakemake's benchmark file of each job, read where there."""

    metrics: Path
    train_summary: Path
    card: Path
    eval_summary: Path
    env: Path
    target: Path
    benchmarks: Path


def _require(*paths: Path) -> None:
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise InputError(f"the report reads {', '.join(missing)}, which do not exist: rerun the stages that write them (`snakemake --cores 1 report` does)")


def _spread(values: pd.Series) -> str:
    low, high = values.quantile(0.25), values.quantile(0.75)
    return f"{low:.2f}–{high:.2f}"


def results_table(summary: pd.DataFrame, per_prompt: dict[str, pd.DataFrame]) -> Table:
    """Per set: each arm's speedup (with the middle half of its prompts' own) and τ, plain decoding's time per token,
    and whether every arm's output equalled plain decoding's."""
    arms = [(arm.label, 1, 1) for arm in plots.ARMS]
    header = [
        [("Set", 1, 2), ("Prompts", 1, 2), ("Speedup vs plain decoding (×)", 3, 1), ("Tokens accepted per verify step (τ)", 3, 1)]
        + [("Plain decoding (ms per token)", 1, 2), ("Output identical to plain decoding", 1, 2)],
        arms + arms,
    ]
    rows = []
    for _, row in summary.iterrows():
        speedups = [Cell(f"{row[a.speedup]:.2f}×", _spread(plots.per_prompt_speedups(per_prompt[row["set"]], a)), True) for a in plots.ARMS]
        taus = [Cell(f"{row[a.tau]:.2f}", number=True) for a in plots.ARMS]
        differing = [a.label for a in plots.ARMS if not bool(row[a.lossless])]
        identical = Cell("yes, every arm") if not differing else Cell(f"no: {', '.join(differing)}", failed=True)
        rows.append([Cell(str(row["set"])), Cell(f"{row['prompts']}", number=True), *speedups, *taus, Cell(f"{row['tpot_ar_ms']:.1f}", number=True), identical])
    return Table(header, rows, css="results")


def training_values(summary: dict) -> list[tuple[str, str]]:
    resumed = f" (resumed from step {summary['resumed_from']:,})" if summary.get("resumed_from") else ""
    values = [
        ("Steps", f"{summary['steps']:,}{resumed}"),
        ("Training samples", f"{summary.get('samples', '—')}"),
        ("Wall time of the steps", f"{duration(summary['seconds'])} (the first {duration(summary.get('first_step_seconds'))}, compiling)"),
        ("Drafter throughput", f"{summary['tokens_per_second']:,.0f} tokens/s"),
        ("Final training loss", f"{summary['final_loss']:.3f}"),
        ("Validation τ (teacher-forced, whole block)", f"{summary['validation_tau']:.3f}"),
        ("Validation accuracy per draft position", " · ".join(f"{a:.2f}" for a in summary.get("validation_accuracy") or [])),
        ("Topology", f"{summary.get('topology', '—')}: {summary.get('world', 1)} rank(s), {summary.get('threads', '—')} thread(s) each"),
    ]
    if summary.get("target_tokens_per_second"):
        values.insert(4, ("Target hidden states", f"{summary['target_tokens_per_second']:,.0f} tokens/s"))
    vocab = summary.get("draft_vocab")
    coverage = summary.get("draft_vocab_coverage", 1.0)
    values.append(("Draft vocabulary", f"{vocab:,} tokens, {coverage:.1%} of response tokens" if vocab else "the target's whole vocabulary"))
    cache = summary.get("compile_cache") or {}
    if cache:
        values.append(("Compile cache (FX graphs)", f"{cache.get('fxgraph_cache_hit', 0)} hit(s), {cache.get('fxgraph_cache_miss', 0)} miss(es)"))
    if summary.get("peak_memory_gb") is not None:
        values.append(("Peak accelerator memory", f"{summary['peak_memory_gb']:.1f} GB"))
    return values


def target_values(target: dict) -> list[tuple[str, str]]:
    return [
        ("Model", f"{target.get('architecture', '—')} from {target.get('source', '—')}"),
        ("Shape", f"{target.get('num_layers')} layers, hidden size {target.get('hidden_size')}, {target.get('num_attention_heads')} heads"),
        ("Vocabulary", f"{target.get('vocab_size', 0):,} tokens"),
        ("Parameters", f"{target.get('parameters', 0) / 1e6:,.1f} M"),
        ("Prepared in", f"{target.get('dtype', '—')}"),
    ]


def _plain(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def machine_values(env: dict, summary: pd.DataFrame) -> list[tuple[str, str]]:
    """This host (the one building the report), what the preflight saw on its node, and the evaluation's device."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    model = fields.get("model name") or platform.processor() or platform.machine()
    features = [f for f in CPU_FEATURES if f in fields.get("flags", "").split()]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else float("nan")
    cuda = env.get("cuda") or {}
    return [
        ("Host (built this report)", socket.gethostname()),
        ("CPU", f"{model}, {cores} core(s) usable, {', '.join(features) or 'none of ' + ', '.join(CPU_FEATURES)}"),
        ("Memory", f"{memory:.0f} GiB"),
        ("GPUs (preflight)", f"{cuda.get('device_count', 0)}" + (f", CUDA {cuda['built_with']}" if cuda.get("built_with") else "")),
        ("Preflight", env.get("summary", "—")),
        ("Evaluation", f"on {summary['device'].iloc[0]}, target in {summary['target_dtype'].iloc[0]}"),
    ]


def stage_durations(benchmarks: Path) -> Table | None:
    """Each job's wall time and peak resident memory from Snakemake's benchmark files, in the order they finished."""
    files = [p for p in benchmarks.rglob("*.tsv") if p.stem not in AFTER_THE_PAGE] if benchmarks.is_dir() else []
    files.sort(key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    rows, total = [], 0.0
    for path in files:
        record = pd.read_csv(path, sep="\t").iloc[-1]
        seconds = float(record["s"])
        total += seconds
        rss = pd.to_numeric(record.get("max_rss"), errors="coerce")
        finished = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        memory = f"{rss / 1024:.1f} GiB" if pd.notna(rss) else "—"
        rows.append([Cell(str(path.relative_to(benchmarks).with_suffix(""))), Cell(duration(seconds), number=True), Cell(memory, number=True), Cell(finished)])
    rows.append([Cell("all stages above"), Cell(duration(total), number=True), Cell(""), Cell("")])
    return Table([[("Stage", 1, 1), ("Wall time", 1, 1), ("Peak memory (RSS)", 1, 1), ("Finished", 1, 1)]], rows)


def build_report(artifacts: RunArtifacts, config_values: dict[str, object], out_dir: Path) -> list[Path]:
    """The artifacts → the plots (``plots.PLOTS``), ``calibration.csv`` and the page, under ``out_dir``.
    ``config_values``: the config's key values by dotted key, shown as given."""
    a = artifacts
    _require(a.metrics, a.train_summary, a.card, a.eval_summary, a.env, a.target)
    summary = pd.read_csv(a.eval_summary)
    evaluated = a.eval_summary.parent
    _require(*(evaluated / f"{name}.csv" for name in summary["set"]), evaluated / "verify_cost.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    per_prompt = {name: pd.read_csv(evaluated / f"{name}.csv") for name in summary["set"]}
    png = {name: out_dir / name for name in plots.PLOTS}
    plots.plot_training_curves(pd.read_csv(a.metrics), png["training_curves.png"])
    plots.plot_acceptance_histogram(per_prompt, png["acceptance_histogram.png"])
    plots.plot_position_acceptance(per_prompt, png["position_acceptance.png"])
    plots.plot_speedup(summary, per_prompt, png["speedup.png"])
    calibration = plots.calibration_table(per_prompt)
    calibration.to_csv(out_dir / "calibration.csv", index=False)
    plots.plot_calibration(calibration, png["calibration.png"])
    plots.plot_verify_cost(json.loads((evaluated / "verify_cost.json").read_text()), png["verify_cost.png"])

    def figures(*names: str) -> str:
        return '<div class="grid">' + "".join(figure(png[n], CAPTIONS[n]) for n in names) + "</div>"

    train, target = json.loads(a.train_summary.read_text()), json.loads(a.target.read_text())
    card = json.loads(a.card.read_text())
    block = summary["block_size"].iloc[0]
    run = [
        Section("Machine", [key_values(machine_values(json.loads(a.env.read_text()), summary))]),
        Section("Target", [key_values(target_values(target))]),
        Section("Data", [key_values([(name.replace("_", " "), _plain(value)) for name, value in card.items()])]),
        Section("Configuration (key values)", [key_values([(name, _plain(value)) for name, value in config_values.items()])]),
    ]
    durations = stage_durations(a.benchmarks)
    run.append(Section("Duration per stage", [durations.render()] if durations else [], "" if durations else f"no benchmark files under {a.benchmarks}"))
    sections = [
        Section(
            "Results",
            [results_table(summary, per_prompt).render(), figures("speedup.png"), figures("position_acceptance.png", "acceptance_histogram.png")],
            f"Greedy decoding at block size {block}. Speedup: plain decoding's mean time per output token over the arm's; "
            "in small type, the middle half of the prompts' own speedups. τ: tokens committed per verify of the target.",
        ),
        Section("Training", [key_values(training_values(train)), figures("training_curves.png")]),
        Section("Inside decoding", [figures("calibration.png", "verify_cost.png")]),
        *run,
    ]
    built = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"DFlash drafter for {target.get('architecture', 'the target')} ({target.get('source', '')})"
    page = render_page(title, f"Built {built} from {a.eval_summary.resolve().parents[1]}", sections)
    atomic_write_text(out_dir / PAGE, page)
    return [*png.values(), out_dir / PAGE]
