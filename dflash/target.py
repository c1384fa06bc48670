"""The target LLM at run time: loading it (from what ``dflash.acquire`` put on disk) and what the drafter reads from it."""

from __future__ import annotations

import copy
import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.acquire import local_snapshot, resolve_source
from dflash.config import EMBEDDED
from dflash.errors import InputError, MissingInputError
from dflash.io import atomic_write_text


@dataclass
class TargetPass:
    """The target's teacher-forced pass over a batch of token rows ``[b, S]``."""

    features: torch.Tensor  # [b, S, K*H]: the selected layers' outputs concatenated (layer id i is hidden_states[i + 1])
    greedy: torch.Tensor  # [b, S]: the greedy next token after each position
    top_ids: torch.Tensor | None = None  # [b, S, k]: the k most likely next tokens, when asked for
    top_probs: torch.Tensor | None = None  # [b, S, k]: their probabilities


@dataclass
class Target:
    """A frozen causal LM with the handles a drafter needs: layers' hidden states, embedding, LM head, tokenizer."""

    model: torch.nn.Module
    tokenizer: object
    source: str
    full_config: object | None = None  # the target's own config when ``model`` was loaded without its decoder layers

    @classmethod
    def load(cls, source: str = EMBEDDED, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, layers: bool = True) -> Target:
        """Load straight onto ``device``. ``layers=False`` loads only what a drafter rank uses, the embedding, the final
        norm and the LM head, and none of the decoder layers (their weights are never read)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        path = resolve_source(source)
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        shell = config if layers else copy.deepcopy(config)
        if not layers:
            shell.num_hidden_layers = 0
            if hasattr(shell, "layer_types"):
                shell.layer_types = []
        model = AutoModelForCausalLM.from_pretrained(path, config=shell, dtype=dtype, device_map={"": torch.device(device)})
        target = cls.from_model(model, tokenizer, source)
        target.full_config = None if layers else config
        return target

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer=None, source: str = "in-memory") -> Target:
        model.eval().requires_grad_(False)
        return cls(model=model, tokenizer=tokenizer, source=source)

    # -- shape ------------------------------------------------------------------------------

    @property
    def config(self):
        return self.full_config or self.model.config

    @property
    def has_layers(self) -> bool:
        return self.full_config is None

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.config.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    # -- the frozen pieces the drafter borrows ---------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def default_mask_token_id(self) -> int:
        """The drafter's default mask token: the highest-id special token that the chat template never emits."""
        tokenizer = self.tokenizer
        used = set(self.eos_token_ids) | {tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
        template = getattr(tokenizer, "chat_template", "") or ""
        candidates = [
            token_id
            for token_id in sorted(getattr(tokenizer, "all_special_ids", []) + list(getattr(tokenizer, "added_tokens_decoder", {})))
            if token_id not in used and tokenizer.convert_ids_to_tokens(token_id) not in template and token_id < self.config.vocab_size
        ]
        if not candidates:
            raise InputError(f"target {self.source!r} has no unused special token to serve as the mask; set drafter.mask_token_id")
        return max(candidates)

    # -- forward passes ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, cache, **kwargs):
        """The model's forward over ``input_ids`` extending the KV ``cache``, which transformers takes as ``cache`` from
        5.24 on and as ``past_key_values`` before (the device image has 5.17)."""
        return self.model(input_ids=input_ids, **{_cache_keyword(type(self.model)): cache}, use_cache=True, **kwargs)

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int], top_k: int = 0, head_chunk: int = 1024
    ) -> TargetPass:
        """What the drafter trains on, from one teacher-forced forward pass over ``input_ids`` ``[b, S]``
        (the LM head applied ``head_chunk`` positions at a time, its softmax in fp32)."""
        if not self.has_layers:
            raise RuntimeError(f"target {self.source!r} was loaded without its decoder layers (layers=False): it has no hidden states to give")
        out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        last = out.last_hidden_state.flatten(0, 1)
        greedy, top_ids, top_probs = [], [], []
        for begin in range(0, last.shape[0], head_chunk):
            logits = self.lm_head(last[begin : begin + head_chunk]).float()
            greedy.append(logits.argmax(-1))
            if top_k:
                top = logits.topk(top_k, dim=-1)
                top_ids.append(top.indices)
                top_probs.append(torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True)))
        shape = input_ids.shape
        return TargetPass(
            features=select_features(out.hidden_states, layer_ids),
            greedy=torch.cat(greedy).view(shape),
            top_ids=torch.cat(top_ids).view(*shape, top_k) if top_k else None,
            top_probs=torch.cat(top_probs).view(*shape, top_k) if top_k else None,
        )

    # -- chat ---------------------------------------------------------------------------------------

    def _template_ids(self, messages: list[dict], **options) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InputError(f"the tokenizer of target {self.source!r} has no chat template; use a chat (instruct) model")
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **options)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the target's chat template, ready for the assistant's turn."""
        return self._template_ids(messages, add_generation_prompt=True)

    def reply_ids(self, messages: list[dict], prompt_ids: list[int], reply: str) -> list[int]:
        """Token ids of ``reply`` as the chat template renders it after ``prompt_ids``, ending at the first stop token."""
        ids = self._template_ids(messages + [{"role": "assistant", "content": reply}])
        if ids[: len(prompt_ids)] == prompt_ids:
            ids = ids[len(prompt_ids) :]
        else:  # a template that renders the prompt differently once it is answered: the reply's own tokens
            ids = list(self.tokenizer.encode(reply, add_special_tokens=False)) + self.eos_token_ids[:1]
        return until_stop(ids, set(self.eos_token_ids))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """The tokens up to and including the first stop token."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in stop), len(tokens))
    return tokens[:end]


