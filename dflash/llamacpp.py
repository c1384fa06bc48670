"""llama.cpp's ``llama-server``, built here from a pinned source, once per source and CPU.

No prebuilt ``llama-server`` is reachable from these machines, and the Python binding on PyPI
(``llama-cpp-python``) does not expose DFlash; its sdist vendors llama.cpp's source, which does
(``src/models/dflash.cpp``, the ``draft-dflash`` speculative type, ``convert_hf_to_gguf.py``). So the sdist is
fetched with ``pip download`` (never installed), checked against its sha256, and its vendored source built with
cmake for the CPU, ``llama-server`` only, into ``<cache>/llama.cpp/<key>``. The key covers the source's sha256,
the cmake flags and targets and, as ``GGML_NATIVE`` compiles for the CPU at hand, that CPU's model and flags: a
later run on the same kind of machine reuses the build, and the pin, the flags or the CPU changing rebuilds.
The source tree stays beside the build: its converter and ``gguf-py`` turn checkpoints into GGUF files
(``convert_for_serving``), and ``llama_server`` serves them on 127.0.0.1 for the serve check
(``dflash.serving.run_llamacpp_check``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash.acquire import cache_root, download_pinned
from dflash.config import cpu_threads
from dflash.errors import InputError, PreflightError
from dflash.io import atomic_path
from dflash.local_server import free_port, local_server, require_free_port

log = logging.getLogger(__name__)

SDIST = {
    "requirement": "llama-cpp-python==0.3.36",
    "filename": "llama_cpp_python-0.3.36.tar.gz",
    "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "binary": False,
    "vendored": "llama_cpp_python-0.3.36/vendor/llama.cpp",
}
# CPU only, no tests or examples; the web UI from source (the prebuilt one is downloaded, and waits out its
# time-outs where the network is closed); one static binary that runs wherever the cache is.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
TARGETS = ("llama-server",)
MANIFEST = "dflash-llamacpp.json"  # written last: a build directory without it is incomplete
BUILD_TIMEOUT_S = 3 * 3600


def cpu_description() -> tuple[str, str]:
    """The CPU a native build is compiled for: its model name, and its instruction-set flags."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.splitlines()) if v}
    return f"{platform.machine()} {fields.get('model name', platform.processor())}", fields.get("flags", "")


def build_key(
    sha256: str = SDIST["sha256"], flags: tuple[str, ...] = CMAKE_FLAGS, targets: tuple[str, ...] = TARGETS, cpu: tuple[str, str] | None = None
) -> str:
    """The cache's name for one build: the source's digest, then a digest of the flags, targets and CPU."""
    config = json.dumps({"flags": flags, "targets": targets, "cpu": cpu or cpu_description()}, sort_keys=True)
    return f"{sha256[:16]}-{hashlib.sha256(config.encode()).hexdigest()[:12]}"


def _run(command: list[str], what: str, log_path: Path) -> None:
    with open(log_path, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    if done.returncode:
        tail = "\n".join(log_path.read_text().strip().splitlines()[-20:])
        raise PreflightError(f"{what} failed (exit status {done.returncode}); its log: {log_path}\n{tail}")


def _extract_source(sdist: Path, into: Path) -> None:
    prefix = SDIST["vendored"] + "/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        for member in members:
            member.name = member.name[len(prefix) :]
        archive.extractall(into, members=[m for m in members if m.name], filter="data")


def _require_tools() -> None:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise PreflightError(f"building llama.cpp needs {' and '.join(missing)} on PATH: `apt-get install cmake g++` (Debian, Ubuntu)")


def _probe(server: Path) -> str:
    """``llama-server --help``, which must offer DFlash drafting."""
    done = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60)
    if "draft-dflash" not in done.stdout + done.stderr:
        raise PreflightError(f"{server} --help does not list the draft-dflash speculative type: is {SDIST['requirement']} the pinned source?")
    return done.stdout + done.stderr


