"""The command line the workflow's rules call: one subcommand per stage, each given only its config sections (JSON).

    python -m dflash prepare-target --target '{"source": "embedded"}' --out results/target/target.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dflash import config as C
from dflash.config import cpu_threads
from dflash.preflight.cli import add_subcommands


def _section(kind):
    def parse(text: str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from err
        return value

    parse.__name__ = kind.__name__
    return parse


def _add(sub, name: str, help: str, sections: dict[str, type], paths: list[str]):
    parser = sub.add_parser(name, help=help)
    for key, kind in sections.items():
        parser.add_argument(f"--{key}", type=_section(kind), default={}, help=f"the {key} config section, as JSON")
    for path in paths:
        parser.add_argument(f"--{path.replace('_', '-')}", dest=path, type=Path, required=True)
    parser.set_defaults(sections=sections)
    return parser


def _parsed(args) -> dict:
    """Each ``--<section>`` JSON turned into its dataclass; an error names the dotted key."""
    return {key: C.parse_section(kind, getattr(args, key), key) for key, kind in args.sections.items()}


def prepare_target(args) -> None:
    from dflash.target import write_manifest

    s = _parsed(args)
    manifest = write_manifest(s["target"].source, s["target"].dtype, args.out)
    print(f"prepare_target: {manifest['architecture']} with {manifest['num_layers']} layers from {manifest['source']!r} at {manifest['path']}")


def prepare_data(args) -> None:
    from dflash.data import prepare_data as run
    from dflash.target import load_from_manifest

    s = _parsed(args)
    target = load_from_manifest(args.target_manifest)
    card = run(s["data"], args.seed, target, args.out_dir)
    print(
        f"prepare_data: {card.samples} training samples ({card.response_tokens} response tokens), "
        f"{card.heldout_prompts} held-out prompts, dropped {sum(card.dropped.values())}"
    )


def train(args) -> None:
    from dflash.train import run_train_stage

    s = _parsed(args)
    run_train_stage(s, args)


def evaluate(args) -> None:
    from dflash.evaluate import run_evaluation
    from dflash.model import DFlashDrafter
    from dflash.target import load_from_manifest

    s = _parsed(args)
    target = load_from_manifest(args.target_manifest)
    drafter = DFlashDrafter.from_pretrained(args.drafter, device=target.device, dtype=target.dtype).eval()
    summary = run_evaluation(s["eval"], target, drafter, args.heldout, args.out_dir)
    print(summary.to_string(index=False))


def report(args) -> None:
    from dflash.report import build_report

    build_report(args.metrics, args.train_summary, args.card, args.eval_summary, args.out_dir)


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(cpu_threads())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add(sub, "prepare-target", "materialise the target model", {"target": C.TargetConfig}, ["out"]).set_defaults(run=prepare_target)
    p = _add(sub, "prepare-data", "prompts → target responses → training samples", {"data": C.DataConfig}, ["target_manifest", "out_dir"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=prepare_data)
    p = _add(
        sub,
        "train",
        "train the drafter",
        {"drafter": C.DrafterConfig, "train": C.TrainConfig, "topology": C.TopologyConfig, "tracking": C.TrackingConfig},
        ["target_manifest", "samples", "out_dir", "checkpoint_dir"],
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preflight", type=Path, nargs="*", default=[], help="verdict files train requires")
    p.set_defaults(run=train)
    _add(
        sub, "evaluate", "speculative decoding on the evaluation sets", {"eval": C.EvalConfig}, ["target_manifest", "drafter", "heldout", "out_dir"]
    ).set_defaults(run=evaluate)
    _add(sub, "report", "plots and an HTML summary", {}, ["metrics", "train_summary", "card", "eval_summary", "out_dir"]).set_defaults(run=report)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (C.ConfigError, FileNotFoundError, ValueError) as err:
        print(f"dflash {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
