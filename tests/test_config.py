import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import jsonschema
import pytest
import yaml

from dflash.config import Config, ConfigError, canonical_json, check_local_sources, load_config

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())


def test_empty_config_takes_every_default():
    c = load_config({})
    assert c.target.source == "embedded"
    assert c.drafter.block_size == 16
    assert c.train.hidden_states == "cache"
    assert [s.name for s in c.eval.sets] == ["chat", "humaneval"]


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"train": {"lrr": 1e-3}}, "train.lrr"),
        ({"train": {"lr": "fast"}}, "train.lr"),
        ({"train": {"epochs": 0}}, "train.epochs"),
        ({"train": {"attention_backend": "xformers"}}, "train.attention_backend"),
        ({"drafter": {"block_size": 1}}, "drafter.block_size"),
        ({"data": {"generation": {"batch_size": True}}}, "data.generation.batch_size"),
        ({"eval": {"sets": [{"name": "x"}]}}, "eval.sets[0].source"),
        ({"topology": {"kind": "split", "nproc_per_node": 8, "target_ranks": 8}}, "topology.target_ranks"),
        ({"topology": {"target_ranks": 2}}, "topology.target_ranks"),
        ({"bogus": 1}, "bogus"),
        # Text from the command line that does not parse as the declared type.
        ({"train": {"epochs": "3.5"}}, "train.epochs"),
        ({"train": {"compile": "yes"}}, "train.compile"),
        ({"train": {"lr": "nan"}}, "train.lr"),
        ({"drafter": {"layer_ids": ["1", "x"]}}, "drafter.layer_ids"),
        ({"eval": {"verify_cost": [1.0, 0.0]}}, "eval.verify_cost"),
        ({"eval": {"branches": 3, "gate": False}}, "eval.branches"),
        ({"eval": {"linear_kernel": "mkl"}}, "eval.linear_kernel"),
        # Declared bounds, nested and in lists included.
        ({"data": {"max_length": 4}}, "data.max_length: must be at least 8, got 4"),
        ({"eval": {"sets": [{"name": "x", "source": "heldout", "limit": 0}]}}, "eval.sets[0].limit: must be at least 1"),
        ({"serve": {"tolerance": 1.0}}, "serve.tolerance: must be less than 1.0"),
        ({"data": {"generation": {"top_p": 1.5}}}, "data.generation.top_p: must be at most 1.0"),
        ({"train": {"grad_clip": 0}}, "train.grad_clip: must be greater than 0.0"),
        ({"train": {"optimizer": "sgd"}}, "train.optimizer"),
        ({"train": {"position_weights": "dpace", "sample_loss_positions": True}}, "train.position_weights: dpace weighs each position"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(raw, key):
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert str(err.value).startswith(key), str(err.value)


@pytest.mark.parametrize(
    "raw, dotted, expected",
    [
        ({"train": {"epochs": "3"}}, "train.epochs", 3),
        ({"train": {"lr": "0.002"}}, "train.lr", 0.002),
        ({"train": {"lr": "6.0e-4"}}, "train.lr", 6e-4),
        ({"train": {"lr": "1"}}, "train.lr", 1.0),
        ({"train": {"compile": "false"}}, "train.compile", False),
        ({"train": {"sample_loss_positions": "True"}}, "train.sample_loss_positions", True),
        ({"drafter": {"layer_ids": ["1", "4", "7"]}}, "drafter.layer_ids", [1, 4, 7]),
        ({"eval": {"block_size": "null"}}, "eval.block_size", None),
        ({"topology": {"device": "cuda"}}, "topology.device", "cuda"),
    ],
)
def test_text_from_the_command_line_takes_the_declared_type(raw, dotted, expected):
    """Snakemake hands nested --config values over as strings (YAML's base loader): "train={'lr': 0.002}" gives '0.002'."""
    value = load_config(raw)
    for part in dotted.split("."):
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


def test_missing_local_sources_are_named(tmp_path):
    cases = [
        ({"data": {"prompts": {"source": str(tmp_path / "prompts.jsonl")}}}, "data.prompts.source"),
        ({"eval": {"sets": [{"name": "x", "source": "./gone/prompts.jsonl"}]}}, "eval.sets[0].source"),
        ({"target": {"source": str(tmp_path / "model-dir")}}, "target.source"),
        ({"target": {"source": "weights/model.gguf"}}, "target.source"),
    ]
    for raw, key in cases:
        with pytest.raises(ConfigError) as err:
            check_local_sources(load_config(raw))
        assert str(err.value).startswith(f"{key}: ") and "does not exist" in str(err.value), str(err.value)


def test_hub_ids_and_existing_local_sources_pass(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    sets = [{"name": "mine", "source": str(tmp_path / "prompts.jsonl")}, {"name": "code", "source": "humaneval"}, {"name": "chat", "source": "heldout"}]
    raw = {"target": {"source": "Qwen/Qwen3-8B"}, "data": {"prompts": {"source": "HuggingFaceH4/ultrachat_200k"}}, "eval": {"sets": sets}}
    check_local_sources(load_config(raw))
    check_local_sources(load_config({}))  # the embedded default


def test_ints_are_accepted_where_floats_are_expected():
    assert load_config({"train": {"lr": 1}}).train.lr == 1.0


def test_canonical_json_ignores_key_order():
    a = load_config({"train": {"lr": 1e-3, "epochs": 2}}).train
    b = load_config({"train": {"epochs": 2, "lr": 1e-3}}).train
    assert canonical_json(a) == canonical_json(b)
    assert canonical_json(a) != canonical_json(load_config({"train": {"lr": 2e-3, "epochs": 2}}).train)


BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _schema_keys(schema, prefix=""):
    """Every key the schema names, with the bounds it declares."""
    keys = {}
    for name, sub in schema.get("properties", {}).items():
        keys[prefix + name] = {b: sub[b] for b in BOUNDS if b in sub}
        if sub.get("type") == "object":
            keys |= _schema_keys(sub, prefix + name + ".")
        if sub.get("type") == "array" and sub.get("items", {}).get("type") == "object":
            keys |= _schema_keys(sub["items"], prefix + name + "[].")
    return keys


def _dataclass_keys(kind, prefix=""):
    """Every key the dataclasses name, with the bounds declared on the field (``config.bounded``)."""
    keys = {}
    hints = typing.get_type_hints(kind)
    for f in fields(kind):
        keys[prefix + f.name] = dict(f.metadata)
        hint = hints[f.name]
        if is_dataclass(hint):
            keys |= _dataclass_keys(hint, prefix + f.name + ".")
        if typing.get_origin(hint) is list and is_dataclass(typing.get_args(hint)[0]):
            keys |= _dataclass_keys(typing.get_args(hint)[0], prefix + f.name + "[].")
    return keys


def test_schema_and_dataclasses_name_the_same_keys_with_the_same_bounds():
    """The bounds are declared on the dataclass fields; the schema, which Snakemake checks at start, must agree."""
    schema, dataclasses_ = _schema_keys(SCHEMA), _dataclass_keys(Config)
    assert set(schema) == set(dataclasses_)
    assert {k: v for k, v in schema.items() if v} == {k: v for k, v in dataclasses_.items() if v}


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*.yaml")))
def test_shipped_configs_pass_schema_and_dataclasses(path):
    raw = yaml.safe_load(path.read_text())
    jsonschema.validate(raw, SCHEMA)
    load_config(raw)


def test_schema_rejects_unknown_keys():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"train": {"lrr": 1}}, SCHEMA)


def test_the_command_line_validates_a_section_as_the_workflow_does(capsys):
    """A range the typed config checks is named on the CLI path too, before any stage runs (not a ZeroDivisionError)."""
    from dflash.cli import main

    paths = ["--target-manifest", "t.json", "--samples", "s.parquet", "--out-dir", "out", "--checkpoint-dir", "ckpt"]
    assert main(["train", "--train", '{"log_every": 0}', *paths]) == 1
    assert "error: train.log_every: must be at least 1, got 0" in capsys.readouterr().err