def build_llama_server(root: Path | None = None) -> dict:
    """``llama-server`` built once into the cache (``$DFLASH_CACHE_DIR/llama.cpp/<build_key()>``), or the build already
    there: its manifest (binary, source and converter paths, the build's flags and seconds, ``reused``)."""
    directory = (root or cache_root() / "llama.cpp") / build_key()
    if (directory / MANIFEST).is_file():
        manifest = json.loads((directory / MANIFEST).read_text())
        _probe(Path(manifest["server"]))
        return manifest | {"reused": True}
    _require_tools()
    with atomic_path(directory) as staging, tempfile.TemporaryDirectory(prefix="dflash-llamacpp-") as tmp:
        staging.mkdir()
        log_path = staging / "build.log"
        log.info("fetching %s", SDIST["requirement"])
        _extract_source(download_pinned(SDIST, Path(tmp), "llama.cpp is built from the source it vendors: the build needs PyPI once."), staging / "src")
        build, threads = Path(tmp) / "build", cpu_threads()
        start = time.perf_counter()
        _run(["cmake", "-S", str(staging / "src"), "-B", str(build), *CMAKE_FLAGS], "configuring llama.cpp", log_path)
        configured = time.perf_counter() - start
        log.info("building %s on %d thread(s); the log: %s", ", ".join(TARGETS), threads, log_path)
        _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(threads)], f"building {', '.join(TARGETS)}", log_path)
        seconds = time.perf_counter() - start
        # The static binaries alone: the build tree's objects are hundreds of MB that nothing reads again.
        (staging / "bin").mkdir()
        for target in TARGETS:
            shutil.copy2(build / "bin" / target, staging / "bin" / target)
        _probe(staging / "bin" / "llama-server")
        manifest = {
            "server": str(directory / "bin" / "llama-server"),
            "source": str(directory / "src"),
            "converter": str(directory / "src" / "convert_hf_to_gguf.py"),
            "gguf_py": str(directory / "src" / "gguf-py"),
            **{k: SDIST[k] for k in ("requirement", "sha256")},
            "cmake_flags": list(CMAKE_FLAGS),
            "targets": list(TARGETS),
            "cpu": cpu_description()[0],
            "threads": threads,
            "configure_seconds": round(configured, 1),
            "build_seconds": round(seconds, 1),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest | {"reused": False}


# The vendored converter, run in a child process with the vendored gguf-py ahead of any installed one. llama.cpp
# names a BPE tokenizer's pre-tokenizer by the hash of a fixed text's token ids; a tokenizer it has never seen
# (a test's tiny one) stops the conversion. With ``unknown_pretokenizer_as_default`` the GGUF gets llama.cpp's
# default pre-tokenizer instead: right only where prompts reach the server as token ids, never as text.
_CONVERT = """
import logging, runpy, sys
source, default_pre, argv = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
sys.path[:0] = [source + "/gguf-py", source]
if default_pre:
    from conversion.base import TextModel
    recognised = TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("dflash").warning("the BPE pre-tokenizer is unknown to llama.cpp: writing 'default'")
            return "default"
    TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [source + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_to_gguf(model_dir: Path, out: Path, build: dict, target_dir: Path | None = None, unknown_pretokenizer_as_default: bool = False) -> Path:
    """``model_dir`` (a transformers checkpoint, or a drafter with ``target_dir``, its target) as an f32 GGUF at ``out``,
    by the converter of ``build`` (``build_llama_server()``'s manifest). The file appears only once complete."""
    argv = [str(model_dir), "--outtype", "f32"] + (["--target-model-dir", str(target_dir)] if target_dir else [])
    with atomic_path(out) as staging:
        command = [sys.executable, "-c", _CONVERT, build["source"], str(int(unknown_pretokenizer_as_default)), *argv, "--outfile", str(staging)]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "NO_LOCAL_GGUF": "1"})
        if done.returncode or not staging.is_file():
            lines = (done.stdout + done.stderr).strip().splitlines() or ["no output"]
            hint = ""
            if "pre-tokenizer was not recognized" in lines[-1]:
                hint = " (a tokenizer llama.cpp does not know: llama-server could take its prompts as token ids only)"
            raise InputError(f"llama.cpp's converter could not convert {model_dir} (exit status {done.returncode}): {lines[-1]}{hint}")
    return out


