"""The verify-length gate, the calibration, prompt lookup's confidence, the hybrid, and the packed linears."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import build_drafter, build_target, qwen3_config, random_prompt
from test_decode import constant_drafter, constant_target, greedy
from transformers import DynamicCache

from dflash.decoding.calibration import Calibration, acceptance_lengths
from dflash.decoding.drafter import DFlashProposer, draft_head
from dflash.decoding.gate import GatedProposer, PaidCost, Throughput, VerifyCost
from dflash.decoding.generate import speculative_generate
from dflash.decoding.lookup import LookupConfidence, PromptLookup, PromptLookupProposer
from dflash.decoding.proposal import Proposal, merge, path_values
from dflash.errors import PreflightError
from dflash.kernels import PackedLinear, draft_linears, int8_kernel_available, kernel_of, pack_linears, packed_kernel_available, resolve_draft_kernel
from dflash.step import BlockOutcomes
from dflash.target import native_bf16

# -- the gate ----------------------------------------------------------------------------------------------


def test_gate_proposes_nothing_without_confidence_and_the_whole_block_with_full_confidence():
    cost = VerifyCost((1.0, 1.2, 1.3, 1.5))
    assert cost.best_length([0.0, 0.0, 0.0]) == (0, 0.0)  # a plain step earns exactly its cost at rate 1
    # Full confidence: 4 tokens for 1.5 steps (surplus 2.5) beats 3 for 1.3 (1.7), 2 for 1.2 (0.8) and 1 for 1.0 (0).
    assert cost.best_length([1.0, 1.0, 1.0]) == (3, pytest.approx(2.5))
    assert cost.best_length([1.0, 1.0, 1.0], rate=2.0) == (3, pytest.approx(4 - 2 * 1.5))
    # A verify that costs a step per token never pays, however sure the drafter is; ties go to the shorter verify.
    assert VerifyCost((1.0, 2.0, 3.0)).best_length([1.0, 1.0]) == (0, 0.0)


def test_gate_weighs_expected_tokens_against_cost_at_the_rate_decoding_gets():
    cost = VerifyCost((1.0, 1.2, 1.3))
    # q = (0.5, 0.5): E = 1, 1.5, 1.75 for 0, 1, 2 tokens. At rate 1 the surpluses are 0, 0.3, 0.45.
    assert cost.best_length([0.5, 0.5]) == (2, pytest.approx(0.45))
    # At rate 3 the step's 0.75 tokens more for 0.3 steps more (2.5 a step) earn less than decoding already does.
    assert cost.best_length([0.5, 0.5], rate=3.0) == (0, pytest.approx(-2.0))
    # q = (0.15, 0): 0.15 tokens more for 0.2 steps more: stay silent.
    assert cost.best_length([0.15, 0.0])[0] == 0
    # So too when 0.5 step of drafting is already spent, where the ratio E / cost would verify (1.15 / 1.7 > 1 / 1.5).
    assert cost.best_length([0.15, 0.0], draft_cost=0.5)[0] == 0
    # A long confident chain: the fourth token adds 0.3645 tokens for 0.2 steps, more than rate 1.5 earns, so it is
    # verified, where the ratio would stop at three (3.439 / 1.3 = 2.65 > 3.8035 / 1.5 = 2.54).
    long = VerifyCost((1.0, 1.1, 1.2, 1.3, 1.5))
    assert long.best_length([0.9, 0.9, 0.9, 0.5], rate=1.5) == (4, pytest.approx(3.8035 - 1.5 * 1.5))
    assert long.best_length([0.9, 0.9, 0.9, 0.5], rate=2.5)[0] == 3  # 0.3645 / 0.2 < 2.5
    assert path_values([0.5, 0.5]) == [0.5, 0.25]


def test_the_throughput_starts_at_a_plain_steps_rate_and_follows_what_decoding_commits():
    throughput = Throughput()
    assert throughput.rate == 1.0
    throughput.update(tokens=24, cost=8.0)
    assert throughput.rate == pytest.approx((24 + 8) / (8 + 8))


def test_verify_is_padded_to_the_cheapest_width_at_or_above_the_wanted_one():
    cost = VerifyCost((1.0, 1.7, 2.3, 1.4))  # a BLAS whose 4-row product is cheaper than its 2- and 3-row ones
    assert [cost.width(k) for k in (1, 2, 3, 4)] == [1, 4, 4, 4]
    assert cost.relative[cost.width(2) - 1] == 1.4
    # One confident token is verified at width 4 with two more draft tokens: E = 1 + .9 + .9*.2 + .9*.2*.1.
    assert cost.best_length([0.9, 0.2, 0.1]) == (3, pytest.approx(1 + 0.9 + 0.18 + 0.018 - 1.4))
    # Past the proposal's end the padding expects nothing: one token, width 4.
    assert cost.best_length([0.9]) == (3, pytest.approx(1.9 - 1.4))
    with pytest.raises(ValueError):
        VerifyCost((1.0, -1.0))


def test_gate_takes_a_trees_most_likely_tokens_each_after_its_parent():
    cost = VerifyCost((1.0, 1.1, 1.2, 1.3, 2.0))
    # A chain a b c (values .6 .3 .15), d an alternative to a (.3), e to b (.6 x .2 = .12).
    tree = Proposal([10, 11, 12, 13, 14], accept=[0.6, 0.5, 0.5, 0.3, 0.2], parents=[-1, 0, 1, -1, 0], source="dflash")
    assert tree.values() == pytest.approx([0.6, 0.3, 0.15, 0.3, 0.12])
    # E - cost: 1 token 1.6 - 1.1, 2 tokens (a, d: the shallower of equals first) 1.9 - 1.2, 3 (b too) 2.2 - 1.3, 4 2.35 - 2.
    chosen = GatedProposer([], cost).choose(tree, 4, 0.0, last=9, rate=1.0)
    assert chosen == Proposal([10, 13, 11], accept=[0.6, 0.3, 0.5], parents=[-1, -1, 0], source="dflash", own=3)
    # A cheaper 5-wide verify makes 4 tokens pay (2.35 - 1.35), the last one c, after b.
    cheaper = GatedProposer([], VerifyCost((1.0, 1.1, 1.2, 1.3, 1.35)))
    assert cheaper.choose(tree, 4, 0.0, last=9, rate=1.0) == Proposal(
        [10, 13, 11, 12], accept=[0.6, 0.3, 0.5, 0.5], parents=[-1, -1, 0, 2], source="dflash", own=4
    )
    assert cheaper.choose(tree, 2, 0.0, last=9, rate=1.0).tokens == [10, 13]  # at most the count asked for
    # A token the drafter cannot be right about is not verified, whatever was paid to draft it.
    assert GatedProposer([], cost).choose(Proposal([10], accept=[0.0], source="dflash"), 4, 3.0, last=9, rate=1.0).tokens == []
    # A table whose 2-wide verify costs less than a plain step pads even an empty proposal, with the last token.
    padded = GatedProposer([], VerifyCost((1.0, 0.9))).choose(Proposal([], accept=[], source="lookup"), 1, 0.0, last=9, rate=1.0)
    assert padded.tokens == [9] and padded.own == 0


def test_merged_proposals_share_a_path_and_keep_its_highest_probability():
    lookup = Proposal([5, 6], accept=[0.8, 0.5], source="lookup")
    drafter = Proposal([5, 7, 9], accept=[0.5, 0.5, 0.2], parents=[-1, 0, -1], source="dflash")
    tree = merge([lookup, drafter])
    assert tree.tokens == [5, 6, 7, 9] and tree.parents == [-1, 0, 0, -1] and tree.source == "lookup+dflash"
    assert tree.values() == pytest.approx([0.8, 0.4, 0.25, 0.2])
    assert tree.origins == [frozenset({"lookup", "dflash"}), frozenset({"lookup"}), frozenset({"dflash"}), frozenset({"dflash"})]


class FixedProposer:
    """A candidate that proposes the same tree every step."""

    needs_hidden_states = False

    def __init__(self, name: str, proposal: Proposal, draft_cost: float = 0.0):
        self.name, self.proposal, self.draft_cost = name, proposal, draft_cost

    def observe(self, hidden_states, count: int, start: int) -> None:
        pass

    def propose(self, tokens: list[int], count: int) -> Proposal:
        return self.proposal

    def ceiling(self, count: int):
        return None

    def feedback(self, proposal: Proposal, path: list[int]) -> None:
        pass


def test_hybrid_verifies_lookup_and_the_drafter_together_and_tells_lookup_of_its_own_tokens():
    confidence = LookupConfidence()
    for k in (1, 2):
        confidence.tried[1, k], confidence.accepted[1, k] = 8, 6  # (6 + 1) / (8 + 2) = 0.7 for each of 2 tokens
    lookup = PromptLookupProposer(PromptLookup(2), confidence)
    drafter = FixedProposer("dflash", Proposal([4, 8], accept=[0.5, 0.0], parents=[-1, -1], source="dflash"))
    gated = GatedProposer([lookup, drafter], VerifyCost((1.0, 1.0, 1.0, 1.0)))
    # Lookup proposes 3 4 (after the earlier 9) at .7 and .49; the drafter's 4 and 8 at .5 and 0: a flat cost takes
    # the three likeliest, lookup's 3, the drafter's 4 beside it, then lookup's 4.
    proposal = gated.propose([9, 3, 4, 2, 9], 3)
    assert proposal.tokens == [3, 4, 4] and proposal.parents == [-1, -1, 0] and proposal.source == "lookup+dflash"
    assert proposal.origins == [frozenset({"lookup"}), frozenset({"dflash"}), frozenset({"lookup"})]
    # The target took the drafter's 4: lookup hears that its 2 tokens were verified and none accepted.
    gated.feedback(proposal, [1])
    assert confidence.tried[1, 1] == 9 and confidence.accepted[1, 1] == 6 and confidence.tried[1, 2] == 8
    gated.propose([9, 3, 4, 2, 9], 3)
    gated.feedback(proposal, [0, 2])  # lookup's both
    assert (confidence.tried[1, 1], confidence.accepted[1, 1], confidence.tried[1, 2], confidence.accepted[1, 2]) == (10, 7, 9, 7)


def _ranked_fixed(q: float, runner_up: float) -> Calibration:
    calibration = _fixed(q)
    calibration.runner_up = [_fixed(runner_up)]
    return calibration


def test_a_gated_drafter_tree_is_lossless_and_its_alternatives_are_accepted():
    """An 8-token vocabulary makes the drafter's second choices right often: the gate verifies them beside its first
    (a flat cost pays for every token), and decoding stays the target's own."""
    target = _vocab8_target()
    drafter = build_drafter(target.config, seed=3, init_std=0.2, mask_token_id=7)
    cost = VerifyCost((1.0,) * 7)
    accepted_alternatives = 0
    for length, seed in ((5, 0), (8, 1), (11, 2)):
        ids = torch.randint(0, 7, (1, length), generator=torch.Generator().manual_seed(seed))
        tree = DFlashProposer(target, drafter, _ranked_fixed(0.6, 0.3), branches=2, depth=3)
        gen = speculative_generate(target, GatedProposer([tree], cost), ids, 32)
        assert gen.tokens.tolist() == greedy(target, ids, 32)
        assert max(gen.stats.verified) == 6  # the whole tree: 3 first choices and 3 second ones
        accepted_alternatives += sum(p == 0.3 and a for _, p, a in gen.stats.predictions)
    assert accepted_alternatives > 0
    with pytest.raises(ValueError, match="2 most probable"):
        DFlashProposer(target, drafter, _fixed(0.6), branches=2)


