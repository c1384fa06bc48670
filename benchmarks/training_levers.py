"""Training levers on a short protocol: each arm trains the default's drafter on the default's data and seed for a few
hundred steps, its schedule annealed to the end, and is judged by validation τ and position-1 accuracy.

    python benchmarks/training_levers.py --arm default '{}' --arm muon '{"optimizer": "muon"}'
    python benchmarks/training_levers.py --results /path/to/results --steps 300 --arm ...

It reads what the workflow wrote under ``--results`` (``prepare_target``, ``prepare_data``, and the compile cache of
``warmup_cache`` when present): run ``snakemake --cores 1 prepare_data warmup_cache`` first. Each arm's JSON is laid
over the config's ``train`` section (``--config``, default ``config/config.yaml``). The arms run one after another in
this process and share one hidden-state cache, built on the first arm's way in (under ``--out``), so that an arm
costs its training steps only.

At equal steps every arm trains ``--steps`` steps. At equal wall clock, an arm whose steps took more than 5% longer
(or shorter) than the first arm's is trained again, from scratch, for the steps the first arm's time buys it, its
schedule annealed to that end. The step time is the steady one (the first step, which compiles, left out); arms
run one after another, so on a noisy machine compare them within one run.

Prints a table and each arm's validation curve; writes ``<out>/levers.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import pandas as pd
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def parse_arms(pairs: list[list[str]]) -> list[tuple[str, dict]]:
    arms = []
    for name, text in pairs:
        overrides = json.loads(text)
        if not isinstance(overrides, dict):
            raise SystemExit(f"--arm {name}: {text!r} is not a JSON object of train keys")
        arms.append((name, overrides))
    if len({name for name, _ in arms}) != len(arms):
        raise SystemExit("--arm: the names must differ")
    return arms


class Protocol:
    """The default's target, samples, validation samples and sections, loaded once for every arm."""

    def __init__(self, config_path: Path, results: Path, out: Path):
        from dflash.compile_cache import use_warm_cache
        from dflash.config import cpu_threads, load_config
        from dflash.data import read_samples
        from dflash.preflight.verdict import read_verdict
        from dflash.target import load_from_manifest, preparation_dtype

        self.config = load_config(yaml.safe_load(config_path.read_text()))
        self.out = out
        torch.set_num_threads(cpu_threads())
        warmup = results / "preflight" / "warmup" / "cpu.json"
        if self.config.train.compile and warmup.is_file():
            use_warm_cache(read_verdict(warmup, "warmup_cache") | {"path": str(warmup)})
        elif self.config.train.compile:
            logging.warning("%s is missing: the first step of each arm compiles cold", warmup)
        self.samples = read_samples(results / "data" / "train.parquet")
        self.validation = read_samples(results / "data" / "validation.parquet")
        dtype = preparation_dtype(self.config.train.target_dtype, torch.device("cpu"))
        self.target = load_from_manifest(results / "target" / "target.json", dtype=dtype)

    def train(self, name: str, overrides: dict, steps: int, validate_every: int) -> dict:
        """One arm from scratch: ``steps`` steps, validated every ``validate_every`` and at the end."""
        from dflash.config import TrainConfig, load_config, parse_section
        from dflash.run import RunPaths, RunSettings
        from dflash.train import train_drafter

        train = dataclasses.asdict(self.config.train) | overrides | {"validate_every": validate_every}
        load_config({"train": train})  # the checks across keys, with the arm's keys named
        cfg = parse_section(TrainConfig, train, "train")
        work = self.out / name
        shutil.rmtree(work, ignore_errors=True)
        paths = RunPaths(hidden_cache=self.out / "hidden-states", checkpoints=work / "checkpoints", drafter=work / "drafter", metrics=work / "metrics.csv")
        settings = RunSettings(drafter=self.config.drafter, train=cfg, seed=self.config.seed, max_steps=steps)
        start = time.perf_counter()
        result = train_drafter(self.target, self.samples, settings, paths, validation=self.validation)
        wall = time.perf_counter() - start
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
        metrics = pd.read_csv(paths.metrics)
        curve = metrics.dropna(subset=["val_tau"])[["step", "val_tau", "val_acc_1"]]
        return {
            "arm": name,
            "train": overrides,
            "steps": result.steps,
            "seconds_per_step": (result.seconds - result.first_step_seconds) / max(1, result.steps - 1),
            "first_step_seconds": result.first_step_seconds,
            "wall_seconds": wall,
            "validation_tau": result.validation_tau,
            "validation_accuracy_1": result.validation_accuracy[0],
            "curve": curve.to_dict("records"),
        }


def table(rows: list[dict]) -> str:
    columns = ["arm", "steps", "seconds_per_step", "validation_tau", "validation_accuracy_1", "equal_time_steps", "equal_time_tau", "equal_time_accuracy_1"]
    cells = [columns] + [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cells)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", nargs=2, action="append", metavar=("NAME", "TRAIN_JSON"), required=True, help="an arm: its name and its train keys")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per arm, the schedule annealed to the last")
    parser.add_argument("--validate-every", type=int, default=100)
    parser.add_argument("--config", type=Path, default=ROOT / "config" / "config.yaml")
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="the workflow's results (prepare_target, prepare_data, warmup_cache)")
    parser.add_argument("--out", type=Path, default=None, help="default: <results>/levers")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arms = parse_arms(args.arm)
    out = args.out or args.results / "levers"
    out.mkdir(parents=True, exist_ok=True)
    protocol = Protocol(args.config, args.results, out)
    rows = []
    for name, overrides in arms:
        rows.append(protocol.train(name, overrides, args.steps, args.validate_every))
        print(f"{name}: τ {rows[-1]['validation_tau']:.3f} after {rows[-1]['steps']} steps, {rows[-1]['seconds_per_step']:.3f} s/step", flush=True)
    baseline = rows[0]["seconds_per_step"] * (rows[0]["steps"] - 1)
    for row, (name, overrides) in zip(rows, arms):
        steps = 1 + round(baseline / row["seconds_per_step"])
        if abs(steps - args.steps) <= 0.05 * args.steps:
            row |= {"equal_time_steps": row["steps"], "equal_time_tau": row["validation_tau"], "equal_time_accuracy_1": row["validation_accuracy_1"]}
            continue
        again = protocol.train(f"{name}-equal-time", overrides, steps, args.validate_every)
        row |= {"equal_time_steps": again["steps"], "equal_time_tau": again["validation_tau"], "equal_time_accuracy_1": again["validation_accuracy_1"]}
        print(f"{name} at the first arm's time: τ {again['validation_tau']:.3f} after {again['steps']} steps", flush=True)
    environment = {"torch": torch.__version__, "threads": torch.get_num_threads(), "results": str(args.results), "config": str(args.config)}
    (out / "levers.json").write_text(json.dumps({"environment": environment, "steps": args.steps, "rows": rows}, indent=2) + "\n")
    print(table(rows))
    for row in rows:
        print(f"{row['arm']}: " + ", ".join(f"step {int(p['step'])} τ {p['val_tau']:.3f}" for p in row["curve"]))
    print(f"written to {out / 'levers.json'}")


if __name__ == "__main__":
    main()
