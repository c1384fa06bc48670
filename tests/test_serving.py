"""The serve check: vLLM's acceptance against ours, with known answers; and vLLM itself on tiny targets.

The tests marked ``vllm`` run vLLM (in an environment of its own, built by ``dflash.serving.build_env`` on first use
under ``DFLASH_VLLM_ENV``, default ``~/.cache/dflash/vllm-env``). vLLM's start-up takes minutes on two cores, so the
default run deselects them (pyproject's ``addopts``) and ``.ci/run`` runs them in a step of their own, with a time limit:
``pytest -m vllm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MASK, build_drafter, build_target, qwen3_config, random_prompt
from test_decode import CONSTANT, constant_drafter, constant_target

from dflash.config import ServeConfig
from dflash.decoding.generate import speculative_generate
from dflash.model import DFlashDrafter
from dflash.serving import RUNNER, acceptance, differences, drafter_over_full_vocab, engine_acceptance, first_difference, run_vllm
from dflash.vocab import FILE_NAME as VOCAB_FILE
from dflash.vocab import DraftVocab


def test_our_acceptance_is_pooled_over_verify_steps():
    ours = acceptance([4, 1, 2, 1], block_size=4)
    assert ours == {"tau": 2.0, "per_position": [0.5, 0.25, 0.25], "steps": 4}


def test_an_engines_acceptance_comes_from_its_counters():
    rows = [
        {"drafts": 3, "draft_tokens": 9, "accepted_tokens": 4, "accepted_per_position": [2, 1, 1]},
        {"drafts": 1, "draft_tokens": 3, "accepted_tokens": 0, "accepted_per_position": []},
    ]
    assert engine_acceptance(rows, block_size=4) == {"tau": 2.0, "per_position": [0.5, 0.25, 0.25], "steps": 4}


def test_differences_beyond_the_tolerance_are_named():
    ours = {"tau": 2.0, "per_position": [0.5, 0.3, 0.05]}
    assert differences(ours, {"tau": 2.15, "per_position": [0.46, 0.28, 0.04]}, 0.10, "vLLM") == []
    found = differences(ours, {"tau": 1.5, "per_position": [0.5, 0.2, 0.2]}, 0.10, "vLLM")
    assert found == [
        "mean acceptance length: vLLM 1.500, ours 2.000",
        "acceptance at draft position 2: vLLM 0.200, ours 0.300",
        "acceptance at draft position 3: vLLM 0.200, ours 0.050",
    ]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_the_full_vocabulary_copy_drops_only_the_draft_vocabulary(tmp_path):
    target = build_target(qwen3_config(), seed=1)
    drafter = build_drafter(target.config, seed=2)
    drafter.draft_vocab = DraftVocab.of([5, 9, MASK], target.config.vocab_size)
    drafter.save_pretrained(tmp_path / "drafter", target.lm_head.weight)
    copy = drafter_over_full_vocab(tmp_path / "drafter", tmp_path / "full")
    assert not (copy / VOCAB_FILE).exists() and "draft_vocab_size" not in json.loads((copy / "config.json").read_text())
    assert DFlashDrafter.from_pretrained(copy).draft_vocab is None
    assert DFlashDrafter.from_pretrained(tmp_path / "drafter").draft_vocab.token_ids.tolist() == [5, 9, MASK]


def test_the_regeneration_engine_falls_back_to_local_only_under_auto(tmp_path):
    from dflash.config import GenerationConfig
    from dflash.distributed import Layout, single_process
    from dflash.errors import InputError
    from dflash.generation import LocalEngine, VllmTarget, open_engine

    target = build_target(qwen3_config(), seed=1)
    missing = VllmTarget({"available": False, "reason": "pip install failed"}, "unused")
    one, four = single_process("cpu"), Layout(torch.device("cpu"), world=4, drafter_world=4)
    for vllm, layout in ((None, one), (missing, one), (missing, four)):
        with open_engine(target, GenerationConfig(engine="auto"), layout, vllm, 64, tmp_path) as engine:
            assert isinstance(engine, LocalEngine)
    for vllm, layout, reason in ((None, one, "no vLLM environment"), (missing, one, "pip install failed"), (missing, four, "runs 4")):
        with pytest.raises(InputError, match=reason), open_engine(target, GenerationConfig(engine="vllm"), layout, vllm, 64, tmp_path):
            pass


# -- vLLM itself -----------------------------------------------------------------------------------------

# vLLM's CPU attention takes head sizes from 32 up.
VLLM_SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    from dflash.vllm_env import build_env

    env = Path(os.environ.get("DFLASH_VLLM_ENV", Path.home() / ".cache" / "dflash" / "vllm-env"))
    return build_env(env, ServeConfig())["python"]


def test_the_vllm_runner_run_by_its_path_lets_installed_packages_win_over_the_projects_modules():
    """vLLM's environment runs the runner by its path, which puts dflash/ first on sys.path: transformers' probe
    ``import kernels`` then found dflash/kernels.py, and vLLM failed to start. Run as Python runs a script (its folder
    first on sys.path), the runner must leave ``kernels`` to what is installed."""
    probe = "import importlib.util, runpy, sys; sys.path.insert(0, sys.argv[1]); runpy.run_path(sys.argv[2]); print(getattr(importlib.util.find_spec('kernels'), 'origin', None))"
    done = subprocess.run([sys.executable, "-c", probe, str(RUNNER.parent), str(RUNNER)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() != str(RUNNER.with_name("kernels.py"))


def _request(target_dir: Path, prompts: list[torch.Tensor], max_new_tokens: int, drafter_dir: Path | None, block_size: int) -> dict:
    return {
        "target": str(target_dir),
        "dtype": "float32",
        "max_model_len": 128,
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": [],
        "num_speculative_tokens": block_size - 1,
        "drafter": None if drafter_dir is None else str(drafter_dir),
        "prompts": [{"id": str(i), "input_ids": p[0].tolist()} for i, p in enumerate(prompts)],
    }


@pytest.mark.vllm
def test_vllm_accepts_an_oracle_drafter_in_full_and_a_wrong_one_never(tmp_path, vllm_python):
    """On a target that always writes token 42, vLLM's counters must say what ours say: the oracle drafter's every
    token accepted (τ = the block size), the always-wrong one's none (τ = 1); outputs all 42."""
    target = constant_target(**VLLM_SHAPE)
    target.model.save_pretrained(tmp_path / "target")
    prompts = [random_prompt(5, 30), random_prompt(9, 31)]
    # 13 tokens per prompt: the prefill's, then 3 verifies that commit 4 each, or 12 that commit 1.
    for name, sign, expected_tau, expected_rate, steps in (("oracle", +1.0, 4.0, 1.0, 3), ("wrong", -1.0, 1.0, 0.0, 12)):
        constant_drafter(target, sign, block_size=4).save_pretrained(tmp_path / name)
        result = run_vllm(vllm_python, name, _request(tmp_path / "target", prompts, 13, tmp_path / name, 4), tmp_path, 900)
        assert [row["tokens"] for row in result["prompts"]] == [[CONSTANT] * 13] * 2, name
        theirs = engine_acceptance(result["prompts"], 4)
        ours = acceptance([n for p in prompts for n in speculative_generate(target, constant_drafter(target, sign, 4), p, 13).stats.acceptance_lengths], 4)
        assert theirs["tau"] == ours["tau"] == expected_tau, (name, theirs, ours)
        assert theirs["per_position"] == ours["per_position"] == [expected_rate] * 3, (name, theirs, ours)
        assert theirs["steps"] == ours["steps"] == 2 * steps, (name, theirs, ours)


