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

from dflash import llamacpp
from dflash.errors import PreflightError


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
    monkeypatch.setattr(llamacpp, "fetch_sdist", lambda workdir: pytest.fail("a cached build was fetched again"))
    manifest = llamacpp.build_llama_server(tmp_path)
    assert manifest["reused"] is True and manifest["build_seconds"] == 371.0


def test_a_cached_build_without_dflash_is_named(tmp_path):
    server = _fake_build(tmp_path, "--spec-type [none|ngram-cache]")
    with pytest.raises(PreflightError, match=rf"{server} --help does not list the draft-dflash speculative type"):
        llamacpp.build_llama_server(tmp_path)


def test_a_missing_build_tool_is_named_before_anything_is_fetched(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/" + tool)
    monkeypatch.setattr(llamacpp, "fetch_sdist", lambda workdir: pytest.fail("fetched without cmake"))
    with pytest.raises(PreflightError, match=r"building llama.cpp needs cmake on PATH: `apt-get install cmake g\+\+`"):
        llamacpp.build_llama_server(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_source_whose_digest_differs_from_the_pin_is_refused(tmp_path, monkeypatch):
    def download(command, **kwargs):
        (tmp_path / llamacpp.SDIST["filename"]).write_bytes(b"not the pinned source")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(llamacpp.subprocess, "run", download)
    with pytest.raises(PreflightError, match=r"has sha256 [0-9a-f]{64}, expected 832db069.*refusing a changed source"):
        llamacpp.fetch_sdist(tmp_path)


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
