"""llama.cpp's llama-server, built once per pinned source and CPU: the cache's key, reuse, and what a bad source,
a missing tool or a stale build say. ``pytest -m llamacpp`` builds it for real (minutes on two cores, once: later
runs reuse the cache)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import torch

from dflash import acquire, llamacpp
from dflash.errors import InputError, PreflightError


def test_the_build_key_changes_with_the_source_the_flags_the_targets_and_the_cpu():
    cpu = ("x86_64 Some CPU", "avx2 avx512f")
    key = llamacpp.build_key(cpu=cpu)
    assert key == llamacpp.build_key(cpu=cpu) and key.startswith(llamacpp.SDIST["sha256"][:16])
    others = {
        llamacpp.build_key(sha256="0" * 64, cpu=cpu),
        llamacpp.build_key(flags=(*llamacpp.CMAKE_FLAGS, "-DGGML_AVX512=OFF"), cpu=cpu),
        llamacpp.build_key(targets=("llama-server", "llama-cli"), cpu=cpu),
        llamacpp.build_key(cpu=("x86_64 Some CPU", "avx2")),
    }
    assert key not in others and len(others) == 4


def _fake_build(root, help_text: str):
    """A finished build in the cache at ``root`` whose llama-server prints ``help_text``."""
    directory = root / llamacpp.build_key()
    (directory / "bin").mkdir(parents=True)
    server = directory / "bin" / "llama-server"
    server.write_text(f"#!/bin/sh\necho '{help_text}'\n")
    server.chmod(0o755)
    (directory / llamacpp.MANIFEST).write_text(json.dumps({"server": str(server), "build_seconds": 371.0}))
    return server


def test_a_finished_build_is_reused_without_building(tmp_path, monkeypatch):
    _fake_build(tmp_path, "--spec-type [none|ngram-cache|draft-simple|draft-dflash]")
    monkeypatch.setattr(llamacpp, "download_pinned", lambda *args: pytest.fail("a cached build was fetched again"))
    manifest = llamacpp.build_llama_server(tmp_path)
    assert manifest["reused"] is True and manifest["build_seconds"] == 371.0


def test_a_cached_build_without_dflash_is_named(tmp_path):
    server = _fake_build(tmp_path, "--spec-type [none|ngram-cache]")
    with pytest.raises(PreflightError, match=rf"{server} --help does not list the draft-dflash speculative type"):
        llamacpp.build_llama_server(tmp_path)


def test_a_missing_build_tool_is_named_before_anything_is_fetched(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/" + tool)
    monkeypatch.setattr(llamacpp, "download_pinned", lambda *args: pytest.fail("fetched without cmake"))
    with pytest.raises(PreflightError, match=r"building llama.cpp needs cmake on PATH: `apt-get install cmake g\+\+`"):
        llamacpp.build_llama_server(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_source_whose_digest_differs_from_the_pin_is_refused(tmp_path, monkeypatch):
    def download(command, **kwargs):
        assert "--no-binary=:all:" in command and command[-1] == "llama-cpp-python==0.3.36"
        (tmp_path / llamacpp.SDIST["filename"]).write_bytes(b"not the pinned source")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(acquire.subprocess, "run", download)
    with pytest.raises(PreflightError, match=r"has sha256 [0-9a-f]{64}, expected 832db069.*refusing a tampered or changed file"):
        acquire.download_pinned(llamacpp.SDIST, tmp_path, "")


def test_the_vendored_source_is_extracted_at_the_root_of_src(tmp_path):
    sdist = tmp_path / "source.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name, text in ((f"{llamacpp.SDIST['vendored']}/CMakeLists.txt", b"project(llama)"), ("llama_cpp_python-0.3.36/setup.py", b"")):
            member = tarfile.TarInfo(name)
            member.size = len(text)
            archive.addfile(member, io.BytesIO(text))
    llamacpp._extract_source(sdist, tmp_path / "src")
    assert [p.name for p in (tmp_path / "src").iterdir()] == ["CMakeLists.txt"]


@pytest.mark.llamacpp
def test_llama_server_is_built_once_and_offers_dflash_drafting():
    """Builds into the real cache (``$DFLASH_CACHE_DIR/llama.cpp``) where no build is there yet, then reuses it."""
    first = llamacpp.build_llama_server()
    print(f"llama-server: {'reused' if first['reused'] else 'built'}, build {first['build_seconds']} s on {first['threads']} thread(s)")
    start = time.perf_counter()
    again = llamacpp.build_llama_server()
    assert again["reused"] is True and again["server"] == first["server"] and time.perf_counter() - start < 30
    help_text = subprocess.run([first["server"], "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "draft-dflash" in help_text and "--spec-draft-n-max" in help_text
    assert (llamacpp.Path(first["converter"])).is_file() and (llamacpp.Path(first["gguf_py"]) / "gguf").is_dir()


def _drafter_dir(tmp_path, config: dict):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(config))
    return drafter


def test_a_gguf_that_loses_a_dflash_setting_is_named_and_removed(tmp_path, monkeypatch):
    """The converter wrote a block size of 16 for a drafter of block 4: decoding in llama.cpp would differ from ours."""
    drafter = _drafter_dir(tmp_path, {"block_size": 4, "dflash_config": {"target_layer_ids": [1, 8], "mask_token_id": 16}})
    out = tmp_path / "drafter.gguf"
    monkeypatch.setattr(llamacpp, "convert_to_gguf", lambda *args: out.write_bytes(b"GGUF"))
    written = {"general.architecture": "dflash", "dflash.block_size": 16, "dflash.target_layers": [2, 9], "tokenizer.ggml.mask_token_id": 16}
    monkeypatch.setattr(llamacpp, "gguf_fields", lambda path, build: written)
    with pytest.raises(InputError, match=r"dflash.block_size: the drafter has 4, the GGUF 16\): llama.cpp would draft differently"):
        llamacpp.convert_drafter(drafter, tmp_path / "target", out, {})
    assert not out.exists()


def test_a_drafter_config_without_its_dflash_settings_is_named(tmp_path):
    drafter = _drafter_dir(tmp_path, {"block_size": 4, "dflash_config": {"target_layer_ids": [1]}})
    with pytest.raises(InputError, match=r"config.json lacks mask_token_id: not a DFlash drafter"):
        llamacpp.convert_drafter(drafter, tmp_path / "target", tmp_path / "d.gguf", {})
    assert not (tmp_path / "d.gguf").exists()


def test_the_gguf_counts_target_layers_from_the_embeddings(tmp_path, monkeypatch):
    drafter = _drafter_dir(tmp_path, {"block_size": 4, "dflash_config": {"target_layer_ids": [1, 8, 14], "mask_token_id": 16}})
    monkeypatch.setattr(llamacpp, "convert_to_gguf", lambda *args: None)
    written = {"general.architecture": "dflash", "dflash.block_size": 4, "dflash.target_layers": [2, 9, 15], "tokenizer.ggml.mask_token_id": 16}
    monkeypatch.setattr(llamacpp, "gguf_fields", lambda path, build: written | {"dflash.embedding_length": 64})
    assert llamacpp.convert_drafter(drafter, tmp_path / "target", tmp_path / "d.gguf", {}) == written


@pytest.mark.llamacpp
def test_a_drafter_and_its_target_convert_to_gguf_carrying_the_drafters_settings(tmp_path):
    """The tests' tiny chat target and a drafter saved by ``save_pretrained``, through the vendored converter. The tiny
    tokenizer's pre-tokenizer is unknown to llama.cpp, hence ``unknown_pretokenizer_as_default``; the export itself is
    left as it was, so vLLM, the authors' package and our loader read it unchanged."""
    from conftest import build_drafter
    from tiny_chat_target import build_tiny_chat_target
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.model import DFlashDrafter

    target_dir = build_tiny_chat_target(tmp_path / "target")
    config = AutoConfig.from_pretrained(target_dir)
    drafter = build_drafter(config, mask_token_id=config.vocab_size - 1, block_size=4)
    drafter.save_pretrained(tmp_path / "drafter", AutoModelForCausalLM.from_pretrained(target_dir).lm_head.weight)
    before = {p.name: p.read_bytes() for p in (tmp_path / "drafter").iterdir()}
    build = llamacpp.build_llama_server()

    fields = llamacpp.convert_drafter(tmp_path / "drafter", target_dir, tmp_path / "drafter.gguf", build, unknown_pretokenizer_as_default=True)
    assert fields == {
        "general.architecture": "dflash",
        "dflash.block_size": 4,
        "dflash.target_layers": [i + 1 for i in drafter.config.target_layer_ids],
        "tokenizer.ggml.mask_token_id": config.vocab_size - 1,
    }
    target = llamacpp.convert_to_gguf(target_dir, tmp_path / "target.gguf", build, unknown_pretokenizer_as_default=True)
    assert llamacpp.gguf_fields(target, build, "llama.")["llama.vocab_size"] == config.vocab_size
    assert {p.name: p.read_bytes() for p in (tmp_path / "drafter").iterdir()} == before
    reloaded = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), drafter.state_dict().values()))


