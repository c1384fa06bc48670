"""Speculative decoding: lossless against the target's own greedy decoding, with exact statistics."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, MASK, build_drafter, build_target, llama_config, qwen3_config, random_prompt

import dflash.decoding.arms
from dflash.decoding.arms import Arm, Shared, decode_arms, register_proposer
from dflash.decoding.calibration import Calibration
from dflash.decoding.drafter import DFlashProposer
from dflash.decoding.gate import PaidCost, VerifyCost
from dflash.decoding.generate import speculative_generate
from dflash.decoding.lookup import PromptLookup, PromptLookupProposer
from dflash.decoding.proposal import Proposal, token_depths
from dflash.decoding.verify import accepted_path, tree_mask
from dflash.vocab import DraftVocab

_GREEDY_MEMO: dict = {}


def greedy(target, ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """The target's own greedy decoding (transformers ``generate``), new tokens only; memoised per target and prompt."""
    key = (id(target.model), tuple(ids[0].tolist()), max_new_tokens, eos_token_id)
    if key not in _GREEDY_MEMO:
        kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs)
        _GREEDY_MEMO[key] = (target.model, out[0, ids.shape[1] :].tolist())  # the model is kept so that its id stays unique
    return list(_GREEDY_MEMO[key][1])


def check_stats(gen, block_size: int, max_new_tokens: int) -> None:
    stats = gen.stats
    assert stats.num_output_tokens == len(gen.tokens) <= max_new_tokens
    # One prefill plus one verify forward per step.
    assert stats.target_forwards == 1 + len(stats.acceptance_lengths)
    assert all(1 <= a <= block_size for a in stats.acceptance_lengths)
    # Each verify timed, inside the decoding time.
    assert len(stats.verify_seconds) == len(stats.verified) == len(stats.acceptance_lengths)
    assert all(s > 0 for s in stats.verify_seconds) and sum(stats.verify_seconds) <= stats.decode_seconds
    # The prefill commits one token, every step commits its acceptance length (the last one possibly cut short).
    if stats.acceptance_lengths:
        assert sum(stats.acceptance_lengths[:-1]) < stats.num_output_tokens - 1 <= sum(stats.acceptance_lengths)
    else:
        assert stats.num_output_tokens == 1
    if block_size == 1:
        assert stats.acceptance_lengths == [1] * (stats.num_output_tokens - 1)
        assert stats.tau == (1.0 if stats.acceptance_lengths else 0.0)
        assert stats.target_forwards == stats.num_output_tokens


PROMPTS = [(3, 10), (11, 11), (24, 13)]  # (length, seed): none of these meets EOS within MAX_NEW tokens
MAX_NEW = 21  # not a multiple of any block size: the last block is cut short


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_lossless_on_tiny_targets(any_target, block_size):
    drafter = build_drafter(any_target.config, seed=3, init_std=0.2)
    for length, seed in PROMPTS:
        ids = random_prompt(length, seed)
        expected = greedy(any_target, ids, MAX_NEW)
        gen = speculative_generate(any_target, drafter, ids, MAX_NEW, block_size=block_size)
        assert gen.tokens.tolist() == expected, (length, seed)
        assert gen.tokens.dtype == torch.long
        check_stats(gen, block_size, MAX_NEW)


def test_tiny_targets_run_to_the_token_limit(llama_target, qwen3_target):
    """The prompts above do not stop early on EOS, so the losslessness test covers full-length runs."""
    for target in (llama_target, qwen3_target):
        assert target.eos_token_ids == [EOS]
        for length, seed in PROMPTS:
            assert len(greedy(target, random_prompt(length, seed), MAX_NEW)) == MAX_NEW


def test_baseline_without_drafter_is_greedy(qwen3_target):
    ids = random_prompt(9, 5)
    gen = speculative_generate(qwen3_target, None, ids, 13)
    assert gen.tokens.tolist() == greedy(qwen3_target, ids, 13)
    assert gen.stats.block_size == 1
    check_stats(gen, 1, 13)
    with pytest.raises(ValueError, match="needs a drafter"):
        speculative_generate(qwen3_target, None, ids, 13, block_size=4)


def test_one_new_token_is_the_prefill_only(qwen3_target, qwen3_drafter):
    ids = random_prompt(6, 6)
    gen = speculative_generate(qwen3_target, qwen3_drafter, ids, 1, block_size=8)
    assert gen.tokens.tolist() == greedy(qwen3_target, ids, 1)
    assert gen.stats.acceptance_lengths == [] and gen.stats.target_forwards == 1 and gen.stats.tau == 0.0


