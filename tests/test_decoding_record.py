"""Every arm of an evaluation decodes config/test.yaml's tiny chat target to the tokens, acceptance lengths, verified
lengths and gate choices recorded in ``tests/data/decoding_record.json``: a change to how decoding is organised
must not change what it does.

In float64, where no CPU's rounding flips a greedy token; with a fixed verify cost (``PaidCost`` with no weight for
what is paid: timings never reach a decision) and fixed calibrations, so that every choice is a function of the
models alone. Three settings: the drafter gated, gated as a tree of two choices per position, and ungated.

Re-record only for a deliberate change of behaviour: ``python tests/test_decoding_record.py --record``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from conftest import build_drafter
from tiny_chat_target import build_tiny_inputs

from dflash.decoding.arms import Shared, decode_arms, evaluation_arms
from dflash.decoding.calibration import Calibration
from dflash.decoding.drafter import draft_head
from dflash.decoding.gate import PaidCost, VerifyCost
from dflash.decoding.lookup import PromptLookup
from dflash.target import Target

RECORD = Path(__file__).parent / "data" / "decoding_record.json"
MAX_NEW_TOKENS = 24
BLOCK_SIZE = 4
# Widths 1..7 (the two-branch tree's 1 + 3 x 2, and lookup's 1 + 6): cheap enough that the gate often verifies.
COST = VerifyCost((1.0, 1.02, 1.04, 1.06, 1.1, 1.14, 1.2))
SETTINGS = {"gated": {"gate": True, "branches": 1}, "tree": {"gate": True, "branches": 2}, "ungated": {"gate": False, "branches": 1}}


def graded(low: float, high: float) -> Calibration:
    """Acceptance ``low`` below a top probability of 0.3, ``high`` above, at every position."""
    return Calibration(upper=[[0.3, 1.0]] * 16, rates=[[low, high]] * 16, counts=[[1, 1]] * 16)


def decode_every_arm() -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        tiny = build_tiny_inputs(Path(scratch) / "tiny")
        target = Target.load(str(tiny / "target"), dtype=torch.float64)
        prompts = [json.loads(line)["messages"] for line in (tiny / "eval_prompts.jsonl").read_text().splitlines()]
    drafter = build_drafter(target.config, seed=0, block_size=BLOCK_SIZE, num_hidden_layers=1).double()
    calibration = graded(0.3, 0.6)
    calibration.runner_up = [graded(0.2, 0.5)]
    record = {}
    for name, setting in SETTINGS.items():
        shared = Shared(
            target=target,
            drafter=drafter,
            block_size=BLOCK_SIZE,
            lookup=PromptLookup(num_tokens=6, max_ngram=3),
            cost=PaidCost(COST, prior_weight=None),
            calibration=calibration,
            head=draft_head(target, drafter),
            draft_cost=0.05,
            branches=setting["branches"],
        )
        record[name] = []
        for messages in prompts:
            ids = torch.tensor([target.chat_prompt_ids(messages)])
            decoded = decode_arms(evaluation_arms(setting["gate"]), shared, ids, MAX_NEW_TOKENS)
            record[name].append({arm: outcome(generation) for arm, generation in decoded.items()})
    return record


def outcome(generation) -> dict:
    stats = generation.stats
    return {
        "tokens": generation.tokens.tolist(),
        "acceptance_lengths": stats.acceptance_lengths,
        "verified": stats.verified,
        "choices": dict(sorted(stats.choices.items())),
        "consulted": dict(sorted(stats.consulted.items())),
    }


def test_every_arm_decodes_as_recorded():
    recorded = json.loads(RECORD.read_text())
    decoded = json.loads(json.dumps(decode_every_arm()))
    assert decoded.keys() == recorded.keys()
    for setting in recorded:
        for prompt, (now, then) in enumerate(zip(decoded[setting], recorded[setting], strict=True)):
            for arm in then:
                assert now[arm] == then[arm], f"{setting}, prompt {prompt}, arm {arm}"
    # The record exercises what it guards: drafts accepted, lookup taken by the hybrid, trees verified.
    steps = [o for s in recorded.values() for p in s for o in p.values()]
    assert any(length > 1 for o in steps for length in o["acceptance_lengths"])
    assert any("lookup" in key for p in recorded["gated"] for key in p["hybrid"]["choices"])
    assert any(v > BLOCK_SIZE - 1 for p in recorded["tree"] for v in p["dflash"]["verified"])


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: python {sys.argv[0]} --record")
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(decode_every_arm(), indent=1) + "\n")
    print(f"recorded {RECORD}")