@pytest.mark.llamacpp
def test_a_tokenizer_unknown_to_llamacpp_is_refused_naming_the_converters_error(tmp_path):
    from tiny_chat_target import build_tiny_chat_target

    target_dir = build_tiny_chat_target(tmp_path / "target")
    with pytest.raises(InputError, match=r"could not convert .*target \(exit status 1\): NotImplementedError: BPE pre-tokenizer was not recognized"):
        llamacpp.convert_to_gguf(target_dir, tmp_path / "target.gguf", llamacpp.build_llama_server())
    assert not (tmp_path / "target.gguf").exists()


# -- llama-server ------------------------------------------------------------------------------------------


def test_a_port_in_use_is_named_before_the_server_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        build = {"server": "/nonexistent/llama-server"}  # never started: the port is checked first
        with pytest.raises(InputError, match=rf"port {port} on 127.0.0.1 is in use .*leave serve.llamacpp.port unset for a free port"):
            with llamacpp.llama_server(build, tmp_path / "target.gguf", tmp_path / "server.log", 64, port=port):
                pytest.fail("served on a port in use")


def _fake_server(tmp_path, script: str) -> dict:
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\n{script}\n")
    server.chmod(0o755)
    return {"server": str(server)}


def _running(pid_file) -> bool:
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_server_that_never_answers_is_named_and_stopped(tmp_path):
    build = _fake_server(tmp_path, "exec sleep 600")
    with pytest.raises(InputError, match=r"llama-server did not answer http://127.0.0.1:\d+/health within 2 s \(serve.llamacpp.startup_timeout_s\); its log: "):
        with llamacpp.llama_server(build, tmp_path / "target.gguf", tmp_path / "server.log", 64, timeout=2):
            pytest.fail("the block ran without a server")
    assert not _running(tmp_path / "pid")