# -- calibration and τ -------------------------------------------------------------------------------------


def test_calibration_is_monotone_and_conditions_on_the_accepted_prefix():
    # Position 1: probabilities 0.1..0.8, correct at 0.2 but not 0.3 (a violation the pooling merges).
    probs = torch.tensor([[0.1, 0.9], [0.2, 0.9], [0.3, 0.9], [0.4, 0.9], [0.7, 0.9], [0.8, 0.9]])
    correct = torch.tensor([[0, 0], [1, 1], [0, 0], [0, 0], [1, 1], [1, 0]], dtype=torch.bool)
    counted = torch.ones_like(correct)
    cal = Calibration.fit(probs, correct, counted, bins=6)
    # Bins of one: 0,1,0,0,1,1 → pooled until the rates rise strictly: [0] [1,0,0]=1/3 [1,1].
    assert cal.rates[0] == pytest.approx([0.0, 1 / 3, 1.0])
    assert cal.counts[0] == [1, 3, 2] and cal.upper[0] == pytest.approx([0.1, 0.4, 0.8])
    assert cal([0.05, 0.9]) == pytest.approx([0.0, 2 / 3])
    assert cal([0.35])[0] == pytest.approx(1 / 3) and cal([0.99])[0] == 1.0
    # Position 2 sees only the blocks whose position 1 was correct (rows 1, 4, 5): 2 of 3 accepted.
    assert sum(cal.counts[1]) == 3 and cal([0.5, 0.9])[1] == pytest.approx(2 / 3)


