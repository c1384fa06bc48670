"""The draft vocabulary: which tokens a drafter drafts, how batches label them, and how it is saved beside the drafter."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from dflash.batch import TargetRow, make_batch
from dflash.config import TrainConfig
from dflash.errors import InputError
from dflash.model import DFlashDrafter
from dflash.vocab import FILE_NAME, DraftVocab


def test_the_most_frequent_tokens_and_the_stop_tokens():
    # Counts: 5 x3, 3 x3, 7 x1, 9 x1; the stop token 9 is always in; then by count, ties by id.
    vocab = DraftVocab.most_frequent([[5, 5, 5, 3, 3, 9], [3, 7]], size=3, vocab_size=10, always=[9])
    assert vocab.token_ids.tolist() == [3, 5, 9] and len(vocab) == 3
    assert vocab.index.tolist() == [-1, -1, -1, 0, -1, 1, -1, -1, -1, 2]
    assert vocab.coverage([3, 5, 7, 9]) == 0.75
    assert len(DraftVocab.most_frequent([[1, 1, 2]], size=50, vocab_size=10)) == 2  # fewer distinct tokens than asked
    with pytest.raises(InputError, match=r"target ids in \[0, 10\)"):
        DraftVocab.of([3, 12], vocab_size=10)


def test_batch_labels_are_draft_indices_and_other_tokens_train_nothing(tiny_drafter_config):
    samples = pd.DataFrame({"input_ids": [[1, 2, 3, 4, 5, 6]], "loss_mask": [[0, 1, 1, 1, 1, 1]]})
    ids = samples["input_ids"][0]
    rows = [TargetRow(torch.zeros(6, 3 * 64), torch.tensor(ids[1:] + [0]))]  # the target wrote the text
    cfg = TrainConfig(max_anchors=4, sample_loss_positions=False, gamma=1e9)
    full = make_batch(samples, [0], rows, tiny_drafter_config, cfg, seed=0, epoch=0)
    vocab = DraftVocab.of([2, 3, 5], tiny_drafter_config.vocab_size)  # not 4 nor 6
    drafted = make_batch(samples, [0], rows, tiny_drafter_config, cfg, seed=0, epoch=0, vocab=vocab)
    weighted = full.blocks.weights > 0
    assert torch.equal(drafted.blocks.weights > 0, weighted & (vocab.index[full.blocks.labels] >= 0))
    assert torch.equal(vocab.token_ids[drafted.blocks.labels][drafted.blocks.weights > 0], full.blocks.labels[drafted.blocks.weights > 0])
    assert drafted.weight_total == drafted.blocks.weights.sum() < full.weight_total


def test_the_vocabulary_is_saved_in_vllms_form_beside_the_reference_weights(tmp_path, tiny_drafter_config):
    """``draft_head.safetensors`` holds the head rows and EAGLE-3's ``d2t`` offsets (target id = draft id + d2t), and
    ``config.json`` the ``draft_vocab_size``: what vLLM's DFlash loader reads. ``model.safetensors`` is unchanged."""
    drafter = DFlashDrafter(tiny_drafter_config)
    drafter.draft_vocab = DraftVocab.of([7, 2, 99], tiny_drafter_config.vocab_size)
    head = torch.randn(tiny_drafter_config.vocab_size, tiny_drafter_config.hidden_size)
    with pytest.raises(ValueError, match="lm_head_weight"):
        drafter.save_pretrained(tmp_path)
    drafter.save_pretrained(tmp_path, head)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", FILE_NAME, "model.safetensors"]
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(DFlashDrafter(tiny_drafter_config).state_dict())
    vllm = load_file(str(tmp_path / FILE_NAME))
    assert vllm["d2t"].tolist() == [2 - 0, 7 - 1, 99 - 2] and torch.equal(vllm["lm_head.weight"], head[[2, 7, 99]])
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 3
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.draft_vocab.token_ids.tolist() == [2, 7, 99] and loaded.draft_vocab.index.numel() == tiny_drafter_config.vocab_size
    # A drafter without one, saved over it, drafts over the whole vocabulary again.
    DFlashDrafter(tiny_drafter_config).save_pretrained(tmp_path)
    assert not (tmp_path / FILE_NAME).exists() and DFlashDrafter.from_pretrained(tmp_path).draft_vocab is None
    assert "draft_vocab_size" not in json.loads((tmp_path / "config.json").read_text())


def test_older_vocabulary_files_still_load_and_saving_replaces_them(tmp_path, tiny_drafter_config):
    """Drafters saved with the JSON vocabulary, or the older safetensors one (whose tensor vLLM rejects), load with
    their vocabulary; saving over them leaves the current form only. A broken file is named."""
    from safetensors.torch import save_file

    drafter = DFlashDrafter(tiny_drafter_config)
    drafter.save_pretrained(tmp_path)
    save_file({"token_ids": torch.tensor([3, 5])}, str(tmp_path / "draft_vocab.safetensors"), metadata={"vocab_size": str(tiny_drafter_config.vocab_size)})
    assert DFlashDrafter.from_pretrained(tmp_path).draft_vocab.token_ids.tolist() == [3, 5]
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"vocab_size": tiny_drafter_config.vocab_size, "token_ids": [6, 1]}))
    assert DFlashDrafter.from_pretrained(tmp_path).draft_vocab.token_ids.tolist() == [1, 6]
    drafter.draft_vocab = DraftVocab.of([4], tiny_drafter_config.vocab_size)
    drafter.save_pretrained(tmp_path, torch.zeros(tiny_drafter_config.vocab_size, tiny_drafter_config.hidden_size))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", FILE_NAME, "model.safetensors"]
    assert DFlashDrafter.from_pretrained(tmp_path).draft_vocab.token_ids.tolist() == [4]
    (tmp_path / FILE_NAME).write_bytes(b"not safetensors")
    with pytest.raises(InputError, match="no readable draft vocabulary"):
        DFlashDrafter.from_pretrained(tmp_path)
