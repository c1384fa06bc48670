"""The command line the workflow's rules call: one subcommand per stage, each given only its config sections (JSON).

    python -m dflash prepare-target --target '{"source": "embedded"}' --out results/target/target.json
    python -m dflash env-check --topology '{"device": "cpu"}' --preflight '{}' --out results/preflight/env.json

A deliberate error (``dflash.errors.DFlashError``: bad config, missing input, a
failed preflight verdict) is reported in one line and exits 1; anything else
is a bug and keeps its traceback. The preflight subcommands write their verdict
to ``--out`` (and its summary beside it, ``.txt``) whether or not it is ok.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dflash import config as C
from dflash.errors import DFlashError, PreflightError


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add(sub, name: str, help: str, run, sections: dict[str, type], paths: list[str]) -> argparse.ArgumentParser:
    """A subcommand taking ``--<section>`` JSON objects and required ``--<path>`` arguments."""
    parser = sub.add_parser(name, help=help)
    for key in sections:
        parser.add_argument(f"--{key}", type=_json_object, default={}, help=f"the {key} config section, as JSON")
    for path in paths:
        parser.add_argument(f"--{path.replace('_', '-')}", dest=path, type=Path, required=True)
    parser.set_defaults(run=run, sections=sections)
    return parser


def _finish(verdict, out: Path, diagnostic: bool = False) -> None:
    """Write a preflight verdict and print its summary; a verdict that is not ok is an error with its problems, unless
    the stage is run as a ``diagnostic`` (then its problems are printed and the verdict file says it failed)."""
    from dflash.preflight.verdict import write_verdict

    write_verdict(verdict, out)
    print(verdict.report() if diagnostic else verdict.summary)
    if not verdict.ok and not diagnostic:
        raise PreflightError(verdict.report())


# -- the stages ----------------------------------------------------------------------------------


def prepare_target(args, s) -> None:
    from dflash.target import write_manifest

    manifest = write_manifest(s["target"].source, s["target"].dtype, args.out)
    print(f"prepare_target: {manifest['architecture']} with {manifest['num_layers']} layers from {manifest['source']!r} at {manifest['path']}")


def fetch_dataset(args, s) -> None:
    from dflash.data import fetch_hub_dataset

    rows = fetch_hub_dataset(s["prompts"], args.out)
    print(f"fetch_dataset: {rows} rows of {s['prompts'].source!r} ({s['prompts'].split}) at {args.out}")


def prepare_data(args, s) -> None:
    from dflash import distributed
    from dflash.data import prepare_data as run
    from dflash.target import load_from_manifest, preparation_dtype

    # One process per device of the topology, as torchrun started them (the launcher resource of the rule).
    layout = distributed.join(s["topology"])
    target = load_from_manifest(args.target_manifest, device=layout.device, dtype=preparation_dtype(s["data"].generation.dtype, layout.device))
    vllm = None
    if args.vllm_env is not None:
        from dflash.generation import VllmTarget

        vllm = VllmTarget.of(args.vllm_env, args.target_manifest)
    card = run(s["data"], args.seed, target, args.out_dir, args.chunk_dir, layout, vllm)
    if card is not None:
        print(
            f"prepare_data: {card.samples} training samples ({card.response_tokens} response tokens, {card.regenerated_samples} regenerated), "
            f"{card.validation_samples} validation samples, {card.heldout_prompts} held-out prompts, dropped {sum(card.dropped.values())}"
        )
    distributed.shutdown(layout)


def train(args, s) -> None:
    from dflash.train import run_train_stage

    run_train_stage(s, args)


def evaluate(args, s) -> None:
    import torch

    from dflash.data import read_samples
    from dflash.evaluate import run_evaluation
    from dflash.model import DFlashDrafter
    from dflash.preflight.gate import first_device
    from dflash.target import load_from_manifest

    target = load_from_manifest(args.target_manifest, device=first_device(s["topology"]), dtype=getattr(torch, s["eval"].target_dtype))
    drafter = DFlashDrafter.from_pretrained(args.drafter, device=target.device, dtype=target.dtype).eval()
    validation = read_samples(args.validation, allow_empty=True)
    summary = run_evaluation(s["eval"], target, drafter, args.heldout, args.out_dir, validation)
    print(summary.to_string(index=False))


def llamacpp_build(args, s) -> None:
    from dflash.io import atomic_write_text
    from dflash.llamacpp import build_llama_server

    manifest = build_llama_server()
    how = "reused" if manifest["reused"] else f"built in {manifest['build_seconds']:.0f} s on {manifest['threads']} thread(s)"
    print(f"llama-server of {manifest['requirement']}: {manifest['server']} ({how})")
    atomic_write_text(args.out, json.dumps(manifest, indent=2) + "\n")


def llamacpp_convert(args, s) -> None:
    from dflash.io import atomic_write_text
    from dflash.llamacpp import convert_for_serving
    from dflash.target import manifest_location

    target_dir = Path(manifest_location(json.loads(args.target_manifest.read_text())))
    manifest = convert_for_serving(json.loads(args.build.read_text()), target_dir, args.drafter, args.out.parent)
    print(f"GGUF: {manifest['target']} and {manifest['drafter']} ({manifest['drafter_fields']}), in {manifest['seconds']:.0f} s")
    atomic_write_text(args.out, json.dumps(manifest, indent=2) + "\n")


def llamacpp_check(args, s) -> None:
    import torch

    from dflash.preflight.gate import first_device
    from dflash.serving import run_llamacpp_check
    from dflash.target import load_from_manifest

    target = load_from_manifest(args.target_manifest, device=first_device(s["topology"]), dtype=getattr(torch, s["eval"].target_dtype))
    build, ggufs = json.loads(args.build.read_text()), json.loads(args.ggufs.read_text())
    summary = run_llamacpp_check(s["serve"], s["eval"], build, ggufs, target, args.drafter, args.heldout, args.out_dir)
    result = summary["acceptance"]
    print(f"τ llama.cpp {result['llamacpp']['tau']:.3f}, ours over the whole vocabulary {result['ours_full_vocab']['tau']:.3f}; agree: {result['agree']}")


def serve_env(args, s) -> None:
    from dflash.io import atomic_write_text
    from dflash.vllm_env import build_env

    try:
        manifest = build_env(args.env, s["serve"])
        print(f"vLLM {manifest['vllm']} (torch {manifest['torch']}, transformers {manifest['transformers']}) in {args.env}")
    except DFlashError as err:
        if not args.optional:
            raise
        # data.generation.engine: auto regenerates with the local engine instead.
        manifest = {"available": False, "reason": str(err).splitlines()[0]}
        print(f"serve-env: vLLM's environment is not available, and the local engine regenerates instead: {err}")
    atomic_write_text(args.out, json.dumps(manifest, indent=2) + "\n")


def serve_check(args, s) -> None:
    import torch

    from dflash.preflight.gate import first_device
    from dflash.serving import run_serve_check
    from dflash.target import load_from_manifest, manifest_location
    from dflash.vllm_env import read_env

    target = load_from_manifest(args.target_manifest, device=first_device(s["topology"]), dtype=getattr(torch, s["eval"].target_dtype))
    python = read_env(args.env_manifest)["python"]
    target_dir = manifest_location(json.loads(args.target_manifest.read_text()))
    summary = run_serve_check(s["serve"], s["eval"], python, target, target_dir, args.drafter, args.heldout, args.out_dir)
    for arm, result in summary["acceptance"].items():
        print(f"{arm}: τ vLLM {result['vllm']['tau']:.3f}, ours {result['ours']['tau']:.3f}; agree: {result['agree']}")


def serve_regeneration(args, s) -> None:
    from dflash.preflight.gate import first_device
    from dflash.serving import compare_regeneration_engines
    from dflash.target import load_from_manifest, manifest_location, preparation_dtype
    from dflash.vllm_env import read_env

    device = first_device(s["topology"])
    generation = s["data"].generation
    target = load_from_manifest(args.target_manifest, device=device, dtype=preparation_dtype(generation.dtype, device))
    python = read_env(args.env_manifest)["python"]
    target_dir = manifest_location(json.loads(args.target_manifest.read_text()))
    summary = compare_regeneration_engines(s["serve"], s["eval"], generation, python, target, target_dir, args.heldout, args.out)
    print(f"local {summary['local']['tokens_per_second']:.1f} tokens/s, vLLM {summary['vllm']['tokens_per_second']:.1f} tokens/s")


def report(args, s) -> None:
    from dflash.report.build import RunArtifacts, build_report

    artifacts = RunArtifacts(args.metrics, args.train_summary, args.card, args.eval_summary, args.env, args.target_manifest, args.benchmarks)
    written = build_report(artifacts, args.config_values, args.out_dir)
    print(f"report: {written[-1]}")


def check_report(args, s) -> None:
    from dflash.report.browser import check_page

    verdict = check_page(args.page, args.screenshot, args.out)
    print(f"{args.page}: {len(verdict['images'])} images loaded, no text overflows; screenshot {args.screenshot}")


def env_check(args, s) -> None:
    from dflash.preflight.env_check import env_check as run

    _finish(run(s["topology"], s["preflight"], args.results_dir), args.out)


def smoke_imports(args, s) -> None:
    from dflash.preflight.gate import first_device
    from dflash.preflight.smoke_imports import smoke_imports as run

    _finish(run(str(first_device(s["topology"]))), args.out)


def repro_fx_race(args, s) -> None:
    import torch

    from dflash.preflight.race import repro_fx_race as run

    # Tiny tensors: intra-op threads would only contend with the worker threads for the cores.
    torch.set_num_threads(1)
    _finish(run(s["topology"], s["preflight"].repro_fx_race), args.out, args.diagnostic)


def warmup_cache(args, s) -> None:
    from dflash.preflight.warmup import warmup_caches as run

    verdicts = run(args.devices, args.target_manifest, args.samples, s["drafter"], s["train"], s["topology"], args.cache_root)
    failures = []
    for verdict in verdicts:  # every verdict is written, then the failures are reported together
        try:
            _finish(verdict, args.out_dir / f"{verdict.device}.json")
        except PreflightError as failure:
            failures.append(str(failure))
    if failures:
        raise PreflightError("\n\n".join(failures))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add(sub, "prepare-target", "materialise the target model", prepare_target, {"target": C.TargetConfig}, ["out"])
    _add(sub, "fetch-dataset", "a hub dataset's split, once, into a local file the stages read", fetch_dataset, {"prompts": C.PromptSource}, ["out"])
    sections = {"data": C.DataConfig, "topology": C.TopologyConfig}
    p = _add(sub, "prepare-data", "prompts → target responses → training samples", prepare_data, sections, ["target_manifest", "out_dir", "chunk_dir"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", type=_json_object, default={}, help=f"data.generation's {', '.join(C.TRANSPORT_KEYS)}, as JSON (over --data's)")
    p.add_argument("--vllm-env", type=Path, default=None, help="the manifest of vLLM's environment (serve_env), for engines vllm and auto")
    sections = {"drafter": C.DrafterConfig, "train": C.TrainConfig, "topology": C.TopologyConfig, "tracking": C.TrackingConfig}
    p = _add(sub, "train", "train the drafter", train, sections, ["target_manifest", "samples", "out_dir", "checkpoint_dir"])
    p.add_argument("--validation", type=Path, default=None, help="validation samples (never trained on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preflight", type=Path, nargs="*", default=[], help="verdict files train requires")
    paths = ["target_manifest", "drafter", "heldout", "validation", "out_dir"]
    _add(sub, "evaluate", "speculative decoding on the evaluation sets", evaluate, {"eval": C.EvalConfig, "topology": C.TopologyConfig}, paths)
    paths = ["metrics", "train_summary", "card", "eval_summary", "env", "target_manifest", "benchmarks", "out_dir"]
    p = _add(sub, "report", "the run's plots and its report page", report, {}, paths)
    p.add_argument("--config-values", type=_json_object, default={}, help="the config's key values to show, by dotted key, as JSON")
    _add(sub, "check-report", "the report page in headless Chromium: images loaded, no overflow, a screenshot", check_report, {}, ["page", "screenshot", "out"])
    _add(sub, "llamacpp-build", "llama.cpp's llama-server from its pinned source, once per source and CPU, into the cache", llamacpp_build, {}, ["out"])
    paths = ["build", "target_manifest", "drafter", "out"]
    _add(sub, "llamacpp-convert", "the target and the trained drafter as GGUF files, beside --out", llamacpp_convert, {}, paths)
    sections = {"serve": C.ServeConfig, "eval": C.EvalConfig, "topology": C.TopologyConfig}
    paths = ["build", "ggufs", "target_manifest", "drafter", "heldout", "out_dir"]
    _add(sub, "llamacpp-check", "the trained drafter in llama.cpp: acceptance against ours, outputs, tokens/s", llamacpp_check, sections, paths)
    p = _add(sub, "serve-env", "build vLLM's own environment (serve.requirements)", serve_env, {"serve": C.ServeConfig}, ["env", "out"])
    p.add_argument("--optional", action="store_true", help="record a failure in --out and exit 0 (data.generation.engine: auto)")
    sections = {"serve": C.ServeConfig, "eval": C.EvalConfig, "topology": C.TopologyConfig}
    paths = ["env_manifest", "target_manifest", "drafter", "heldout", "out_dir"]
    _add(sub, "serve-check", "the trained drafter in vLLM: acceptance against ours, outputs, tokens/s", serve_check, sections, paths)
    sections = {"serve": C.ServeConfig, "eval": C.EvalConfig, "data": C.DataConfig, "topology": C.TopologyConfig}
    paths = ["env_manifest", "target_manifest", "heldout", "out"]
    _add(sub, "serve-regeneration", "regeneration by the local engine and by vllm serve: tokens/s", serve_regeneration, sections, paths)

    preflight = {"topology": C.TopologyConfig, "preflight": C.PreflightConfig}
    p = _add(sub, "env-check", "versions, devices, compiler, directories and disk against the config", env_check, preflight, ["out"])
    p.add_argument("--results-dir", type=Path, default=Path("results"), help="where the workflow writes results and checkpoints")
    _add(sub, "smoke-imports", "every import the stages make; a tiny drafter on each attention backend", smoke_imports, {"topology": C.TopologyConfig}, ["out"])
    p = _add(sub, "repro-fx-race", "reproduce the torch.compile FX-tracing race and verify its mitigation", repro_fx_race, preflight, ["out"])
    p.add_argument("--diagnostic", action="store_true", help="exit 0 on a failed verdict (the workflow's: training does not depend on it)")
    sections = {"drafter": C.DrafterConfig, "train": C.TrainConfig, "topology": C.TopologyConfig}
    p = _add(
        sub,
        "warmup-cache",
        "compile the drafter's training step into a persistent cache",
        warmup_cache,
        sections,
        ["target_manifest", "samples", "cache_root", "out_dir"],
    )
    p.add_argument("--devices", nargs="+", required=True, help="the drafter devices: cpu, or cudaN (each warmed into --cache-root/<device>)")
    return parser


def main(argv: list[str] | None = None) -> int:
    import torch

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        torch.set_num_threads(C.cpu_threads())
        # The whole config, the given sections over the defaults, validated exactly as the workflow validates it.
        raw = {key: getattr(args, key) for key in args.sections}
        if getattr(args, "transport", None):
            raw["data"] = raw["data"] | {"generation": raw["data"].get("generation", {}) | args.transport}
        config = C.load_config(raw)
        sections = {key: getattr(config, key) for key in args.sections}
        args.run(args, sections)
    except DFlashError as err:
        print(f"dflash {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
