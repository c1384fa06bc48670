"""vLLM's own environment: building it, running in it, and its OpenAI server of the target.

vLLM pins a transformers older than the project's, so it gets a virtual
environment of its own (``build_env``, the workflow's ``serve_env``), whose
manifest says whether it built. The serve checks (``dflash.serving``) run in it,
and so does regeneration under ``data.generation.engine: vllm`` or ``auto``
(``dflash.generation``), through ``vllm_server``. This module imports nothing of
the project's decoding, so that regeneration's inputs do not include it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash.config import ServeConfig, cpu_threads
from dflash.errors import InputError
from dflash.local_server import free_port, local_server

# In-process engine: vLLM's engine-core process adds nothing to one request at a time, and on a CPU it reserves a
# core of its own for the scheduler (of 2 here). A KV cache of a stated size: without one, vLLM's CPU worker claims
# 92% of the memory and refuses to start when less is free. vLLM also cuts torch to 1 thread unless OMP_NUM_THREADS says.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
SERVER_STARTUP_S = 1800  # torch.compile of the model on a CPU takes minutes the first time (then vLLM caches it)


def vllm_environ() -> dict[str, str]:
    """This process's environment with ``VLLM_ENV``, and torch's threads set to the job's cores (Snakemake sets
    ``OMP_NUM_THREADS`` to the rule's threads, and vLLM would otherwise cut torch to one)."""
    return os.environ | VLLM_ENV | {"OMP_NUM_THREADS": str(cpu_threads())}


def run_command(command: list[str], what: str, timeout: int | None = None, env: dict | None = None, log_path: Path | None = None) -> str:
    """Run ``command``: its standard output, or an ``InputError`` naming ``what`` failed, with its last lines. With
    ``log_path``, both streams go to that file as they come (to follow a long run), and the output returned is empty."""
    try:
        if log_path is None:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
            output = done.stdout + done.stderr
        else:
            with open(log_path, "w") as log:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env)
            output = log_path.read_text()
    except subprocess.TimeoutExpired as err:
        raise InputError(f"{what} did not finish within {timeout} s (serve.timeout_s){f'; its log: {log_path}' if log_path else ''}") from err
    if done.returncode:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise InputError(f"{what} failed (exit status {done.returncode}){f'; its log: {log_path}' if log_path else ''}:\n{tail}")
    return done.stdout if log_path is None else ""


def build_env(env: Path, cfg: ServeConfig) -> dict:
    """A virtual environment at ``env`` with ``cfg.requirements`` installed and ``cfg.uninstall`` removed, in which
    vLLM imports; the versions it holds."""
    python = env / "bin" / "python"
    if not python.exists():
        run_command([sys.executable, "-m", "venv", str(env)], f"creating a virtual environment at {env}")
    run_command([str(python), "-m", "pip", "install", "--quiet", *cfg.requirements], f"pip install {' '.join(cfg.requirements)} (serve.requirements)")
    if cfg.uninstall:
        run_command([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *cfg.uninstall], f"pip uninstall {' '.join(cfg.uninstall)}")
    probe = "import json, torch, transformers, vllm; from vllm import LLM; print(json.dumps({m.__name__: m.__version__ for m in (vllm, torch, transformers)}))"
    versions = json.loads(run_command([str(python), "-c", probe], f"importing vLLM in {env} (serve.requirements, serve.uninstall)").strip().splitlines()[-1])
    return {"available": True, "python": str(python)} | versions


def read_env(path: Path) -> dict:
    """The environment ``serve_env`` built (its manifest at ``path``), or an ``InputError`` saying why there is none."""
    manifest = json.loads(Path(path).read_text())
    if not manifest.get("available"):
        raise InputError(f"vLLM's environment is not available ({manifest.get('reason')}): fix that and rebuild it with `snakemake --forcerun serve_env`")
    return manifest


@contextmanager
def vllm_server(python: str, target_dir: str, dtype: torch.dtype, max_model_len: int, log_path: Path, timeout: int = SERVER_STARTUP_S):
    """vLLM's OpenAI-compatible server of the target on 127.0.0.1 (served as ``target``) for the block: its base URL.
    Start-up waits until it answers, fails at once naming its log if it exits, and the server is stopped after."""
    port = free_port()
    # The module `vllm serve` runs: the `vllm` command of vllm-cpu 0.32 looks up the version of a distribution named
    # "vllm", and that one is named vllm-cpu.
    command = [python, "-m", SERVER_MODULE, "--model", target_dir, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "target"]
    command += ["--dtype", str(dtype).removeprefix("torch."), "--max-model-len", str(max_model_len)]
    url = f"http://127.0.0.1:{port}/v1"
    with local_server(command, "vllm serve", f"{url}/models", log_path, timeout, "serve.timeout_s", vllm_environ()):
        yield url