def gguf_fields(path: Path, build: dict, prefix: str = "") -> dict:
    """The key-value metadata of the GGUF at ``path`` whose key starts with ``prefix``, read by the vendored gguf-py."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from gguf import GGUFReader; "
        "r = GGUFReader(sys.argv[2]); print(json.dumps({k: f.contents() for k, f in r.fields.items() if k.startswith(sys.argv[3])}))"
    )
    done = subprocess.run([sys.executable, "-c", script, build["gguf_py"], str(path), prefix], capture_output=True, text=True)
    if done.returncode:
        raise InputError(f"{path} is not a GGUF file llama.cpp's gguf-py reads: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def convert_drafter(drafter_dir: Path, target_dir: Path, out: Path, build: dict, unknown_pretokenizer_as_default: bool = False) -> dict:
    """The drafter as a ``dflash`` GGUF, checked to carry what decoding with it depends on: its block size, the target
    layers it reads (llama.cpp counts from the embeddings, so our ids + 1) and its mask token. Returns those fields."""
    config = json.loads((drafter_dir / "config.json").read_text())
    dflash_config = config.get("dflash_config", {})
    missing = [key for key, held in (("block_size", config), ("target_layer_ids", dflash_config), ("mask_token_id", dflash_config)) if key not in held]
    if missing:
        raise InputError(f"{drafter_dir / 'config.json'} lacks {', '.join(missing)}: not a DFlash drafter saved by save_pretrained")
    expected = {
        "general.architecture": "dflash",
        "dflash.block_size": config["block_size"],
        "dflash.target_layers": [i + 1 for i in dflash_config["target_layer_ids"]],
        "tokenizer.ggml.mask_token_id": dflash_config["mask_token_id"],
    }
    convert_to_gguf(drafter_dir, out, build, target_dir, unknown_pretokenizer_as_default)
    fields = gguf_fields(out, build)
    carried = {key: fields.get(key) for key in expected}
    wrong = {key: (value, carried[key]) for key, value in expected.items() if carried[key] != value}
    if wrong:
        out.unlink()
        named = "; ".join(f"{key}: the drafter has {ours!r}, the GGUF {theirs!r}" for key, (ours, theirs) in wrong.items())
        raise InputError(f"{out.name} does not carry {drafter_dir}'s DFlash settings ({named}): llama.cpp would draft differently")
    return carried


def convert_for_serving(build: dict, target_dir: Path, drafter_dir: Path, out_dir: Path, unknown_pretokenizer_as_default: bool = False) -> dict:
    """The target (``target.gguf``) and the drafter (``drafter.gguf``) in ``out_dir``, as llama-server loads them; what
    the conversion carried. The target's tokenizer must be one llama.cpp knows, as the files serve text too, unless
    ``unknown_pretokenizer_as_default`` (``convert_to_gguf``: for token-id prompts only)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    target = convert_to_gguf(target_dir, out_dir / "target.gguf", build, unknown_pretokenizer_as_default=unknown_pretokenizer_as_default)
    drafter_fields = convert_drafter(drafter_dir, target_dir, out_dir / "drafter.gguf", build, unknown_pretokenizer_as_default)
    config = json.loads((drafter_dir / "config.json").read_text())
    return {
        "target": str(target),
        "drafter": str(out_dir / "drafter.gguf"),
        "pre_tokenizer": gguf_fields(target, build, "tokenizer.ggml.pre").get("tokenizer.ggml.pre"),
        "drafter_fields": drafter_fields,
        # The converter reads model*.safetensors only: the drafter's draft_head.safetensors stays behind, and
        # llama.cpp drafts over the target's whole head (the serve check measures what that costs).
        "draft_vocab_size": config.get("draft_vocab_size"),
        "draft_vocab_carried": False,
        "seconds": round(time.perf_counter() - start, 1),
        "bytes": {name: (out_dir / name).stat().st_size for name in ("target.gguf", "drafter.gguf")},
    }


# llama-server's speculative-decoding counters on /metrics (with --metrics), summed since it started.
COUNTERS = {
    "drafts": "llamacpp:spec_decode_num_drafts_total",
    "draft_tokens": "llamacpp:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "llamacpp:spec_decode_num_accepted_tokens_total",
}
PER_POSITION = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass
class LlamaServer:
    """A running llama-server: greedy completions of token-id prompts, and its counters."""

    url: str

    def _call(self, path: str, body: dict | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return response.read()

    def counters(self) -> dict:
        """Drafts, draft tokens and accepted tokens so far, and accepted tokens per draft position (0 first)."""
        values, per_position = {}, {}
        for line in self._call("/metrics").decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith(PER_POSITION + "{"):
                per_position[int(name.split('position="')[1].split('"')[0])] = float(value)
            elif name in COUNTERS.values():
                values[name] = float(value)
        counted = {key: int(values.get(name, 0)) for key, name in COUNTERS.items()}
        return counted | {"accepted_per_position": [int(per_position[k]) for k in sorted(per_position)]}

    def decode(self, input_ids: list[int], max_new_tokens: int) -> dict:
        """One prompt, greedy, from an empty cache: its tokens, seconds (prefill and decode, as the client waits) and
        what the drafter did for it (the counters' change: ``drafts``, ``accepted_tokens``, ``accepted_per_position``)."""
        before = self.counters()
        start = time.perf_counter()
        body = {"prompt": input_ids, "n_predict": max_new_tokens, "temperature": 0.0, "cache_prompt": False, "return_tokens": True}
        reply = json.loads(self._call("/completion", body))
        seconds = time.perf_counter() - start
        after = self.counters()
        earlier = before["accepted_per_position"]  # the per-position series appear with the first draft, never shrink
        return {
            "tokens": reply["tokens"],
            "seconds": seconds,
            "stop_type": reply.get("stop_type"),
            **{key: after[key] - before[key] for key in COUNTERS},
            "accepted_per_position": [n - (earlier[k] if k < len(earlier) else 0) for k, n in enumerate(after["accepted_per_position"])],
        }


@contextmanager
def llama_server(
    build: dict, model: Path, log_path: Path, context: int, drafter: Path | None = None, draft_tokens: int = 0, port: int | None = None, timeout: int = 300
) -> Iterator[LlamaServer]:
    """``llama-server`` of ``model`` on 127.0.0.1 for the block, one sequence at a time, with ``drafter`` drafting
    ``draft_tokens`` per step by DFlash where given; on ``port`` (checked to be free) or a free one."""
    port = require_free_port(port, "serve.llamacpp.port") if port else free_port()
    command = [build["server"], "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(cpu_threads()), "-c", str(context), "-np", "1"]
    command += ["--metrics", "--no-webui"]
    if drafter is not None:
        command += ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_tokens)]
    url = f"http://127.0.0.1:{port}"
    log.info("llama-server: %s", " ".join(command))
    with local_server(command, "llama-server", f"{url}/health", log_path, timeout, "serve.llamacpp.startup_timeout_s"):
        yield LlamaServer(url)