def select_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """HF ``hidden_states`` (index 0 is the embedding output) → the drafter's context features."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def write_manifest(source: str, dtype: str, out: Path) -> dict:
    """The ``prepare_target`` stage: materialise the target and record what later stages load."""
    path = local_snapshot(source)
    target = Target.load(path, dtype=getattr(torch, dtype))
    cfg = target.config
    manifest = {
        "source": source,
        "path": path,
        "dtype": dtype,
        "architecture": type(target.model).__name__,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "eos_token_ids": target.eos_token_ids,
        "has_chat_template": getattr(target.tokenizer, "chat_template", None) is not None,
        "parameters": sum(p.numel() for p in target.model.parameters()),
    }
    atomic_write_text(out, json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_from_manifest(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, layers: bool = True) -> Target:
    """The target a ``prepare_target`` manifest describes, in the manifest's dtype unless given: from the local
    directory it recorded (from its source again only if that directory is gone, e.g. a cleared cache)."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path} does not exist: run the prepare_target stage first")
    manifest = json.loads(path.read_text())
    target = Target.load(manifest_location(manifest), device=device, dtype=dtype or getattr(torch, manifest["dtype"]), layers=layers)
    target.source = manifest["source"]
    return target


def config_from_manifest(path: str | Path):
    """The transformers config of the target a ``prepare_target`` manifest describes, without loading its weights."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path} does not exist: run the prepare_target stage first")
    return AutoConfig.from_pretrained(manifest_location(json.loads(path.read_text())))


def manifest_location(manifest: dict) -> str:
    """The local directory a manifest recorded, or its source again if that directory is gone (a cleared cache)."""
    recorded = manifest.get("path")
    return recorded if recorded and (Path(recorded) / "config.json").is_file() else manifest["source"]


def preparation_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype of the target's passes that prepare training (regeneration, hidden states, greedy tokens, the frozen
    embedding and head): they need no exactness, so ``auto`` is bf16 where the device computes it natively."""
    if setting == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return getattr(torch, setting)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively (CUDA; CPUs with AVX-512 BF16 or AMX), where it is the fast dtype."""
    if device.type == "cuda":
        return True
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return device.type == "cpu" and any(probe() for probe in probes if probe is not None)
