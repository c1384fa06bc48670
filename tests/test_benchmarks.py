"""The data-ceiling benchmark's pieces, on hand-made samples with known answers."""

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

spec = importlib.util.spec_from_file_location("data_ceiling", Path(__file__).resolve().parents[1] / "benchmarks" / "data_ceiling.py")
data_ceiling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(data_ceiling)


def test_first_position_examples_follow_the_training_anchor_rule():
    # Sample 0: prompt 10 11, response 12 13 14 (loss mask on 2..4): anchors 2 and 3 (t and t+1 in the mask).
    # Sample 1: response starts at 1: anchors 1, 2; never 0 (no features before it).
    samples = pd.DataFrame({"input_ids": [[10, 11, 12, 13, 14], [20, 21, 22, 23]], "loss_mask": [[0, 0, 1, 1, 1], [1, 1, 1, 1]]})
    # Features of a token: its position in the sample, in every column.
    cache = [torch.arange(5.0)[:, None].expand(5, 3), torch.arange(4.0)[:, None].expand(4, 3)]
    current, features, following, sample_of = data_ceiling.first_position_examples(samples, cache)
    assert current.tolist() == [12, 13, 21, 22]
    assert following.tolist() == [13, 14, 22, 23]
    assert features[:, 0].tolist() == [1.0, 2.0, 0.0, 1.0]  # the features at t-1
    assert sample_of.tolist() == [0, 0, 1, 1]


def test_bigram_table_predicts_the_most_frequent_follower():
    current = torch.tensor([1, 1, 1, 2, 1, 2, 3])
    following = torch.tensor([5, 5, 6, 7, 5, 8, 9])
    train = torch.tensor([True, True, True, True, False, False, False])
    test = ~train
    # 1 → 5 (seen twice against 6 once): right; 2 → 7 but the answer is 8: wrong; 3 never seen: wrong.
    assert data_ceiling.bigram_accuracy(current, following, train, test) == pytest.approx(1 / 3)


@pytest.mark.slow
def test_gpu_check_runs_its_whole_path_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.sh without a GPU: regeneration, warmup, training, evaluation and the DDP cache check,
    on the tiny chat target, printing the figures it promises."""
    import json
    import os
    import subprocess
    import sys

    from tiny_chat_target import build_tiny_inputs

    tiny = build_tiny_inputs(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me fact number {i} about rivers."}) + "\n" for i in range(40)))
    root = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        OUT=str(tmp_path / "out"),
        TARGET=str(tiny / "target"),
        PROMPT_SOURCE=str(prompts),
        DRAFT_VOCAB="null",
        PROMPTS="24",
        NEW_TOKENS="8",
        STEPS="4",
        EVAL="1",
        TQDM_DISABLE="1",
    )
    done = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh")], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "device: cpu" in lines
    for stage in ("prepare_target", "prepare_data", "warmup_cache", "train", "evaluate", "ddp_warm_cache"):
        assert any(line.startswith(f"{stage}: ") for line in lines), stage
    assert any(line.startswith("chat: tau ") and line.endswith("lossless True") for line in lines), lines
    assert any(line.startswith("humaneval: tau ") for line in lines)
    assert any("training: " in line and "peak memory" in line for line in lines)
    assert (tmp_path / "out" / "train" / "drafter" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_device_kit_passes_its_rehearsal_on_the_device_image(tmp_path):
    """benchmarks/device_kit_rehearsal.sh: a fresh venv with the lent GPU machine's packages (transformers 5.17, no
    snakemake, datasets, wandb), offline, runs every part of the kit's CPU path."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    venv = os.environ.get("DFLASH_REHEARSAL_VENV", str(tmp_path / "venv"))
    env = dict(os.environ, OUT=str(tmp_path / "out"), TQDM_DISABLE="1")
    done = subprocess.run(["bash", str(root / "benchmarks" / "device_kit_rehearsal.sh"), venv], cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kit = json.loads((tmp_path / "out" / "kit.json").read_text())
    parts = kit["parts"]
    assert parts["environment"]["transformers"] == "5.17.0"
    assert all(part["ok"] for part in parts.values()), {name: part.get("error") for name, part in parts.items()}
    assert parts["train_step"]["steps"] == 3 and parts["train_step"]["tokens_per_second"] > 0
    assert parts["compile_cache"]["warm_loads_every_graph"] and parts["compile_cache"]["cold"]["fxgraph_cache_miss"] > 0
    assert parts["regeneration"]["complete"] and parts["regeneration"]["requests"] == 6
    assert parts["decode"]["lossless"] and parts["decode"]["compared"] == 6 and parts["decode"]["verify_cost"]["1"] == 1.0
    assert "device kit: 5/5 parts ok" in done.stdout