def test_a_server_that_exits_while_starting_is_named_with_its_log(tmp_path):
    build = _fake_server(tmp_path, "echo 'error: failed to load model'; exit 3")
    with pytest.raises(InputError, match=r"llama-server exited with status 3 while starting; its log: .*server.log:\n.*failed to load model"):
        with llamacpp.llama_server(build, tmp_path / "target.gguf", tmp_path / "server.log", 64, timeout=30):
            pytest.fail("the block ran without a server")


def _constant_chat_target(directory):
    """The tests' target that always writes token 42, saved with the tiny chat tokenizer (a GGUF needs a tokenizer;
    the check, a chat template); the target as loaded."""
    from test_decode import constant_target
    from tiny_chat_target import build_tokenizer

    tokenizer = build_tokenizer()
    target = constant_target(vocab_size=len(tokenizer))
    target.model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return target


@pytest.mark.llamacpp
def test_llamacpp_accepts_an_oracle_drafter_in_full_and_a_wrong_one_never(tmp_path):
    """On a target that always writes token 42, llama.cpp's counters must say what ours say: the oracle drafter's
    every token accepted (τ = the block size), the always-wrong one's none (τ = 1); outputs all 42."""
    from conftest import random_prompt
    from test_decode import CONSTANT, constant_drafter

    from dflash.decoding.generate import speculative_generate
    from dflash.serving import acceptance, engine_acceptance

    target = _constant_chat_target(tmp_path / "target")
    build = llamacpp.build_llama_server()
    target_gguf = llamacpp.convert_to_gguf(tmp_path / "target", tmp_path / "target.gguf", build, unknown_pretokenizer_as_default=True)
    prompts = [random_prompt(5, 30), random_prompt(9, 31)]
    # 13 tokens per prompt: the prefill's, then 3 verifies that commit 4 each, or 12 that commit 1. llama-server drafts
    # at most the budget's remaining tokens less one, so it writes the wrong drafter's last token without a draft
    # (11 drafts), where our loop counts a verify step of one.
    for name, sign, expected_tau, expected_rate, steps, drafts in (("oracle", +1.0, 4.0, 1.0, 3, 3), ("wrong", -1.0, 1.0, 0.0, 12, 11)):
        drafter = constant_drafter(target, sign, block_size=4)
        drafter.save_pretrained(tmp_path / name, target.lm_head.weight)
        drafter_gguf = tmp_path / f"{name}.gguf"
        llamacpp.convert_drafter(tmp_path / name, tmp_path / "target", drafter_gguf, build, unknown_pretokenizer_as_default=True)
        with llamacpp.llama_server(build, target_gguf, tmp_path / f"{name}.log", 64, drafter_gguf, draft_tokens=3) as server:
            rows = [server.decode(p[0].tolist(), 13) for p in prompts]
        assert [row["tokens"] for row in rows] == [[CONSTANT] * 13] * 2, name
        theirs = engine_acceptance(rows, 4)
        ours = acceptance([n for p in prompts for n in speculative_generate(target, drafter, p, 13, block_size=4).stats.acceptance_lengths], 4)
        assert theirs["tau"] == ours["tau"] == expected_tau, (name, theirs, ours)
        assert theirs["per_position"] == ours["per_position"] == [expected_rate] * 3, (name, theirs, ours)
        assert (theirs["steps"], ours["steps"]) == (2 * drafts, 2 * steps), (name, theirs, ours)


