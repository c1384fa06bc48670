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