def test_calibration_round_trips_and_rejects_a_foreign_file(tmp_path):
    cal = Calibration(upper=[[0.5, 1.0]], rates=[[0.1, 0.6]], counts=[[4, 4]])
    cal.save(tmp_path / "calibration.json")
    assert Calibration.load(tmp_path / "calibration.json") == cal
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a calibration"):
        Calibration.load(tmp_path / "bad.json")


def test_runner_up_calibration_conditions_on_the_first_choices_before_it(tmp_path):
    # Blocks [4, 2 positions, 2 ranks]: is the first choice, and the second, the target's token?
    first = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=torch.bool)
    second = torch.tensor([[0, 1], [1, 1], [0, 0], [0, 0]], dtype=torch.bool)
    correct = torch.stack([first, second], dim=-1)
    probs = torch.stack([torch.full((4, 2), 0.6), torch.full((4, 2), 0.2)], dim=-1)
    cal = Calibration.fit_ranked(probs, correct, torch.ones(4, 2, dtype=torch.bool), bins=1)
    assert cal.rates == [[0.5], [0.5]]  # position 2 over blocks 1 and 3, whose first choice at 1 was right
    # The second choice at position 2 also over blocks 1 and 3 (block 2's is right, but its first at 1 was not).
    assert len(cal.runner_up) == 1 and cal.runner_up[0].rates == [[0.25], [0.5]]
    cal.save(tmp_path / "calibration.json")
    assert Calibration.load(tmp_path / "calibration.json") == cal


