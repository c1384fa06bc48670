"""Resuming training after kill -9: of the training command mid-run, and of a process writing a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from tiny_chat_target import build_tiny_chat_target

from dflash.checkpoint import complete_checkpoints, resume_point, write_checkpoint
from dflash.distributed import single_process
from dflash.preflight.synthetic import synthetic_samples
from dflash.target import write_manifest

TRAIN = {"epochs": 3, "batch_size": 2, "max_anchors": 8, "compile": False, "checkpoint_every": 4, "log_every": 2}
DRAFTER = {"num_hidden_layers": 1, "num_context_features": 2, "block_size": 4}
STEPS = 3 * 20 // 2


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A saved tiny chat target (loaded through the manifest, as training loads it) and 20 samples."""
    root = tmp_path_factory.mktemp("inputs")
    model_dir = build_tiny_chat_target(root / "model")
    manifest = root / "target.json"
    vocab = write_manifest(str(model_dir), "float32", manifest)["vocab_size"]
    samples = root / "train.parquet"
    synthetic_samples([24 + (5 * i) % 40 for i in range(20)], vocab, seed=1).to_parquet(samples)
    return manifest, samples


def train_command(inputs, work: Path, **train) -> list[str]:
    manifest, samples = inputs
    return [
        sys.executable, "-m", "dflash", "train",
        "--drafter", json.dumps(DRAFTER), "--train", json.dumps(TRAIN | train), "--topology", "{}", "--tracking", json.dumps({"wandb_mode": "disabled"}),
        "--target-manifest", str(manifest), "--samples", str(samples),
        "--out-dir", str(work / "train"), "--checkpoint-dir", str(work / "cache"),
    ]  # fmt: skip


def run_to_end(command: list[str]) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((Path(command[command.index("--out-dir") + 1]) / "summary.json").read_text())


def checkpoint_steps(cache: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in cache.glob("*/step-*") if (p / "meta.json").is_file())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_kill_9_mid_run_then_rerun_ends_with_the_uninterrupted_weights(tmp_path, inputs, optimizer):
    """Every optimizer's state and schedule resume: Muon's momentum and AdamW's moments, each part's schedule."""
    uninterrupted = run_to_end(train_command(inputs, tmp_path / "a", optimizer=optimizer))
    assert uninterrupted["resumed_from"] == 0 and uninterrupted["steps"] == STEPS

    command = train_command(inputs, tmp_path / "b", optimizer=optimizer)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 300
    while not checkpoint_steps(tmp_path / "b" / "cache") and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "training ended before it could be killed"
    killed_at = checkpoint_steps(tmp_path / "b" / "cache")
    assert killed_at and max(killed_at) < STEPS
    assert not (tmp_path / "b" / "train" / "drafter").exists()

    resumed = run_to_end(command)
    assert resumed["resumed_from"] == max(killed_at)
    expected = load_file(str(tmp_path / "a" / "train" / "drafter" / "model.safetensors"))
    for name, tensor in load_file(str(tmp_path / "b" / "train" / "drafter" / "model.safetensors")).items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    metrics = [pd.read_csv(tmp_path / run / "train" / "metrics.csv").drop(columns="tokens_per_s") for run in ("a", "b")]
    pd.testing.assert_frame_equal(*metrics, rtol=1e-6)


WRITER = """
import sys, torch
from pathlib import Path
from dflash.checkpoint import write_checkpoint
directory = Path(sys.argv[1])
write_checkpoint(directory, 1, {"weights": torch.ones(4)})
print("first written", flush=True)
write_checkpoint(directory, 2, {"weights": torch.ones(64_000_000)})  # 256 MB: long enough to be killed mid-write
"""


def test_kill_9_while_writing_a_checkpoint_leaves_none_that_would_load(tmp_path):
    directory = tmp_path / "checkpoints"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "first written"
    staging = directory / ".tmp-step-00000002"
    deadline = time.monotonic() + 120
    while not (staging / "state.pt").exists() and writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    writer.send_signal(signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL, "the checkpoint was written before the writer could be killed"
    assert staging.exists()  # killed mid-write: the half-written checkpoint is there, under its temporary name

    assert [p.name for p in complete_checkpoints(directory)] == ["step-00000001"]
    step, path = resume_point(directory, single_process())
    assert step == 1 and torch.equal(torch.load(path / "state.pt", weights_only=True)["weights"], torch.ones(4))
    assert not staging.exists()  # resuming cleared the leftover
    write_checkpoint(directory, 2, {"weights": torch.zeros(4)})  # and the step can be written again
    assert [p.name for p in complete_checkpoints(directory)] == ["step-00000001", "step-00000002"]
