"""The DFlash drafter: a block-diffusion transformer conditioned on target hidden states.

Reads top to bottom: config, norms and RoPE, one decoder layer with KV injection,
the drafter, and the checkpoint format of the reference implementations
(``config.json`` + ``model.safetensors``, loadable by SGLang, vLLM and the
authors' ``dflash`` package).

The drafter never holds the target's embedding or LM head: callers embed the
block with the target's frozen embedding and project the drafter's output
with the target's frozen LM head (its rows of the drafter's draft vocabulary,
``dflash.vocab``, when it has one).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dflash.attention import TrainingMask, attend, drafted_rows
from dflash.config import MIN_BLOCK_SIZE, DrafterConfig
from dflash.errors import InputError, MissingInputError
from dflash.io import atomic_path, atomic_write_text, discard
from dflash.vocab import FILE_NAME as VOCAB_FILE
from dflash.vocab import OLDER_FILE_NAMES as OLDER_VOCAB_FILES
from dflash.vocab import DraftVocab

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The reference rule for which target layers feed the drafter.

    One feature takes the middle layer; more spread evenly from layer 1 to
    layer T-3 (Python's round, as the reference uses).
    """
    if num_features < 1:
        raise InputError(f"num_features must be at least 1, got {num_features}")
    if num_target_layers < 4 and num_features > 1:
        raise InputError(f"a target with {num_target_layers} layers is too shallow for {num_features} features")
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass
class DFlashConfig:
    """Shape of a drafter. ``hidden_size`` and ``vocab_size`` must match the target's."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str = "bfloat16"

    @property
    def feature_width(self) -> int:
        """The width of the context features it reads: its target layers' hidden states, concatenated."""
        return len(self.target_layer_ids) * self.hidden_size

    def __post_init__(self):
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.block_size < MIN_BLOCK_SIZE:
            problems.append(f"block_size must be at least {MIN_BLOCK_SIZE}, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        bad_ids = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if not self.target_layer_ids or bad_ids:
            problems.append(f"target_layer_ids {self.target_layer_ids} must be non-empty ids in [0, {self.num_target_layers})")
        if problems:
            raise InputError("invalid DFlashConfig: " + "; ".join(problems))

    @classmethod
    def for_target(cls, target_config, drafter: DrafterConfig, mask_token_id: int) -> DFlashConfig:
        """A drafter shaped like the target's own layers (a transformers config), unless the config's ``drafter``
        section says otherwise (which tokens it drafts, ``draft_vocab_size``, is not its shape: ``dflash.vocab``)."""
        num_target_layers = target_config.num_hidden_layers
        target_heads = target_config.num_attention_heads
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=drafter.intermediate_size or target_config.intermediate_size,
            num_hidden_layers=drafter.num_hidden_layers,
            num_attention_heads=drafter.num_attention_heads or target_heads,
            num_key_value_heads=drafter.num_key_value_heads or getattr(target_config, "num_key_value_heads", None) or target_heads,
            head_dim=drafter.head_dim or getattr(target_config, "head_dim", None) or target_config.hidden_size // target_heads,
            vocab_size=target_config.vocab_size,
            num_target_layers=num_target_layers,
            target_layer_ids=list(drafter.layer_ids or target_layer_ids(num_target_layers, drafter.num_context_features)),
            mask_token_id=mask_token_id,
            block_size=drafter.block_size,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 1_000_000.0))),
            max_position_embeddings=target_config.max_position_embeddings,
            bos_token_id=getattr(target_config, "bos_token_id", None),
            eos_token_id=getattr(target_config, "eos_token_id", None),
        )

    # -- the reference config.json --------------------------------------------------------

    def to_reference_dict(self) -> dict:
        """``config.json`` exactly as the reference checkpoints write it (a Qwen3 config plus DFlash fields)."""
        import transformers

        return {
            "architectures": ["DFlashDraftModel"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": self.block_size,
            "bos_token_id": self.bos_token_id,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "dtype": self.dtype,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "transformers_version": transformers.__version__,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_reference_dict(cls, data: dict, source: str = "config") -> DFlashConfig:
        """Read a reference ``config.json``; ``block_size`` may sit at the top level or in ``dflash_config``."""
        if "DFlashDraftModel" not in data.get("architectures", []):
            raise InputError(f"{source}: architectures={data.get('architectures')} is not a DFlash drafter (expected 'DFlashDraftModel')")
        extra = data.get("dflash_config") or {}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_target_layers") if k not in data]
        if "mask_token_id" not in extra:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise InputError(f"{source}: missing required field(s) {missing}")
        rope = data.get("rope_parameters") or {}
        heads = data["num_attention_heads"]
        num_layers = data["num_hidden_layers"]
        return cls(
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            vocab_size=data["vocab_size"],
            num_target_layers=data["num_target_layers"],
            target_layer_ids=list(extra.get("target_layer_ids") or target_layer_ids(data["num_target_layers"], num_layers)),
            mask_token_id=extra["mask_token_id"],
            block_size=int(extra.get("block_size", data.get("block_size", 16))),
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=float(data.get("rope_theta") or rope.get("rope_theta", 1_000_000.0)),
            max_position_embeddings=data.get("max_position_embeddings", 32768),
            initializer_range=data.get("initializer_range", 0.02),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=data.get("eos_token_id"),
            dtype=data.get("dtype") or data.get("torch_dtype") or "bfloat16",
        )


# -- building blocks -------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the parameter dtype, as the reference Qwen3 norm does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """The frequencies stay fp32 whatever the module is cast to: ``Module.to(torch.bfloat16)`` (the drafter decoding
    in bf16) would round them to 3 digits, an error in the angle that grows with the distance."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self.frequencies(torch.device("cpu")), persistent=False)

    def frequencies(self, device: torch.device) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self.frequencies(self.inv_freq.device)  # moved, never cast
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` [batch, len] as [batch, 1, len, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


@dataclass
class DraftCache:
    """Per-layer keys/values of the context only; a draft's block is never cached."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat((self.keys[layer], k), dim=2)
            self.values[layer] = torch.cat((self.values[layer], v), dim=2)
        return self.keys[layer], self.values[layer]


class Attention(nn.Module):
    """Queries from the block; keys and values from the fused context and the block, through the same projections."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def forward(
        self,
        block: torch.Tensor,
        context: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        mask: TrainingMask | None,
        cache: DraftCache | None,
        layer: int,
        queries: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """``queries``: the rows of ``block`` that query and their rope (all of it unless given); keys and values come
        from every row of ``block``."""
        queries, query_rope = (block, block_rope) if queries is None else queries
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(queries), self.heads)), *query_rope)
        k_block = apply_rotary(self.k_norm(self._heads(self.k_proj(block), self.kv_heads)), *block_rope)
        v_block = self._heads(self.v_proj(block), self.kv_heads)
        k_ctx = apply_rotary(self.k_norm(self._heads(self.k_proj(context), self.kv_heads)), *context_rope)
        v_ctx = self._heads(self.v_proj(context), self.kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer, k_ctx, v_ctx)
        k = torch.cat((k_ctx, k_block), dim=2)
        v = torch.cat((v_ctx, v_block), dim=2)
        # Under autocast the norms' fp32 weights make q and k fp32 while v is bf16; attention kernels of torch
        # releases before the fix of pytorch#165468 reject mixed dtypes, so all three enter in v's.
        out = attend(q.to(v.dtype), k.to(v.dtype), v, mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(*queries.shape[:2], -1))


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, block, context, block_rope, context_rope, mask, cache, layer, block_length: int | None = None):
        """With ``block_length``, only each block's drafted rows (``drafted_rows``) query and come out: the last layer,
        whose output at an anchor feeds nothing. Every row still gives its keys and values."""
        # The fused context enters every layer as is (KV injection); only the block is normalised here.
        normed = self.input_layernorm(block)
        if block_length is None:
            block = block + self.self_attn(normed, context, block_rope, context_rope, mask, cache, layer)
        else:
            queries = (drafted_rows(normed, block_length, dim=1), tuple(drafted_rows(r, block_length, dim=2) for r in block_rope))
            mask = None if mask is None else mask.drafted
            block = drafted_rows(block, block_length, dim=1) + self.self_attn(normed, context, block_rope, context_rope, mask, cache, layer, queries)
        return block + self.mlp(self.post_attention_layernorm(block))


# -- the drafter -----------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        num_features = len(config.target_layer_ids)
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.draft_vocab: DraftVocab | None = None  # None: drafts over the target's whole vocabulary
        self.activation_checkpointing = False  # training: recompute each layer in the backward
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def dtype(self) -> torch.dtype:
        """The drafter's float dtype: its norms', which stay float whatever kernel its linears run on."""
        return self.hidden_norm.weight.dtype

    def forward(
        self,
        context_features: torch.Tensor,
        block_embeddings: torch.Tensor,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask: TrainingMask | None = None,
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        """Hidden states of the drafted block tokens ``[batch, blocks x (L - 1), H]``, ready for the target's LM head:
        each block's positions 1..L-1 (L: the ``mask``'s ``block_size`` in training and validation, else the one block's length). The last
        layer computes no output at the anchors, which feeds nothing.

        context_features: [batch, S, K*H], the selected target layers concatenated (new positions only when ``cache`` holds earlier ones).
        block_embeddings: [batch, Q, H], the target's embedding of the block tokens.
        context_positions / block_positions: absolute positions, [batch, S] and [batch, Q].
        mask: the training mask; ``None`` lets every block token see every key (one block at inference).
        """
        dtype = self.dtype
        context = self.hidden_norm(self.fc(context_features.to(dtype)))
        block_embeddings = block_embeddings.to(dtype)
        block_rope = self.rotary(block_positions, dtype)
        context_rope = self.rotary(context_positions, dtype)
        hidden = block_embeddings
        block_length = mask.block_size if mask is not None else block_embeddings.shape[1]
        for i, layer in enumerate(self.layers):
            args = (hidden, context, block_rope, context_rope, mask, cache, i, block_length if i == len(self.layers) - 1 else None)
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Recompute the layer in the backward instead of keeping its activations.
                hidden = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
            else:
                hidden = layer(*args)
        return self.norm(hidden)

    # -- checkpoint format -------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, lm_head_weight: torch.Tensor | None = None) -> Path:
        """Write ``config.json`` and ``model.safetensors`` in the reference format, and the draft vocabulary if the
        drafter has one, with its rows of ``lm_head_weight`` (the target's LM head) as vLLM reads them
        (``dflash.vocab``), atomically per file."""
        if self.draft_vocab is not None and lm_head_weight is None:
            raise ValueError("a drafter with a draft vocabulary is saved with its head rows: pass the target's lm_head_weight")
        directory = Path(directory)
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        with atomic_path(directory / WEIGHTS_NAME) as staging:
            save_file(state, str(staging), metadata={"format": "pt"})
        if self.draft_vocab is not None:
            with atomic_path(directory / VOCAB_FILE) as staging:
                self.draft_vocab.save(staging, lm_head_weight, self.dtype)
        else:
            discard(directory / VOCAB_FILE)
        for older in OLDER_VOCAB_FILES:
            discard(directory / older)
        # The config states the dtype the weights are stored in, which loaders honour.
        stored = dataclasses.replace(self.config, dtype=str(self.dtype).removeprefix("torch.")).to_reference_dict()
        if self.draft_vocab is not None:
            stored["draft_vocab_size"] = len(self.draft_vocab)
        atomic_write_text(directory / CONFIG_NAME, json.dumps(stored, indent=2) + "\n")
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> DFlashDrafter:
        """Load a reference-format drafter (ours or the authors'); reads safetensors only, never unpickles."""
        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise MissingInputError(f"{path} does not exist: a DFlash checkpoint directory holds {CONFIG_NAME} and {WEIGHTS_NAME}")
        try:
            data = json.loads(config_path.read_text())
        except json.JSONDecodeError as err:
            raise InputError(f"{config_path} is not valid JSON: {err}") from err
        config = DFlashConfig.from_reference_dict(data, source=str(config_path))
        state = load_file(str(weights_path), device="cpu")
        model = cls(config)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise InputError(
                f"{weights_path} does not match its config.json: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        for name, tensor in model.state_dict().items():
            if state[name].shape != tensor.shape:
                raise InputError(f"{weights_path}: {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(tensor.shape)}")
        model.load_state_dict(state)
        model.draft_vocab = DraftVocab.load(directory)
        return model.to(device=device, dtype=dtype)
