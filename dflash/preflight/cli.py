"""The preflight stages on the command line: ``env-check``, ``smoke-imports``, ``repro-fx-race``, ``warmup-cache``.

``dflash/cli.py`` registers them with ``add_subcommands``. Each takes its
config sections as JSON, writes its verdict to ``--out`` (and the summary
beside it, ``.txt``), prints the summary, and exits 1 with the problems and
their fixes when the verdict is not ok::

    python -m dflash env-check --topology '{"device": "cpu"}' --preflight '{}' --out results/preflight/env.json
    python -m dflash warmup-cache --device cpu --target-manifest results/target/target.json \\
        --drafter '{}' --train '{}' --topology '{}' --cache-dir results/compile_cache/cpu --out results/preflight/warmup/cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash.config import DrafterConfig, PreflightConfig, TopologyConfig, TrainConfig, parse_section
from dflash.preflight.verdict import Verdict, write_verdict


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _finish(verdict: Verdict, out: Path) -> None:
    """Write the verdict, print its summary; exit 1 with the problems when it is not ok."""
    write_verdict(verdict, out)
    print(verdict.summary)
    if not verdict.ok:
        print(verdict.report(), file=sys.stderr)
        raise SystemExit(1)


def env_check(args) -> None:
    from dflash.preflight.env_check import env_check as run

    topology = parse_section(TopologyConfig, args.topology, "topology")
    preflight = parse_section(PreflightConfig, args.preflight, "preflight")
    _finish(run(topology, preflight, args.results_dir), args.out)


def smoke_imports(args) -> None:
    from dflash.preflight.smoke_imports import smoke_imports as run

    topology = parse_section(TopologyConfig, args.topology, "topology")
    _finish(run("cuda:0" if topology.device == "cuda" else "cpu"), args.out)


def repro_fx_race(args) -> None:
    import torch

    from dflash.preflight.race import repro_fx_race as run

    topology = parse_section(TopologyConfig, args.topology, "topology")
    preflight = parse_section(PreflightConfig, args.preflight, "preflight")
    # Tiny tensors: intra-op threads would only contend with the worker threads for the cores.
    torch.set_num_threads(1)
    _finish(run(topology, preflight.repro_fx_race), args.out)


def warmup_cache(args) -> None:
    from dflash.preflight.warmup import warmup_cache as run

    drafter = parse_section(DrafterConfig, args.drafter, "drafter")
    train = parse_section(TrainConfig, args.train, "train")
    topology = parse_section(TopologyConfig, args.topology, "topology")
    _finish(run(args.device, args.target_manifest, drafter, train, topology, args.cache_dir), args.out)


def add_subcommands(subparsers) -> None:
    """Register the four preflight subcommands; each sets ``run``, the function to call with the parsed arguments."""

    def add(name: str, help: str, run, sections: list[str]) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(name, help=help)
        for key in sections:
            parser.add_argument(f"--{key}", type=_json, default={}, help=f"the {key} config section, as JSON")
        parser.add_argument("--out", type=Path, required=True, help="the verdict JSON to write")
        parser.set_defaults(run=run)
        return parser

    parser = add("env-check", "versions, devices, compiler, directories and disk against the config", env_check, ["topology", "preflight"])
    parser.add_argument("--results-dir", type=Path, default=Path("results"), help="where the workflow writes results and checkpoints")
    add("smoke-imports", "every import the stages make; a tiny drafter on each attention backend", smoke_imports, ["topology"])
    add("repro-fx-race", "reproduce the torch.compile FX-tracing race and verify its mitigation", repro_fx_race, ["topology", "preflight"])
    parser = add("warmup-cache", "compile the drafter's training step into a persistent cache", warmup_cache, ["drafter", "train", "topology"])
    parser.add_argument("--device", required=True, help="the drafter device: cpu, or cudaN (pinned with CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--target-manifest", type=Path, required=True, help="the prepare_target manifest")
    parser.add_argument("--cache-dir", type=Path, required=True, help="the compile cache to fill (emptied first)")
