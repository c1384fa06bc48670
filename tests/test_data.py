import json

import pandas as pd
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.config import GenerationConfig
from dflash.data import (
    Conversation,
    DataCard,
    build_samples,
    load_conversations,
    read_samples,
    regenerate_responses,
    split_conversations,
)
from dflash.preflight.synthetic import TINY_SHAPE
from dflash.target import Target


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_SHAPE | dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=256, eos_token_id=63, pad_token_id=0))
    return Target.from_model(LlamaForCausalLM(config))


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_prompt_and_messages_records_become_conversations(tmp_path):
    source = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "hello"},
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "answer"},
                    {"role": "user", "content": "second"},
                    {"role": "assistant", "content": "dropped: the target answers itself"},
                ]
            },
            {"prompt": "hello"},  # a duplicate
        ],
    )
    conversations = load_conversations(source)
    assert len(conversations) == 2
    assert conversations[0].as_messages() == [{"role": "user", "content": "hello"}]
    assert [m["content"] for m in conversations[1].as_messages()] == ["be brief", "first", "answer", "second"]


def test_records_without_prompt_columns_are_rejected_naming_the_columns(tmp_path):
    source = _write_jsonl(tmp_path / "p.jsonl", [{"text": "no prompt here"}])
    with pytest.raises(ValueError, match=r"record 0 has neither a 'messages' nor a 'prompt' column \(columns: \['text'\]\)"):
        load_conversations(source)


def test_missing_local_file_and_bad_suffix_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "p.csv"
    bad.write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_conversations(str(bad))


def test_embedded_prompts_split_without_overlap():
    conversations = load_conversations("embedded")
    assert len(conversations) == 3014
    train, heldout = split_conversations(conversations, 0.05, seed=0)
    assert len(train) + len(heldout) == len(conversations)
    assert not {c.prompt_id for c in train} & {c.prompt_id for c in heldout}
    assert 0.03 < len(heldout) / len(conversations) < 0.07
    again, _ = split_conversations(list(reversed(conversations)), 0.05, seed=0)
    assert {c.prompt_id for c in again} == {c.prompt_id for c in train}


def test_samples_mask_the_prompt_and_count_drops():
    conversations = [Conversation.from_messages([{"role": "user", "content": str(i)}]) for i in range(4)]
    prompts = [[1, 2, 3], [1, 2], [1] * 9, [4, 5]]
    responses = [[7, 8, 63], [9], [7, 7], [6, 6, 6, 6, 6, 6, 6, 6]]
    card = DataCard(source="test")
    frame = build_samples(conversations, prompts, responses, max_length=8, stop_token_ids=[63], card=card)
    assert frame["input_ids"].tolist() == [[1, 2, 3, 7, 8, 63], [4, 5, 6, 6, 6, 6, 6, 6]]
    assert frame["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert card.samples == 2 and card.response_tokens == 9 and card.prompt_tokens == 5
    assert card.truncated_responses == 1
    assert card.dropped == {"response shorter than 2 tokens": 1, "prompt longer than data.max_length - 1 (7 tokens)": 1}


def test_batched_regeneration_equals_one_prompt_at_a_time(tiny_target):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [3, 4, 5, 6, 7, 8, 9, 10]]
    batched = regenerate_responses(tiny_target, prompts, GenerationConfig(max_new_tokens=12, batch_size=3))
    for prompt, response in zip(prompts, batched):
        ids = torch.tensor([prompt])
        alone = tiny_target.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()
        if 63 in alone:
            alone = alone[: alone.index(63) + 1]
        assert response == alone


def test_read_samples_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="run the prepare_data stage first"):
        read_samples(tmp_path / "train.parquet")
    pd.DataFrame({"input_ids": [[1, 2]]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt_id', 'loss_mask'\]"):
        read_samples(tmp_path / "bad.parquet")