@pytest.mark.vllm
def test_vllm_and_our_decoding_agree_on_a_trained_looking_drafter(tmp_path, vllm_python):
    """A random target and a drafter with a draft vocabulary, exported by ``save_pretrained``: vLLM writes what the
    target writes, and its acceptance agrees with ours within the serve check's tolerance."""
    target = build_target(qwen3_config(eos_token_id=None, **VLLM_SHAPE), seed=3)
    target.model.save_pretrained(tmp_path / "target")
    drafter = build_drafter(target.config, seed=4, init_std=0.3, block_size=4)
    drafter.draft_vocab = DraftVocab.of(list(range(1, 120)), target.config.vocab_size)
    drafter.save_pretrained(tmp_path / "drafter", target.lm_head.weight)
    prompts = [random_prompt(7, seed) for seed in range(3)]
    result = run_vllm(vllm_python, "random", _request(tmp_path / "target", prompts, 24, tmp_path / "drafter", 4), tmp_path, 900)
    lengths = []
    for prompt, row in zip(prompts, result["prompts"]):
        ours = speculative_generate(target, drafter, prompt, 24, block_size=4)
        assert row["tokens"] == ours.tokens.tolist() == speculative_generate(target, None, prompt, 24).tokens.tolist()
        lengths += ours.stats.acceptance_lengths
    ours, theirs = acceptance(lengths, 4), engine_acceptance(result["prompts"], 4)
    assert differences(ours, theirs, ServeConfig().tolerance, "vLLM") == [], (ours, theirs)


@pytest.mark.vllm
def test_vllm_regenerates_what_the_local_engine_does(tmp_path, vllm_python):
    """``data.generation.engine: vllm``: the stage starts vLLM's server of the tiny chat target and stops it; its
    samples are the in-process ones seen through text; a rerun finds every chunk complete and starts no server."""
    from test_generation import PROMPTS, assert_served_as_local, command, data_section, reused, run
    from tiny_chat_target import build_tiny_inputs

    from dflash.target import write_manifest

    tiny = build_tiny_inputs(tmp_path / "tiny", **VLLM_SHAPE)
    inputs = {"model": tiny / "target", "manifest": tmp_path / "target.json", "prompts": tmp_path / "prompts.jsonl"}
    write_manifest(str(inputs["model"]), "float32", inputs["manifest"])
    inputs["prompts"].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    env = tmp_path / "env.json"
    env.write_text(json.dumps({"available": True, "python": vllm_python, "vllm": "under test"}))
    local = run(command(inputs, tmp_path / "local", data_section()))
    served_command = command(inputs, tmp_path / "vllm", data_section(engine="vllm")) + ["--vllm-env", str(env)]
    served = run(served_command)
    assert "regeneration on vLLM" in served and reused(local) == reused(served) == (len(PROMPTS) - 1, 0)
    assert_served_as_local(inputs["model"], tmp_path / "local", tmp_path / "vllm", data_section()["generation"]["max_new_tokens"])
    assert reused(run(served_command)) == (0, len(PROMPTS) - 1)