def test_predicted_tau_of_a_gated_tree_counts_an_accepted_alternative():
    from dflash.evaluate import predicted_tau

    # 5 blocks of 3 positions; the last is not labelled at its first position, so it does not count.
    first = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    second = torch.tensor([[0, 0, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.bool)
    counted = torch.ones(5, 3, dtype=torch.bool)
    counted[4, 0] = False
    outcomes = BlockOutcomes(
        correct=first,
        counted=counted,
        confidence=torch.full((5, 3), 0.9),
        runner_up_correct=second[..., None],
        runner_up_confidence=torch.full((5, 3, 1), 0.05),
    )
    calibration = _ranked_fixed(0.6, 0.3)
    # A flat cost verifies all 6 tokens: τ = 1 + the run of first choices + 1 where the next one's alternative is right.
    flat = predicted_tau(outcomes, calibration, VerifyCost((1.0,) * 7), 0.0, branches=2)
    # Its rate: 9 tokens over 4 verifies of one step each.
    assert flat == {"tau": pytest.approx((3 + 1 + 1 + 2) / 4), "tau_gated": pytest.approx((4 + 2 + 1 + 2) / 4), "rate_gated": pytest.approx(9 / 4)}
    # A cost that pays for one token only: the first choice at position 1, for 1.05 steps; at the rate that gets
    # (6 / 4.2), one token still earns more (1.6 - 1.5) than none (1 - 1.43).
    one = predicted_tau(outcomes, calibration, VerifyCost((1.0, 1.05) + (5.0,) * 5), 0.0, branches=2)
    assert one["tau_gated"] == pytest.approx((2 + 1 + 1 + 2) / 4) and one["rate_gated"] == pytest.approx(6 / 4.2)


def test_training_tau_is_the_cumulative_product_of_correctness():
    # Blocks of 3 draft positions: τ = 1 + the run of correct positions from the first.
    correct = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    counted = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    assert acceptance_lengths(correct, counted).tolist() == [4, 2, 1, 3, 3]
    assert acceptance_lengths(correct, counted, torch.tensor([1, 3, 3, 0, 2])).tolist() == [2, 2, 1, 1, 3]
    # A block whose first position is not labelled (padding) does not count.
    outcomes = BlockOutcomes(
        correct=torch.cat([correct, torch.zeros(1, 3, dtype=torch.bool)]),
        counted=torch.cat([counted, torch.zeros(1, 3, dtype=torch.bool)]),
        confidence=torch.zeros(6, 3),
    )
    assert outcomes.tau_sums() == (13.0, 5)
    assert outcomes.accuracy() == pytest.approx([4 / 5, 4 / 5, 3 / 4])


def test_lookup_confidence_counts_acceptance_by_match_length_and_position():
    confidence = LookupConfidence()
    assert confidence(3, 2) == [0.5, 0.5]  # nothing seen yet
    confidence.update(match=3, verified=3, accepted=1)  # position 1 accepted, 2 rejected, 3 never reached
    confidence.update(match=3, verified=3, accepted=3)
    assert confidence(3, 3) == pytest.approx([3 / 4, 2 / 4, 2 / 3])
    assert confidence(1, 1) == [0.5]


# -- gated and hybrid decoding -----------------------------------------------------------------------------


def _fixed(q: float) -> Calibration:
    """A calibration that maps every probability at positions 1..16 to ``q``."""
    return Calibration(upper=[[1.0]] * 16, rates=[[q]] * 16, counts=[[1]] * 16)


def test_gated_drafter_without_confidence_decodes_step_by_step_and_with_full_confidence_drafts_whole_blocks():
    target = constant_target()
    drafter = constant_drafter(target, +1.0, block_size=8)  # the oracle: always right
    ids = random_prompt(5, 30)
    cost = VerifyCost((1.0,) + (1.5,) * 7)
    quiet = Throughput()
    silent = speculative_generate(target, GatedProposer([DFlashProposer(target, drafter, _fixed(0.0))], cost, quiet), ids, 17)
    assert silent.stats.verified == [0] * 16 and silent.stats.acceptance_lengths == [1] * 16
    assert silent.stats.consulted["dflash"] == 0  # a drafter that can never pay for itself is not run
    assert (quiet.tokens, quiet.cost, quiet.rate) == (16, 16.0, 1.0)  # every plain step heard: a token for a step
    busy = Throughput()
    sure = speculative_generate(target, GatedProposer([DFlashProposer(target, drafter, _fixed(1.0))], cost, busy), ids, 17)
    assert sure.stats.verified == [7, 7] and sure.stats.acceptance_lengths == [8, 8] and sure.stats.consulted["dflash"] == 2
    assert (busy.tokens, busy.cost) == (16, 3.0) and busy.rate == pytest.approx(24 / 11)
    assert silent.tokens.tolist() == sure.tokens.tolist() == greedy(target, ids, 17)
    # Every verified position after an accepted prefix is recorded with its prediction.
    assert sure.stats.predictions[:7] == [(k, 1.0, True) for k in range(1, 8)]


def _vocab8_target():
    return build_target(qwen3_config(vocab_size=8, eos_token_id=None, pad_token_id=0), seed=0)


def test_hybrid_is_lossless_where_lookup_matches_and_where_it_does_not():
    """An 8-token vocabulary makes lookup matches frequent; the 128-token target rarely repeats. The drafter's
    confidence ranges from below lookup's prior (lookup is taken) to certainty (the drafter is)."""
    cost = VerifyCost((1.0, 1.1, 1.2, 1.3, 1.4))
    choices = {"lookup": 0, "dflash": 0}
    cases = [
        (target, prompts, q)
        for target, prompts in ((_vocab8_target(), ((5, 0), (11, 2))), (build_target(qwen3_config(), seed=1), ((3, 10), (24, 13))))
        for q in (0.2, 0.6, 1.0)
    ]
    for target, prompts, q in cases:
        drafter = build_drafter(target.config, seed=3, init_std=0.2, mask_token_id=target.config.vocab_size - 1)
        confidence = LookupConfidence()
        for length, seed in prompts:
            ids = torch.randint(1, min(7, target.config.vocab_size - 1), (1, length), generator=torch.Generator().manual_seed(seed))
            hybrid = GatedProposer([DFlashProposer(target, drafter, _fixed(q)), PromptLookupProposer(PromptLookup(4), confidence)], cost)
            gen = speculative_generate(target, hybrid, ids, 24)
            assert gen.tokens.tolist() == greedy(target, ids, 24), (q, length, seed)
            for source in choices:
                choices[source] += gen.stats.choices[source]
    assert choices["lookup"] > 0 and choices["dflash"] > 0, choices


def test_hybrid_keeps_the_drafter_cache_current_when_lookup_is_taken():
    """Whichever proposal is taken, the drafter has seen every committed position exactly once."""
    target = _vocab8_target()
    drafter = build_drafter(target.config, seed=3, init_std=0.2, mask_token_id=7)
    inner = DFlashProposer(target, drafter, _fixed(0.0))  # never taken: lookup wins every step it matches
    lookup = PromptLookupProposer(PromptLookup(4), LookupConfidence())
    ids = torch.randint(1, 7, (1, 9), generator=torch.Generator().manual_seed(4))
    gen = speculative_generate(target, GatedProposer([inner, lookup], VerifyCost((1.0, 1.05, 1.1, 1.15, 1.2))), ids, 20)
    assert gen.stats.choices["lookup"] > 0 and gen.stats.choices["dflash"] == 0
    # The cache holds every position up to the last committed one, which the next proposal feeds as its block's first.
    assert inner.cache.length + (0 if inner.context is None else inner.context.shape[1]) == 9 + len(gen.tokens) - 1


def test_hybrid_runs_the_drafter_only_where_it_can_beat_lookup_and_its_cache_catches_up():
    """Lookup, proven right on every match, leaves a drafter whose confidence is at most 0.6 out of reach: the drafter
    runs only on steps without a match, and when it does, it proposes what a drafter run on every step would."""
    target = _vocab8_target()
    drafter = build_drafter(target.config, seed=3, init_std=0.2, mask_token_id=7)
    confidence = LookupConfidence()
    for k in range(1, 5):
        confidence.tried[1, k] = confidence.accepted[1, k] = 50  # lookup's tokens after a 1-token match: 51/52
    inner = DFlashProposer(target, drafter, _fixed(0.6))
    hybrid = GatedProposer([PromptLookupProposer(PromptLookup(4), confidence), inner], VerifyCost((1.0, 1.05, 1.1, 1.15, 1.2)))
    inner.draft_cost = hybrid.draft_cost = 0.05
    ids = torch.randint(1, 7, (1, 9), generator=torch.Generator().manual_seed(4))
    gen = speculative_generate(target, hybrid, ids, 20)
    steps = len(gen.stats.acceptance_lengths)
    assert gen.tokens.tolist() == greedy(target, ids, 20)
    assert 0 < gen.stats.consulted["dflash"] < steps and gen.stats.consulted["lookup"] == steps
    # The skipped drafter's next proposal equals that of one that saw the same context in a single prefill.
    tokens = ids[0].tolist() + gen.tokens.tolist()
    fresh = DFlashProposer(target, drafter)
    out = target.forward(torch.tensor([tokens[:-1]]), DynamicCache(config=target.config), output_hidden_states=True)
    fresh.observe(out.hidden_states, len(tokens) - 1, 0)
    assert inner.propose(tokens, 4).tokens == fresh.propose(tokens, 4).tokens


def test_gated_proposer_pads_a_short_lookup_to_the_cheapest_width():
    cost = VerifyCost((1.0, 1.7, 2.3, 1.4))
    lookup = PromptLookupProposer(PromptLookup(3), LookupConfidence())
    gated = GatedProposer([lookup], cost)
    proposal = gated.propose([9, 7, 7], 3)  # the earlier "7" was followed by one 7 only: padded with 7 to width 4
    assert proposal == Proposal([7, 7, 7], accept=[0.5, 0.0, 0.0], source="lookup", own=1, consulted=("lookup",), origins=[frozenset({"lookup"})])


def test_a_gated_drafter_needs_a_calibration(qwen3_target, qwen3_drafter):
    with pytest.raises(ValueError, match="calibration"):
        speculative_generate(qwen3_target, GatedProposer([DFlashProposer(qwen3_target, qwen3_drafter)], VerifyCost((1.0, 1.1))), random_prompt(4, 0), 4)


# -- packed linears ----------------------------------------------------------------------------------------

needs_packed = pytest.mark.skipif(not packed_kernel_available(torch.device("cpu"), torch.float32), reason="oneDNN packed linear is not row-invariant here")


@needs_packed
def test_packed_linear_matches_linear_and_gives_every_row_the_same_bits_at_any_row_count():
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear(linear)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        out = packed(x)
        assert torch.allclose(out, linear(x), atol=1e-5)
        rows = x.reshape(-1, 64)
        assert all(torch.equal(packed(rows[i : i + k]), out.reshape(-1, 48)[i : i + k]) for k in (1, 2, 3, 4) for i in range(0, 14))
    assert packed.weight is linear.weight and "packed" not in packed.state_dict()


@needs_packed
def test_a_packed_target_decodes_losslessly_and_keeps_its_tied_head():
    target = build_target(qwen3_config(tie_word_embeddings=True), seed=5)
    drafter = build_drafter(target.config, seed=3, init_std=0.2)
    ids = random_prompt(11, 11)
    expected = greedy(target, ids, 21)
    assert pack_linears(target.model) == 6 * 7 + 1 and pack_linears(drafter) > 0
    assert isinstance(target.lm_head, PackedLinear) and target.lm_head.weight is target.model.get_input_embeddings().weight
    for block_size in (1, 4, 8):
        assert speculative_generate(target, drafter, ids, 21, block_size=block_size).tokens.tolist() == expected


needs_int8 = pytest.mark.skipif(not int8_kernel_available(torch.device("cpu"), torch.float32), reason="no int8 dynamic-quantization linear here")


@needs_int8
def test_an_int8_drafter_stays_close_to_its_float_self_and_decoding_stays_lossless():
    target = build_target(qwen3_config(), seed=5)
    drafter = build_drafter(target.config, seed=3, init_std=0.2)
    # A massive activation on a channel the drafter ignores, as target hidden states have: an int8 activation scale
    # for the whole tensor would round every other channel to zero, so fc stays float.
    features = torch.randn(1, 6, drafter.config.feature_width)
    features[..., 7] = 3e4
    with torch.no_grad():
        drafter.fc.weight[:, 7] = 0.0
    quantized = copy.deepcopy(drafter)
    assert draft_linears(quantized, "int8") == "int8" and kernel_of(quantized.layers) == "int8"
    assert kernel_of(quantized.fc) == ("packed" if packed_kernel_available(torch.device("cpu"), torch.float32) else "default")
    block = target.embed(torch.tensor([[3] + [drafter.mask_token_id] * 3]))
    with torch.no_grad():
        exact = drafter(features, block, torch.arange(6)[None], torch.arange(6, 10)[None])
        approx = quantized(features, block, torch.arange(6)[None], torch.arange(6, 10)[None])
        assert (approx - exact).norm() <= 0.1 * exact.norm()
        logits = exact @ target.lm_head.weight.t()
        assert (draft_head(target, quantized)(exact) - logits).norm() <= 0.02 * logits.norm()
    ids = random_prompt(11, 11)
    assert speculative_generate(target, quantized, ids, 21, block_size=4).tokens.tolist() == greedy(target, ids, 21)
    assert quantized.dtype == torch.float32  # the norms keep the drafter's float dtype


needs_native_bf16 = pytest.mark.skipif(
    not (native_bf16(torch.device("cpu")) and packed_kernel_available(torch.device("cpu"), torch.bfloat16)), reason="no native bf16 on this CPU"
)


def test_without_native_bf16_the_drafter_decodes_in_fp32_and_never_in_int8_unasked(monkeypatch):
    monkeypatch.setattr("dflash.target.native_bf16", lambda device: False)
    drafter = build_drafter(build_target(qwen3_config(), seed=5).config, seed=3)
    assert resolve_draft_kernel(drafter) == ("packed" if packed_kernel_available(torch.device("cpu"), torch.float32) else "default")
    with pytest.raises(PreflightError, match="eval.draft_kernel: the bf16 linear kernel needs a CPU that computes bf16 natively"):
        draft_linears(drafter, "bf16")


@needs_native_bf16
def test_the_drafter_decodes_in_bf16_where_the_cpu_computes_it_natively():
    target = build_target(qwen3_config(), seed=5)
    drafter = build_drafter(target.config, seed=3, init_std=0.2)
    half = copy.deepcopy(drafter)
    assert draft_linears(half, "auto") == "bf16"
    assert half.dtype == torch.bfloat16 and kernel_of(half.layers) == "packed" and kernel_of(half.fc) == "packed"
    features = torch.randn(1, 6, drafter.config.feature_width)
    block = target.embed(torch.tensor([[3] + [drafter.mask_token_id] * 3]))
    with torch.no_grad():  # fp32 inputs, as decoding gives them; bf16 keeps about 3 significant digits
        exact = drafter(features, block, torch.arange(6)[None], torch.arange(6, 10)[None])
        approx = half(features, block, torch.arange(6)[None], torch.arange(6, 10)[None])
        assert approx.dtype == torch.bfloat16 and (approx.float() - exact).norm() <= 0.02 * exact.norm()
        logits, exact_logits = draft_head(target, half)(exact), draft_head(target, drafter)(exact)
        assert logits.dtype == torch.bfloat16 and (logits.float() - exact_logits).norm() <= 0.02 * exact_logits.norm()
    ids = random_prompt(11, 11)
    assert speculative_generate(target, half, ids, 21, block_size=4).tokens.tolist() == greedy(target, ids, 21)


def test_pack_linears_leaves_the_model_alone_where_asked_or_unavailable():
    target = build_target(qwen3_config(), seed=5)
    assert pack_linears(target.model, "default") == 0
    half = torch.nn.Linear(8, 8).to(torch.float16)
    assert pack_linears(half) == 0
    with pytest.raises(PreflightError, match="eval.linear_kernel: the packed linear kernel needs"):
        pack_linears(half, "packed")


def test_the_verify_cost_is_learnt_from_what_decoding_pays_with_the_measured_table_as_a_prior():
    """Each verify timed against the prompt's plain step; per width, the median paid blended with the prior, which
    counts as ``prior_weight`` verifies; a width never verified keeps its prior."""
    prior = VerifyCost((1.0, 1.5, 2.0), step_ms=100.0)
    cost = PaidCost(prior, prior_weight=2)
    assert cost.table() == prior and cost.paid_table() == {}
    cost.record([0, 0, 0], [0.10, 0.12, 0.08], step_seconds=0.1)  # a baseline: its own step's median is 0.1
    cost.record([1, 1, 0], [0.10, 0.10, 0.10], step_seconds=0.1)
    assert cost.paid_table() == {1: {"relative": pytest.approx(1.0), "verifies": 4}, 2: {"relative": pytest.approx(1.0), "verifies": 2}}
    # Width 1: (4 x 1.0 + 2 x 1.0) / 6; width 2: (2 x 1.0 + 2 x 1.5) / 4 = 1.25; width 3: never verified, 2.0.
    assert cost.table().relative == pytest.approx((1.0, 1.25, 2.0)) and cost.table().step_ms == 100.0
    # Timed against another prompt's slower step: the same seconds are fewer of its steps.
    cost.record([2], [0.3], step_seconds=0.2)
    assert cost.table().relative[2] == pytest.approx((1 * 1.5 + 2 * 2.0) / 3)
    assert PaidCost(prior, prior_weight=None).table() == prior  # never updated
    with pytest.raises(ValueError):
        cost.record([0, 1], [0.1], step_seconds=0.1)  # a verify without its time


def test_the_gate_decides_with_the_cost_decoding_paid():
    """A table measured flatter than decoding pays has the gate verify three tokens of 0.3 confidence; once wide
    verifies are seen to cost two steps, it verifies none."""
    cost = PaidCost(VerifyCost((1.0, 1.0, 1.0, 1.0)), prior_weight=0)
    assert cost.table().best_length([0.3, 0.3, 0.3])[0] == 3  # E = 1.417 tokens for one step
    for drafted in (1, 2, 3):
        cost.record([0, drafted], [0.1, 0.2], step_seconds=0.1)
    assert cost.table().relative == pytest.approx((1.0, 2.0, 2.0, 2.0))
    assert cost.table().best_length([0.3, 0.3, 0.3]) == (0, 0.0)  # 1.417 - 2 < 0


def test_the_evaluation_teaches_the_cost_every_arms_verifies_and_stays_lossless():
    """One prompt through every arm: each verify of each arm recorded against the baseline's median step (so the
    baseline's own median is one step), and every arm's output the baseline's."""
    from dflash.decoding.arms import Shared, decode_arms, evaluation_arms

    target = build_target(qwen3_config(eos_token_id=None), seed=1)  # decodes to the token limit
    drafter = build_drafter(target.config, seed=3, init_std=0.2, block_size=4)
    cost = PaidCost(VerifyCost((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6)), prior_weight=4)
    calibration = _fixed(0.5)
    calibration.runner_up = [_fixed(0.2)]
    shared = Shared(target, drafter, 4, PromptLookup(3), cost, calibration, head=draft_head(target, drafter), branches=2)
    ids = random_prompt(12, 7)
    generations = decode_arms(evaluation_arms(gate=True), shared, ids, 16)
    assert list(generations) == ["baseline", "dflash", "lookup", "hybrid"]
    assert all(g.tokens.tolist() == generations["baseline"].tokens.tolist() for g in generations.values())
    assert sum(d["verifies"] for d in cost.paid_table().values()) == sum(len(g.stats.verified) for g in generations.values())
    # 15 plain steps (the prefill gives the first token) of which the middle one is the median: one step exactly.
    plain = cost.paid[1][:15]
    assert len(generations["baseline"].stats.verified) == 15 and sorted(plain)[7] == pytest.approx(1.0)


def test_the_evaluation_measures_costs_and_calibrates_on_validation_samples(qwen3_target):
    """The evaluation's own measurements on a tiny target: c(1) = 1 by definition, a positive drafting cost, and a
    calibration fitted on validation samples (the oracle-free drafter: some positions counted, rates in [0, 1])."""
    import pandas as pd

    from dflash.decoding.drafter import draft_head
    from dflash.decoding.gate import measure_verify_cost
    from dflash.evaluate import calibrate, measure_draft_ms, predicted_tau

    drafter = build_drafter(qwen3_target.config, seed=3, init_std=0.2, block_size=4)
    cost = measure_verify_cost(qwen3_target, 4, context=32, repeats=2)
    assert cost.relative[0] == 1.0 and len(cost.relative) == 4 and cost.step_ms > 0
    assert measure_draft_ms(qwen3_target, drafter, draft_head(qwen3_target, drafter), 4, context=32, repeats=2) > 0
    ids = [random_prompt(40, seed)[0].tolist() for seed in range(3)]
    validation = pd.DataFrame({"prompt_id": ["a", "b", "c"], "input_ids": ids, "loss_mask": [[0] * 8 + [1] * 32] * 3})
    calibration, outcomes = calibrate(qwen3_target, drafter, validation, 4, draft_head(qwen3_target, drafter))
    assert calibration.positions == 3 and sum(calibration.counts[0]) == int(outcomes.counted[:, 0].sum()) > 0
    assert all(0.0 <= r <= 1.0 for rates in calibration.rates for r in rates)
    predicted = predicted_tau(outcomes, calibration, cost, 0.0)
    assert 1.0 <= predicted["tau_gated"] <= predicted["tau"] <= 4.0
    # A drafter trained at another block size (gpu-8x trains at 16, decodes at 4) calibrates at the evaluation's:
    # the same weights give the same outcomes whatever block size they were trained at.
    wide = copy.deepcopy(drafter)
    wide.config = dataclasses.replace(drafter.config, block_size=8)
    wide_outcomes = calibrate(qwen3_target, wide, validation, 4, draft_head(qwen3_target, wide))[1]
    assert torch.equal(wide_outcomes.correct, outcomes.correct) and torch.equal(wide_outcomes.counted, outcomes.counted)
