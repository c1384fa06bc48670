"""The hidden-state cache: what it stores reads back, and a disk or a dtype that cannot hold it is a named error."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest
import torch
from conftest import build_target, qwen3_config, random_prompt

from dflash import features as F
from dflash.errors import InputError
from dflash.features import HiddenStateCache, OnlineFeatures

LAYERS = [1, 3, 5]


def _features(target=None):
    target = target or build_target(qwen3_config(), seed=2)
    samples = pd.DataFrame({"input_ids": [random_prompt(n, n)[0].tolist() for n in (5, 9, 12)]})
    return OnlineFeatures(target, samples, LAYERS)


def test_the_cache_reads_back_what_the_target_computed(tmp_path):
    features = _features()
    cache = HiddenStateCache.build(tmp_path, features)
    for i, row in enumerate(features.rows([0, 1, 2])):
        stored = cache[i]
        torch.testing.assert_close(stored.features, row.features.float(), rtol=1e-3, atol=1e-3)  # fp16 on disk
        assert torch.equal(stored.greedy, row.greedy)


def test_hidden_states_beyond_fp16_are_a_named_error_and_leave_no_cache(tmp_path):
    target = build_target(qwen3_config(), seed=2)
    with torch.no_grad():
        target.model.get_input_embeddings().weight.mul_(1e6)  # layer 1's input is the embedding: far beyond 65504
    with pytest.raises(InputError, match="beyond fp16's range.*train.hidden_states: online"):
        HiddenStateCache.build(tmp_path, _features(target))
    assert not (tmp_path / "meta.json").exists() and not list(tmp_path.glob("*.npy"))


def test_a_disk_too_small_for_the_cache_is_named_before_any_write(tmp_path, monkeypatch):
    monkeypatch.setattr(F.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(InputError, match=r"needs 0\.00 GB under .* where 0\.00 GB are free"):
        HiddenStateCache.build(tmp_path, _features())
    assert not list(tmp_path.glob("*.npy"))