@pytest.mark.llamacpp
def test_the_llamacpp_check_holds_llamacpps_acceptance_to_ours_and_names_a_difference(tmp_path):
    """``run_llamacpp_check`` on chat prompts: with the oracle drafter's GGUF, llama.cpp agrees with us and writes what
    our autoregressive arm writes; with another drafter's GGUF served in its place, the stage fails naming the
    difference, and its summary says so."""
    from test_decode import constant_drafter
    from tiny_chat_target import build_tiny_inputs

    from dflash.config import EvalConfig, EvalSet, ServeConfig
    from dflash.serving import run_llamacpp_check
    from dflash.target import load_from_manifest, write_manifest

    tiny = build_tiny_inputs(tmp_path / "tiny")
    _constant_chat_target(tmp_path / "target")
    write_manifest(str(tmp_path / "target"), "float32", tmp_path / "target.json")
    target = load_from_manifest(tmp_path / "target.json")
    for name, sign in (("oracle", +1.0), ("wrong", -1.0)):
        constant_drafter(target, sign, block_size=4).save_pretrained(tmp_path / name, target.lm_head.weight)
    build = llamacpp.build_llama_server()
    ggufs = llamacpp.convert_for_serving(build, tmp_path / "target", tmp_path / "oracle", tmp_path / "gguf", unknown_pretokenizer_as_default=True)
    assert ggufs["draft_vocab_carried"] is False and ggufs["drafter_fields"]["dflash.block_size"] == 4
    serve, eval_cfg = ServeConfig(limit=2, max_new_tokens=25), EvalConfig(sets=[EvalSet(name="chat", source=str(tiny / "eval_prompts.jsonl"))])

    summary = run_llamacpp_check(serve, eval_cfg, build, ggufs, target, tmp_path / "oracle", tmp_path / "no-heldout", tmp_path / "out")
    # 25 tokens: the prefill's, then 6 verifies of 4. (A budget that ends inside a block is drafted to its end by our
    # loop, and to one token short of it by llama-server, whose verify writes the last: one step's difference.)
    assert summary["agree"] and summary["acceptance"]["llamacpp"] == summary["acceptance"]["ours_full_vocab"] == {
        "tau": 4.0,
        "per_position": [1.0] * 3,
        "steps": 12,
    }
    assert summary["outputs_identical_to_our_ar"] == {"ar": 2, "dflash": 2} and summary["numerics_caveat"] is None
    assert set(summary["tokens_per_second"]) == {"llamacpp_ar", "llamacpp_dflash", "ours_ar", "ours_dflash", "ours_dflash_full_vocab"}
    assert (tmp_path / "out" / "llamacpp.csv").is_file() and (tmp_path / "out" / "llamacpp" / "dflash.log").is_file()

    wrong = llamacpp.convert_for_serving(build, tmp_path / "target", tmp_path / "wrong", tmp_path / "wrong-gguf", unknown_pretokenizer_as_default=True)
    with pytest.raises(
        InputError, match=r"llama.cpp's acceptance differs from ours beyond serve.tolerance: mean acceptance length: llama.cpp 1.000, ours 4.000"
    ):
        run_llamacpp_check(
            serve, eval_cfg, build, ggufs | {"drafter": wrong["drafter"]}, target, tmp_path / "oracle", tmp_path / "no-heldout", tmp_path / "out"
        )
    assert json.loads((tmp_path / "out" / "llamacpp.json").read_text())["agree"] is False
