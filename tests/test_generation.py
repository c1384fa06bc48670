"""Regeneration at scale: on several processes, resumable after kill -9, and through a real inference server.

All on the tiny chat target of the workflow tests (a random Llama with a ChatML tokenizer), through the
command line the workflow runs (``python -m dflash prepare-data``), each run in its own directories.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from tiny_chat_target import build_tiny_inputs

from dflash.config import GenerationConfig, ServerConfig
from dflash.errors import InputError
from dflash.generation import ServerEngine
from dflash.local_server import free_port
from dflash.target import Target, write_manifest

pytestmark = pytest.mark.slow

PROMPTS = [f"Tell me about the river number {i} in the city." for i in range(10)] + [f"Write a python function number {i}." for i in range(8)]


def data_section(chunk_size: int = 3, **generation) -> dict:
    return {
        "prompts": {"source": "", "limit": None},
        "heldout_fraction": 0.1,
        "heldout_limit": 1,
        "validation": 1,
        "max_length": 128,
        "generation": {"max_new_tokens": 12, "batch_size": 2, "chunk_size": chunk_size, "dtype": "float32", "batching": "padded"} | generation,
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The tiny chat model, its prepare_target manifest, and a prompt file."""
    root = tmp_path_factory.mktemp("generation")
    tiny = build_tiny_inputs(root / "tiny")
    manifest = root / "target.json"
    write_manifest(str(tiny / "target"), "float32", manifest)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return {"model": tiny / "target", "manifest": manifest, "prompts": prompts}


def command(inputs, work: Path, data: dict, nproc: int = 1) -> list[str]:
    data = json.loads(json.dumps(data))
    data["prompts"]["source"] = str(inputs["prompts"])
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [
        *launcher, "-m", "dflash", "prepare-data", "--data", json.dumps(data), "--topology", "{}", "--seed", "0",
        "--target-manifest", str(inputs["manifest"]), "--out-dir", str(work / "data"), "--chunk-dir", str(work / "chunks"),
    ]  # fmt: skip


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DFLASH_CPU_THREADS="1", TQDM_DISABLE="1")


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout + done.stderr


def reused(output: str) -> tuple[int, int]:
    """(regenerated, found in complete chunks), as the stage logs them."""
    line = next(line for line in output.splitlines() if "found in complete chunks" in line)
    words = line.split("regenerated ")[1].split()
    return int(words[0]), int(words[2])


def samples(work: Path) -> pd.DataFrame:
    return pd.read_parquet(work / "data" / "train.parquet")


