"""Served where users deploy: the trained drafter in vLLM and in llama.cpp, each engine's acceptance against ours.

The opt-in ``serve_check`` stage (vLLM) and ``llamacpp_check`` (llama.cpp, ``run_llamacpp_check``, on the GGUF
files of ``dflash.llamacpp``; the same prompts, arms and tolerance). vLLM pins a transformers older than the
project's, so it runs in an environment of its own (``build_env``), as a
subprocess running ``dflash/vllm_runner.py``. On the evaluation's prompts
(``serve.limit`` per set), at the evaluation's block size, greedy:

- vLLM decodes each prompt without a drafter, with the drafter as exported,
  and with the drafter over the target's whole vocabulary (its directory
  without the draft vocabulary's file);
- we decode the same prompts autoregressively and with the drafter at the
  same block size, with and without its draft vocabulary, every draft
  position verified (vLLM verifies all ``num_speculative_tokens``: no gate);
- vLLM's mean acceptance length and per-position acceptance, from its own
  counters, must agree with ours within ``serve.tolerance``. This is the
  check that the export means to vLLM what it means to us: layer ids, mask
  token, rope, block size and vocabulary. A wrong one shows as acceptance
  far from ours (near zero, for most).

Outputs are compared token for token with our autoregressive arm. vLLM's CPU
kernels round differently from ours in fp32, so greedy decoding may take the
other side of a near-tie and differ from there on; the stage reports where,
and fails only on acceptance.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from dflash.config import EvalConfig, GenerationConfig, ServeConfig, ServerConfig
from dflash.decoding.generate import speculative_generate
from dflash.decoding.stats import DecodeStats
from dflash.errors import InputError
from dflash.evaluate import eval_conversations
from dflash.io import atomic_write_text
from dflash.kernels import pack_linears
from dflash.model import DFlashDrafter
from dflash.target import Target
from dflash.vllm_env import run_command, vllm_environ, vllm_server
from dflash.vocab import FILE_NAME as VOCAB_FILE

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("vllm_runner.py")


def numerics_caveat(kernels: str) -> str:
    """Why an engine's outputs may differ from ours: ``kernels``, the engine's, round differently."""
    return (
        f"{kernels} round differently from ours in fp32: greedy decoding may take the other side of a near-tie, and every "
        "later token may then differ. Outputs that differ are not a defect of the drafter, which cannot change what the "
        "target writes; acceptance is what the check compares."
    )


@dataclass
class Prompt:
    set: str
    id: str
    messages: list[dict]
    input_ids: list[int]


def serve_prompts(target: Target, eval_cfg: EvalConfig, limit: int, heldout: Path) -> list[Prompt]:
    """The first ``limit`` prompts of each evaluation set, as the evaluation tokenizes them."""
    prompts = []
    for eval_set in eval_cfg.sets:
        count = limit if eval_set.limit is None else min(limit, eval_set.limit)
        for conversation in eval_conversations(eval_set.source, eval_set.split, count, heldout):
            messages = conversation.as_messages()
            prompts.append(Prompt(eval_set.name, conversation.prompt_id, messages, target.chat_prompt_ids(messages)))
    if not prompts:
        raise InputError("eval.sets gave no prompts for the serve check")
    return prompts


def run_vllm(python: str, name: str, request: dict, work: Path, timeout: int) -> dict:
    """One vLLM run (``vllm_runner.py``) of ``request``; its result. Files ``<name>.*`` in ``work``."""
    request_path, result_path = work / f"{name}.request.json", work / f"{name}.result.json"
    request_path.write_text(json.dumps(request))
    started = time.perf_counter()
    run_command([python, str(RUNNER), str(request_path), str(result_path)], f"vLLM ({name})", timeout, vllm_environ(), work / f"{name}.log")
    log.info("vLLM %s: %.0f s", name, time.perf_counter() - started)
    return json.loads(result_path.read_text())


def drafter_over_full_vocab(drafter_dir: Path, out: Path) -> Path:
    """A copy of ``drafter_dir`` without its draft vocabulary: the drafter over the target's whole vocabulary."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(drafter_dir, out, ignore=shutil.ignore_patterns(VOCAB_FILE, ".*"))
    config = json.loads((out / "config.json").read_text())
    config.pop("draft_vocab_size", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def acceptance(lengths: list[int], block_size: int) -> dict:
    """Ours, pooled over the verify steps of every prompt: τ and per-position acceptance as ``DecodeStats`` counts them."""
    pooled = DecodeStats(block_size=block_size, num_input_tokens=0, num_output_tokens=0, acceptance_lengths=lengths)
    return {"tau": pooled.tau, "per_position": pooled.per_position_acceptance, "steps": len(lengths)}


def engine_acceptance(rows: list[dict], block_size: int) -> dict:
    """An engine's (vLLM's, llama.cpp's), from its counters per prompt: 1 + accepted / drafts, and accepted at
    position k / drafts."""
    drafts = sum(r["drafts"] for r in rows)
    per_position = [0] * (block_size - 1)
    for r in rows:
        for k, count in enumerate(r["accepted_per_position"][: block_size - 1]):
            per_position[k] += count
    if not drafts:
        return {"tau": float("nan"), "per_position": [float("nan")] * (block_size - 1), "steps": 0}
    return {"tau": 1 + sum(r["accepted_tokens"] for r in rows) / drafts, "per_position": [c / drafts for c in per_position], "steps": drafts}


def differences(ours: dict, theirs: dict, tolerance: float, engine: str) -> list[str]:
    """Where ``engine``'s acceptance is further from ours than ``tolerance`` (relative; acceptance rates under 0.1
    are compared as if 0.1, since a relative test on a handful of events says nothing)."""
    found = []
    if not abs(theirs["tau"] - ours["tau"]) <= tolerance * ours["tau"]:
        found.append(f"mean acceptance length: {engine} {theirs['tau']:.3f}, ours {ours['tau']:.3f}")
    for k, (a, b) in enumerate(zip(ours["per_position"], theirs["per_position"]), start=1):
        if not abs(a - b) <= tolerance * max(a, b, 0.1):
            found.append(f"acceptance at draft position {k}: {engine} {b:.3f}, ours {a:.3f}")
    return found


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (one ending early counts), or None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def our_arms(target: Target, drafter: DFlashDrafter, prompts: list[Prompt], block_size: int, max_new_tokens: int) -> dict[str, list[dict]]:
    """Our decoding of each prompt: autoregressive, and with the drafter verifying every draft position, with its draft
    vocabulary (as trained) and over the whole vocabulary."""
    vocab = drafter.draft_vocab
    arms: dict[str, list[dict]] = {"ar": [], "dflash": [], "dflash_full_vocab": []}
    for prompt in prompts:
        ids = torch.tensor([prompt.input_ids])
        for arm, size, vocabulary in (("ar", 1, None), ("dflash", block_size, vocab), ("dflash_full_vocab", block_size, None)):
            drafter.draft_vocab = vocabulary
            out = speculative_generate(target, drafter if size > 1 else None, ids, max_new_tokens, block_size=size)
            arms[arm].append(
                {"tokens": out.tokens.tolist(), "seconds": out.stats.decode_seconds + out.stats.prefill_seconds, "lengths": out.stats.acceptance_lengths}
            )
    drafter.draft_vocab = vocab
    return arms


def tokens_per_second(results: list[dict]) -> float:
    """Tokens written over seconds waited, pooled over prompts (each prompt's prefill and decode)."""
    return sum(len(r["tokens"]) for r in results) / max(1e-9, sum(r["seconds"] for r in results))


def run_serve_check(
    cfg: ServeConfig, eval_cfg: EvalConfig, python: str, target: Target, target_dir: str, drafter_dir: Path, heldout: Path, out_dir: Path
) -> dict:
    """The ``serve_check`` stage: ``vllm.json`` (the comparison) and ``vllm.csv`` (per prompt) in ``out_dir``; an
    ``InputError`` naming the difference when vLLM's acceptance and ours disagree."""
    drafter = DFlashDrafter.from_pretrained(drafter_dir, device=target.device, dtype=target.dtype).eval()
    block_size = eval_cfg.block_size or drafter.block_size
    prompts = serve_prompts(target, eval_cfg, cfg.limit, heldout)
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    request = {
        "target": target_dir,
        "dtype": str(target.dtype).removeprefix("torch."),
        "max_model_len": max(len(p.input_ids) for p in prompts) + cfg.max_new_tokens + block_size,
        "max_new_tokens": cfg.max_new_tokens,
        "stop_token_ids": list(target.eos_token_ids),
        "num_speculative_tokens": block_size - 1,
        "prompts": [{"id": p.id, "input_ids": p.input_ids} for p in prompts],
    }
    full_vocab_dir = drafter_over_full_vocab(drafter_dir, work / "drafter-full-vocab")
    theirs = {
        "ar": run_vllm(python, "ar", request | {"drafter": None}, work, cfg.timeout_s),
        "dflash": run_vllm(python, "dflash", request | {"drafter": str(drafter_dir)}, work, cfg.timeout_s),
        "dflash_full_vocab": run_vllm(python, "dflash_full_vocab", request | {"drafter": str(full_vocab_dir)}, work, cfg.timeout_s),
    }
    pack_linears(target.model)  # exact: our outputs do not depend on it
    ours = our_arms(target, drafter, prompts, block_size, cfg.max_new_tokens)

    rows = []
    for i, prompt in enumerate(prompts):
        row = {"set": prompt.set, "prompt_id": prompt.id, "prompt_tokens": len(prompt.input_ids)}
        for arm in theirs:
            row[f"vllm_{arm}_first_difference"] = first_difference(theirs[arm]["prompts"][i]["tokens"], ours["ar"][i]["tokens"])
        row["ours_dflash_first_difference"] = first_difference(ours["dflash"][i]["tokens"], ours["ar"][i]["tokens"])
        rows.append(row)
    frame = pd.DataFrame(rows)

    comparison, failures = {}, []
    for arm in ("dflash", "dflash_full_vocab"):
        mine = acceptance([n for r in ours[arm] for n in r["lengths"]], block_size)
        vllms = engine_acceptance(theirs[arm]["prompts"], block_size)
        found = differences(mine, vllms, cfg.tolerance, "vLLM")
        comparison[arm] = {"ours": mine, "vllm": vllms, "agree": not found, "differences": found}
        failures += [f"{arm}: {d}" for d in found]
    identical = {arm: int(frame[f"vllm_{arm}_first_difference"].isna().sum()) for arm in theirs}
    summary = {
        "vllm": theirs["ar"]["vllm_version"],
        "block_size": block_size,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "tolerance": cfg.tolerance,
        "acceptance": comparison,
        "outputs_identical_to_our_ar": identical,
        "ours_lossless": bool(frame["ours_dflash_first_difference"].isna().all()),
        "numerics_caveat": numerics_caveat("vLLM's CPU kernels (its attention and GEMMs)") if min(identical.values()) < len(prompts) else None,
        "tokens_per_second": {f"vllm_{arm}": tokens_per_second(result["prompts"]) for arm, result in theirs.items()}
        | {f"ours_{arm}": tokens_per_second(result) for arm, result in ours.items()},
        "vllm_startup_seconds": {arm: result["startup_seconds"] for arm, result in theirs.items()},
        "agree": not failures,
    }
    atomic_write_text(out_dir / "vllm.csv", frame.to_csv(index=False))
    atomic_write_text(out_dir / "vllm.json", json.dumps(summary, indent=2) + "\n")
    log.info("serve check:\n%s", json.dumps(summary, indent=2))
    if failures:
        raise InputError("vLLM's acceptance differs from ours beyond serve.tolerance: " + "; ".join(failures) + f" (details: {out_dir / 'vllm.json'})")
    return summary


# -- llama.cpp ----------------------------------------------------------------------------------------------


def run_llamacpp_check(
    cfg: ServeConfig, eval_cfg: EvalConfig, build: dict, ggufs: dict, target: Target, drafter_dir: Path, heldout: Path, out_dir: Path
) -> dict:
    """The ``llamacpp_check`` stage: ``llamacpp.json`` (the comparison) and ``llamacpp.csv`` (per prompt) in
    ``out_dir``, llama-server's logs in ``out_dir/llamacpp``; an ``InputError`` naming the difference when
    llama.cpp's acceptance and ours disagree. ``ggufs`` is ``convert_for_serving``'s manifest.

    llama-server decodes each prompt without the drafter and with it (DFlash drafting ``block_size - 1`` tokens,
    every one verified: plain DFlash has no confidence gate there). The GGUF drafts over the target's whole head
    (``ggufs["draft_vocab_carried"]`` is False), so its acceptance is held to our arm over the whole vocabulary;
    our arm with the draft vocabulary, as trained, says what the loss costs. Where the budget ends inside a block,
    llama-server drafts one token short of the end (its verify writes the last) and our loop to the end: at most one
    verify step per prompt counts differently."""
    from dflash.llamacpp import llama_server

    drafter = DFlashDrafter.from_pretrained(drafter_dir, device=target.device, dtype=target.dtype).eval()
    block_size = eval_cfg.block_size or drafter.block_size
    prompts = serve_prompts(target, eval_cfg, cfg.limit, heldout)
    logs = out_dir / "llamacpp"
    logs.mkdir(parents=True, exist_ok=True)
    context = max(len(p.input_ids) for p in prompts) + cfg.max_new_tokens + block_size
    theirs = {}
    for arm, draft in (("ar", None), ("dflash", Path(ggufs["drafter"]))):
        started = time.perf_counter()
        server = llama_server(
            build, Path(ggufs["target"]), logs / f"{arm}.log", context, draft, block_size - 1, cfg.llamacpp.port, cfg.llamacpp.startup_timeout_s
        )
        with server as llama:
            theirs[arm] = [llama.decode(p.input_ids, cfg.max_new_tokens) for p in prompts]
        log.info("llama.cpp %s: %.0f s", arm, time.perf_counter() - started)
    pack_linears(target.model)  # exact: our outputs do not depend on it
    ours = our_arms(target, drafter, prompts, block_size, cfg.max_new_tokens)

    stop = set(target.eos_token_ids)

    def written(tokens: list[int]) -> list[int]:
        # llama-server leaves the end-of-sequence token out of what it returns; ours keeps it.
        return tokens[:-1] if tokens and tokens[-1] in stop else tokens

    rows = []
    for i, prompt in enumerate(prompts):
        row = {"set": prompt.set, "prompt_id": prompt.id, "prompt_tokens": len(prompt.input_ids), "our_ar_tokens": len(ours["ar"][i]["tokens"])}
        for arm in theirs:
            row[f"llamacpp_{arm}_first_difference"] = first_difference(written(theirs[arm][i]["tokens"]), written(ours["ar"][i]["tokens"]))
        row["llamacpp_dflash_tau"] = engine_acceptance([theirs["dflash"][i]], block_size)["tau"]
        row["ours_dflash_full_vocab_tau"] = acceptance(ours["dflash_full_vocab"][i]["lengths"], block_size)["tau"]
        rows.append(row)
    frame = pd.DataFrame(rows)

    mine = acceptance([n for r in ours["dflash_full_vocab"] for n in r["lengths"]], block_size)
    llamas = engine_acceptance(theirs["dflash"], block_size)
    found = differences(mine, llamas, cfg.tolerance, "llama.cpp")
    as_trained = acceptance([n for r in ours["dflash"] for n in r["lengths"]], block_size)
    identical = {arm: int(frame[f"llamacpp_{arm}_first_difference"].isna().sum()) for arm in theirs}
    summary = {
        "llamacpp": build["requirement"],
        "block_size": block_size,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "tolerance": cfg.tolerance,
        "acceptance": {"ours_full_vocab": mine, "llamacpp": llamas, "agree": not found, "differences": found},
        "draft_vocab": {
            "carried": ggufs["draft_vocab_carried"],
            "size": ggufs["draft_vocab_size"],
            "ours_tau_with_it": as_trained["tau"],
            "ours_tau_without_it": mine["tau"],
        },
        "outputs_identical_to_our_ar": identical,
        "first_differences": {arm: frame[f"llamacpp_{arm}_first_difference"].dropna().astype(int).tolist() for arm in theirs},
        "numerics_caveat": numerics_caveat("llama.cpp's ggml CPU kernels") if min(identical.values()) < len(prompts) else None,
        "tokens_per_second": {f"llamacpp_{arm}": tokens_per_second(result) for arm, result in theirs.items()}
        | {f"ours_{arm}": tokens_per_second(result) for arm, result in ours.items()},
        "agree": not found,
    }
    atomic_write_text(out_dir / "llamacpp.csv", frame.to_csv(index=False))
    atomic_write_text(out_dir / "llamacpp.json", json.dumps(summary, indent=2) + "\n")
    log.info("llama.cpp check:\n%s", json.dumps(summary, indent=2))
    if found:
        raise InputError("llama.cpp's acceptance differs from ours beyond serve.tolerance: " + "; ".join(found) + f" (details: {out_dir / 'llamacpp.json'})")
    return summary


# -- vLLM as the regeneration engine ----------------------------------------------------------------------


def compare_regeneration_engines(
    cfg: ServeConfig, eval_cfg: EvalConfig, generation: GenerationConfig, python: str, target: Target, target_dir: str, heldout: Path, out: Path
) -> dict:
    """Regeneration of the serve check's prompts by the local engine and by ``vllm serve`` through the server engine,
    with ``data.generation``'s settings: tokens/s of each, and how many replies are identical. Written to ``out``."""
    from dflash.generation import Request, engine_for

    prompts = serve_prompts(target, eval_cfg, cfg.limit, heldout)
    requests = [Request(p.id, p.messages, p.input_ids) for p in prompts]
    max_model_len = max(len(p.input_ids) for p in prompts) + generation.max_new_tokens + 16
    results = {}

    def timed(engine) -> list[list[int]]:
        begin = time.perf_counter()
        replies = engine.generate(requests, seed=0)
        seconds = time.perf_counter() - begin
        results[engine.describe()["engine"]] = {"seconds": seconds, "tokens": sum(map(len, replies)), "tokens_per_second": sum(map(len, replies)) / seconds}
        return replies

    local = timed(engine_for(target, dataclasses.replace(generation, engine="local")))
    with vllm_server(python, target_dir, target.dtype, max_model_len, out.with_suffix(".log"), cfg.timeout_s) as url:
        served = dataclasses.replace(generation, engine="server", servers=[ServerConfig(url=url, model="target")])
        server = timed(engine_for(target, served))
    summary = {
        "prompts": len(requests),
        "max_new_tokens": generation.max_new_tokens,
        "dtype": str(target.dtype).removeprefix("torch."),
        "local": results["local"],
        "vllm": results["server"],
        "identical_replies": sum(a == b for a, b in zip(local, server)),
        "faster": "vllm" if results["server"]["tokens_per_second"] > results["local"]["tokens_per_second"] else "local",
    }
    atomic_write_text(out, json.dumps(summary, indent=2) + "\n")
    return summary