def test_rejects_bad_requests(qwen3_target, qwen3_drafter):
    with pytest.raises(ValueError, match="one request"):
        speculative_generate(qwen3_target, qwen3_drafter, torch.ones(2, 4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        speculative_generate(qwen3_target, qwen3_drafter, torch.ones(1, 4, dtype=torch.long), 0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_stops_on_a_stop_token_like_generate(any_target, block_size):
    """Pick a token that greedy decoding emits mid-stream and make it the stop token: both stop right after it."""
    drafter = build_drafter(any_target.config, seed=3, init_std=0.2)
    ids = random_prompt(7, 21)
    free_run = greedy(any_target, ids, 30)
    stop_at = next(i for i in range(4, 30) if free_run[i] not in free_run[:i])
    stop = free_run[stop_at]
    expected = free_run[: stop_at + 1]
    assert greedy(any_target, ids, 30, eos_token_id=stop) == expected
    gen = speculative_generate(any_target, drafter, ids, 30, block_size=block_size, stop_token_ids=[stop])
    assert gen.tokens.tolist() == expected
    check_stats(gen, block_size, 30)
    # No stop tokens at all: runs to the token limit, like the free run.
    assert len(free_run) == 30
    assert speculative_generate(any_target, drafter, ids, 30, block_size=block_size, stop_token_ids=[]).tokens.tolist() == free_run


@pytest.mark.parametrize("make_config", [llama_config, qwen3_config], ids=["llama", "qwen3"])
def test_lossless_under_partial_acceptance(make_config):
    """An 8-token vocabulary makes random drafts right often enough to exercise partial acceptance and cache rollback."""
    config = make_config(vocab_size=8, eos_token_id=None, pad_token_id=0)
    target = build_target(config, seed=0)
    drafter = build_drafter(config, seed=0, init_std=0.2, mask_token_id=7)
    seen = set()
    for block_size in (4, 8):
        for length, seed in ((5, 0), (8, 1), (11, 2)):
            ids = torch.randint(0, 7, (1, length), generator=torch.Generator().manual_seed(seed))
            expected = greedy(target, ids, 32)
            gen = speculative_generate(target, drafter, ids, 32, block_size=block_size)
            assert gen.tokens.tolist() == expected
            check_stats(gen, block_size, 32)
            seen.update(a for a in gen.stats.acceptance_lengths[:-1] if 1 < a < block_size)
    assert seen, "no partially accepted block: the test did not exercise cache rollback"


# -- token trees -------------------------------------------------------------------------------------------


def test_a_token_tree_sees_only_its_branch_and_accepts_the_branch_the_target_follows():
    parents = [-1, -1, 0, 1]  # draft tokens 0 and 1 follow the last committed token; 2 follows 0, 3 follows 1
    assert token_depths(parents) == [1, 1, 2, 2]
    mask = tree_mask(parents, past=2, device=torch.device("cpu"))
    assert mask[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 0, 1, 0, 1],
    ]
    draft = [5, 6, 7, 8]
    # verified[j]: the target's token after block position j (0: the last committed token, j: draft token j - 1).
    assert accepted_path(draft, parents, [6, 0, 8, 0, 9]) == [1, 3]  # the second branch, whole
    assert accepted_path(draft, parents, [5, 1, 0, 0, 0]) == [0]  # the first branch, its first token only
    assert accepted_path(draft, parents, [4, 7, 8, 0, 0]) == []  # no branch


class FanOutProposer:
    """Proposes every token of an 8-token vocabulary as the next one (so that one is always accepted), and a 2-token
    chain after one of them that moves each step; records the target features it is told of."""

    name = "fan-out"
    needs_hidden_states = True
    draft_cost = 0.0

    def __init__(self):
        self.step, self.seen = 0, []

    def observe(self, hidden_states, count: int, start: int) -> None:
        assert start == sum(h.shape[1] for h in self.seen)  # told of every committed position once, in order
        self.seen.append(hidden_states[-1][:, :count])

    def propose(self, tokens: list[int], count: int) -> Proposal:
        self.step += 1
        branch = self.step % 8
        return Proposal(list(range(8)) + [tokens[-1], (tokens[-1] + self.step) % 8], parents=[-1] * 8 + [branch, 8])

    def ceiling(self, count: int):
        return None

    def feedback(self, proposal: Proposal, path: list[int]) -> None:
        pass


@pytest.mark.parametrize("make_config", [llama_config, qwen3_config], ids=["llama", "qwen3"])
def test_token_trees_are_lossless_and_keep_the_accepted_branch_in_the_caches(make_config):
    """Accepted branches off the block's first positions exercise the caches' compaction: a wrong key or value kept
    would change the target's next tokens, and a wrong feature the ones the proposer is told of."""
    target = build_target(make_config(vocab_size=8, eos_token_id=None, pad_token_id=0), seed=0)
    for length, seed in ((5, 0), (11, 2)):
        ids = torch.randint(0, 8, (1, length), generator=torch.Generator().manual_seed(seed))
        proposer = FanOutProposer()
        gen = speculative_generate(target, proposer, ids, 32, block_size=11)
        assert gen.tokens.tolist() == greedy(target, ids, 32)
        # Wherever the whole fan-out was verified (the last steps are cut short by the budget), it had the target's token.
        assert all(a >= 2 for a, v in zip(gen.stats.acceptance_lengths, gen.stats.verified) if v >= 8)
        assert any(a == 3 for a in gen.stats.acceptance_lengths)  # ... and the chain after it, sometimes
        tokens = ids[0].tolist() + gen.tokens.tolist()
        out = target.model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        # (the last step may process more than the budget lets it commit)
        assert torch.allclose(torch.cat(proposer.seen, dim=1)[:, : len(tokens) - 1], out.hidden_states[-1], atol=1e-5)


# -- an oracle drafter with a known acceptance --------------------------------------------------

CONSTANT = 42


def constant_target(**shape):
    """A target whose greedy output is always token 42, whatever the context (``shape`` overrides the tiny shape).

    All attention and MLP outputs are zeroed, so the last hidden state is the
    normalised embedding of the current token; every embedding is positive and
    the LM-head row of token 42 is all ones, so token 42 wins by a wide margin.
    """
    target = build_target(llama_config(**shape), seed=7)
    model = target.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.abs_().add_(0.01)
        model.lm_head.weight[CONSTANT] = 1.0
    return target


def constant_drafter(target, sign: float, block_size: int):
    """A drafter whose output at every mask position is ``sign`` times the normalised (positive) mask embedding.

    With ``sign=+1`` its LM-head argmax is token 42 (an oracle for ``constant_target``);
    with ``sign=-1`` token 42 scores lowest, so it is always wrong.
    """
    drafter = build_drafter(target.config, seed=8, block_size=block_size)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        drafter.norm.weight.fill_(sign)
    return drafter


def test_oracle_drafter_is_accepted_in_full():
    target = constant_target()
    drafter = constant_drafter(target, +1.0, block_size=8)
    ids = random_prompt(5, 30)
    assert greedy(target, ids, 33) == [CONSTANT] * 33
    with torch.no_grad():  # the oracle really proposes 42 at every mask position
        block = target.embed(torch.tensor([[CONSTANT] + [MASK] * 7]))
        hidden = drafter(torch.randn(1, 3, 3 * 64), block, torch.arange(3)[None], torch.arange(3, 11)[None])
        assert target.lm_head(hidden).argmax(-1).tolist() == [[CONSTANT] * 7]  # the 7 drafted positions

    gen = speculative_generate(target, drafter, ids, 33, block_size=8)
    assert gen.tokens.tolist() == [CONSTANT] * 33
    # 1 token from the prefill, then 4 steps of 8 (7 drafts + 1 bonus) = 33.
    assert gen.stats.acceptance_lengths == [8, 8, 8, 8]
    assert gen.stats.tau == 8.0 and gen.stats.target_forwards == 5
    assert gen.stats.per_position_acceptance == [1.0] * 7

    # A budget that ends inside a block: 1 + 8 + 8 + 4 = 21, the last verify is 5 wide.
    gen = speculative_generate(target, drafter, ids, 21, block_size=8)
    assert gen.tokens.tolist() == [CONSTANT] * 21
    assert gen.stats.acceptance_lengths == [8, 8, 5]

    # Block size 16 with the same weights: 1 + 16 + 16.
    gen = speculative_generate(target, drafter, ids, 33, block_size=16)
    assert gen.stats.acceptance_lengths == [16, 16] and gen.stats.tau == 16.0


def test_always_wrong_drafter_gains_nothing_and_loses_nothing():
    target = constant_target()
    drafter = constant_drafter(target, -1.0, block_size=8)
    ids = random_prompt(5, 30)
    gen = speculative_generate(target, drafter, ids, 17, block_size=8)
    assert gen.tokens.tolist() == [CONSTANT] * 17
    assert gen.stats.acceptance_lengths == [1] * 16
    assert gen.stats.tau == 1.0 and gen.stats.target_forwards == 17
    assert gen.stats.per_position_acceptance == [0.0] * 7


# -- prompt lookup --------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_ngram():
    proposer = PromptLookupProposer(PromptLookup(num_tokens=3, max_ngram=2))

    def propose(tokens, count):
        return proposer.propose(tokens, count).tokens

    assert propose([5, 6, 7, 8, 9, 6, 7], 3) == [8, 9, 6]  # "6 7" first stood at 1..2, followed by 8 9 6
    assert propose([1, 2, 3, 4, 3], 3) == [4, 3]  # "4 3" never stood before; "3" did, at 2: 4 3 followed
    assert propose([7, 1, 7, 2, 7], 3) == [2, 7]  # the latest earlier "7" (at 2), not the first
    assert propose([1, 2, 3], 3) == []  # nothing repeats: a plain autoregressive step
    assert propose([4, 4, 4, 4], 2) == [4]  # "4 4" at 1..2 is followed by the last 4 only


@pytest.mark.parametrize("num_tokens", [1, 3, 10])
def test_prompt_lookup_is_lossless(num_tokens):
    """An 8-token vocabulary makes repeats, and so accepted lookups, frequent."""
    config = qwen3_config(vocab_size=8, eos_token_id=None, pad_token_id=0)
    target = build_target(config, seed=0)
    accepted = []
    for length, seed in ((5, 0), (8, 1), (11, 2)):
        ids = torch.randint(0, 7, (1, length), generator=torch.Generator().manual_seed(seed))
        gen = speculative_generate(target, PromptLookup(num_tokens=num_tokens), ids, 32)
        assert gen.tokens.tolist() == greedy(target, ids, 32)
        check_stats(gen, num_tokens + 1, 32)
        accepted += gen.stats.acceptance_lengths
    assert max(accepted) > 1, "no lookup was accepted: the test did not exercise verification"


# -- a draft vocabulary ---------------------------------------------------------------------------------


def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(qwen3_target, monkeypatch):
    drafter = build_drafter(qwen3_target.config, seed=3, init_std=0.2)
    drafter.draft_vocab = DraftVocab.of(list(range(0, 128, 3)), 128)
    proposed = []
    original = DFlashProposer.propose
    monkeypatch.setattr(DFlashProposer, "propose", lambda self, tokens, count: proposed.append(original(self, tokens, count)) or proposed[-1])
    for length, seed in PROMPTS:
        ids = random_prompt(length, seed)
        gen = speculative_generate(qwen3_target, drafter, ids, MAX_NEW, block_size=8)
        assert gen.tokens.tolist() == greedy(qwen3_target, ids, MAX_NEW)
    assert proposed and all(token % 3 == 0 for proposal in proposed for token in proposal.tokens)


class RepeatLast:
    """A toy proposer: drafts the last token again, at every position, half sure of each."""

    name = "repeat"
    needs_hidden_states = False
    draft_cost = 0.0

    def observe(self, hidden_states, count: int, start: int) -> None:
        pass

    def propose(self, tokens: list[int], count: int) -> Proposal:
        return Proposal([tokens[-1]] * count, accept=[0.5] * count, source=self.name)

    def ceiling(self, count: int) -> list[float] | None:
        return None

    def feedback(self, proposal: Proposal, path: list[int]) -> None:
        pass


def test_a_proposer_added_through_the_registry_decodes_losslessly_in_an_arm_of_its_own(monkeypatch):
    """One line registers a new proposer; an arm names it, gated and ungated, and decodes the baseline's tokens."""
    monkeypatch.setattr(dflash.decoding.arms, "PROPOSERS", dict(dflash.decoding.arms.PROPOSERS))  # the test's alone
    register_proposer("repeat", lambda shared, gated: (RepeatLast(), 5))
    target = build_target(qwen3_config(eos_token_id=None))  # decodes to the token limit
    shared = Shared(
        target, build_drafter(target.config), 8, PromptLookup(3), PaidCost(VerifyCost((1.0, 1.0, 1.0, 1.0, 1.0))), Calibration([], [], []), head=None
    )
    arms = [Arm("baseline"), Arm("repeat", ("repeat",), gated=False), Arm("repeat-gated", ("repeat",))]
    decoded = decode_arms(arms, shared, random_prompt(10, 3), 24)
    assert decoded["repeat"].tokens.tolist() == decoded["repeat-gated"].tokens.tolist() == decoded["baseline"].tokens.tolist()
    assert decoded["repeat"].stats.verified[:10] == [4] * 10  # ungated: its whole proposal, every step (but near the end)
    assert sum(decoded["repeat"].stats.acceptance_lengths) > len(decoded["repeat"].stats.acceptance_lengths)  # some accepted
    assert decoded["repeat-gated"].stats.choices["repeat"] > 0  # a free verify of half-sure tokens pays
    with pytest.raises(ValueError, match="registered already"):
        register_proposer("repeat", lambda shared, gated: (RepeatLast(), 5))
    with pytest.raises(ValueError, match="the first arm must be the autoregressive baseline"):
        decode_arms(arms[1:], shared, random_prompt(10, 3), 4)