def test_four_processes_regenerate_what_one_does(tmp_path, inputs):
    """Chunks are cut and batched the same way whatever the world size: the same greedy samples, bit for bit."""
    one = run(command(inputs, tmp_path / "one", data_section()))
    assert reused(one) == (len(PROMPTS) - 1, 0)  # every prompt but the held-out evaluation one
    four = run(command(inputs, tmp_path / "four", data_section(), nproc=4))
    assert reused(four) == (len(PROMPTS) - 1, 0)
    pd.testing.assert_frame_equal(samples(tmp_path / "one"), samples(tmp_path / "four"))
    for name in ("validation.parquet", "heldout.jsonl", "card.json"):
        expected, got = (tmp_path / run_dir / "data" / name for run_dir in ("one", "four"))
        assert expected.read_bytes() == got.read_bytes() or name == "card.json", name
    # Files of the chunks, one per chunk of 3 requests, every one complete.
    assert len(list((tmp_path / "four" / "chunks").glob("chunk-*.parquet"))) == -(-(len(PROMPTS) - 1) // 3)


def test_a_killed_regeneration_resumes_from_its_complete_chunks(tmp_path, inputs):
    data = data_section(chunk_size=1, batch_size=1)
    process = subprocess.Popen(command(inputs, tmp_path, data), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    chunks = tmp_path / "chunks"
    deadline = time.monotonic() + 300
    while len(list(chunks.glob("chunk-*.parquet"))) < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "regeneration ended before it could be killed"
    complete = len(list(chunks.glob("chunk-*.parquet")))
    assert 3 <= complete < len(PROMPTS) - 1
    assert not (tmp_path / "data" / "train.parquet").exists()
    output = run(command(inputs, tmp_path, data))
    assert reused(output) == (len(PROMPTS) - 1 - complete, complete)  # only what no complete chunk held
    reference = tmp_path / "reference"
    run(command(inputs, reference, data))
    pd.testing.assert_frame_equal(samples(tmp_path), samples(reference))
    # A changed generation setting shapes every response anew: no chunk is reused.
    output = run(command(inputs, tmp_path, data_section(chunk_size=1, batch_size=1, max_new_tokens=10)))
    assert reused(output) == (len(PROMPTS) - 1, 0)


# -- a real inference server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(inputs):
    """``transformers serve`` on 127.0.0.1 with the tiny chat target, started and stopped by the test."""
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    process = subprocess.Popen(
        [str(cli), "serve", str(inputs["model"]), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"transformers serve exited {process.returncode}: {process.stderr.read()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.5)
    yield {"url": url, "model": str(inputs["model"])}
    process.terminate()
    process.wait(timeout=60)


def assert_served_as_local(model: Path, local: Path, served: Path, max_new_tokens: int) -> None:
    """The samples regenerated through a server (in ``served``) are those regenerated in process (in ``local``), seen
    through text: the prompts identical, each response the target's tokenization of the text of the in-process ids."""
    expected, got = samples(local), samples(served)
    assert expected["prompt_id"].tolist() == got["prompt_id"].tolist()
    target = Target.load(str(model))
    tokenizer, eos = target.tokenizer, set(target.eos_token_ids)
    for (ids, mask), (served_ids, served_mask) in zip(zip(expected["input_ids"], expected["loss_mask"]), zip(got["input_ids"], got["loss_mask"])):
        prompt, response = [t for t, m in zip(ids, mask) if not m], [t for t, m in zip(ids, mask) if m]
        assert prompt and [t for t, m in zip(served_ids, served_mask) if not m] == prompt
        body = [t for t in response if t not in eos]
        as_text = tokenizer.encode(tokenizer.decode(body, skip_special_tokens=True), add_special_tokens=False) + response[len(body) :]
        as_text = as_text[:max_new_tokens]  # the response budget, as in-process
        assert response and [t for t, m in zip(served_ids, served_mask) if m] == as_text  # never two empty sides


def test_server_regeneration_equals_in_process_greedy_regeneration(tmp_path, inputs, server):
    """What is compared: each sample's tokens. The prompt's must be identical: both paths apply the target's chat
    template. A server returns text, not ids, and the random tiny model writes byte tokens that are not valid UTF-8,
    which no text round-trips; so the server's response must be exactly the target's tokenization of the text of the
    in-process greedy ids (and its EOS where the model stopped), the same greedy decode seen through text, cut to
    the same budget of data.generation.max_new_tokens."""
    local = run(command(inputs, tmp_path / "local", data_section()))
    served = run(command(inputs, tmp_path / "server", data_section(engine="server", servers=[server], concurrency=4)))
    assert reused(local) == reused(served) == (len(PROMPTS) - 1, 0)
    assert_served_as_local(inputs["model"], tmp_path / "local", tmp_path / "server", data_section()["generation"]["max_new_tokens"])
    # Resumable as the local engine: a rerun sends nothing.
    assert reused(run(command(inputs, tmp_path / "server", data_section(engine="server", servers=[server], concurrency=4)))) == (0, len(PROMPTS) - 1)


def test_server_errors_are_named(inputs, server):
    target = Target.load(str(inputs["model"]))
    start = time.monotonic()
    with pytest.raises(InputError, match=r"http://127.0.0.1:9/v1 does not answer"):
        ServerEngine(target, GenerationConfig(engine="server", servers=[ServerConfig(url="http://127.0.0.1:9/v1", model="x")]))
    assert time.monotonic() - start < 30  # in seconds, not after the retries a running server would get
    with pytest.raises(InputError, match=r"does not serve model 'no-such-model'"):
        ServerEngine(target, GenerationConfig(engine="server", servers=[ServerConfig(url=server["url"], model="no-such-model")]))


def test_continuous_batching_results_come_back_in_request_order_or_not_at_all():
    from types import SimpleNamespace

    from dflash.generation import continuous_results

    def output(i, tokens, error=None):
        return SimpleNamespace(request_id=f"req_{i}", generated_tokens=tokens, error=error)

    # Out of order, with ids past 9 (sorted as numbers, not text).
    outputs = {f"req_{i}": output(i, [i, i]) for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)}
    assert continuous_results(outputs, 11) == [[i, i] for i in range(11)]
    with pytest.raises(InputError, match=r"10 of 11 .* never returned: \[4\]"):
        continuous_results({k: v for k, v in outputs.items() if k != "req_4"}, 11)
    outputs["req_6"] = output(6, [], error="out of blocks")
    with pytest.raises(InputError, match=r"10 of 11 .*failed: \{6: 'out of blocks'\}"):
        continuous_results(outputs, 11)


def test_the_api_key_comes_from_the_environment_variable_the_config_names(monkeypatch):
    from dflash.generation import api_key

    assert api_key(ServerConfig(url="http://127.0.0.1:9/v1", model="m")) == "EMPTY"
    server = ServerConfig(url="http://127.0.0.1:9/v1", model="m", api_key_env="DFLASH_TEST_KEY")
    monkeypatch.delenv("DFLASH_TEST_KEY", raising=False)
    with pytest.raises(InputError, match=r"\$DFLASH_TEST_KEY, which is not set"):
        api_key(server)
    monkeypatch.setenv("DFLASH_TEST_KEY", "sk-123")
    assert api_key(server) == "sk-123"


def test_a_failed_server_request_surfaces_at_once_and_cancels_the_queue(monkeypatch):
    """One request fails at once while the others would take seconds each: generate raises within a second, and the
    queued requests never start."""
    from dflash.generation import Request

    started = []

    def answer(self, client, server, request):
        started.append(request.prompt_id)
        if request.prompt_id == "0":
            raise InputError("the server rejected prompt 0")
        time.sleep(2.0)
        return [1]

    monkeypatch.setattr(ServerEngine, "_answer", answer)
    engine = object.__new__(ServerEngine)  # no server to check: _answer is replaced
    engine.clients = [(None, ServerConfig(url="http://127.0.0.1:9/v1", model="m"))]
    engine.settings = GenerationConfig(engine="server", concurrency=2)
    begin = time.perf_counter()
    with pytest.raises(InputError, match="rejected prompt 0"):
        engine.generate([Request(str(i), [], [i]) for i in range(20)], seed=0)
    assert time.perf_counter() - begin < 1.5
    assert len(started) <= 3  # the two workers' first requests, and at most one more before the cancel
