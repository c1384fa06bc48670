"""llama.cpp's llama-server, built once per pinned source and CPU: the cache's key, reuse, and what a bad source,
a missing tool or a stale build say. ``pytest -m llamacpp`` builds it for real (minutes on two cores, once: later
runs reuse the cache)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import time

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
