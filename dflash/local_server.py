"""A server this process starts on 127.0.0.1 for a block of work: waited for until it answers, stopped after.

vLLM's OpenAI server (``dflash.vllm_env``) and llama.cpp's ``llama-server`` (``dflash.llamacpp``) run this way.
Whatever happens inside the block, the server is stopped on the way out; a server that exits while starting,
or never answers, is an ``InputError`` naming its log.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash.errors import InputError

STOP_S = 30  # after SIGTERM, how long a server has to exit before it is killed


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def require_free_port(port: int, setting: str) -> int:
    """``port`` on 127.0.0.1, checked to be free (a server started on a taken one would fail, or answer for another)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            raise InputError(
                f"port {port} on 127.0.0.1 is in use ({err.strerror}): stop what listens there, or leave {setting} unset for a free port"
            ) from None
    return port


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


@contextmanager
def local_server(
    command: list[str], name: str, ready_url: str, log_path: Path, timeout: int, setting: str, env: dict | None = None
) -> Iterator[subprocess.Popen]:
    """``command`` started with its output in ``log_path``; the block runs once ``ready_url`` answers 200, within
    ``timeout`` seconds (the config's ``setting``, named in the error)."""
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise InputError(f"{name} exited with status {server.returncode} while starting; its log: {log_path}:\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(ready_url, timeout=5):
                    break
            except OSError:  # not listening yet, or answering 503 while it loads
                if time.monotonic() > deadline:
                    raise InputError(f"{name} did not answer {ready_url} within {timeout} s ({setting}); its log: {log_path}") from None
                time.sleep(0.5)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
