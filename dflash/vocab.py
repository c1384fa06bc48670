"""The draft vocabulary: the target tokens a drafter can draft, a subset of the target's vocabulary.

A drafter over the whole vocabulary projects every drafted position through
the target's full LM head, which dominates the cost of a draft step and of
a training step when the vocabulary is large and the drafter small. A draft
vocabulary of the tokens the target writes most keeps only their rows of
the frozen head (EAGLE-3's ``d2t``): drafting and training get cheaper, and
a token outside it is never drafted (the target still writes it: decoding
stays lossless).

The drafter's checkpoint keeps it in the form vLLM reads for DFlash and
EAGLE-3 drafters: ``draft_head.safetensors`` beside the weights, holding
``lm_head.weight`` (the head rows, ``[V', H]``) and ``d2t`` (per draft id, the
offset to its target id), with ``draft_vocab_size`` in ``config.json``. vLLM
loads every ``*.safetensors`` file of the directory, so it finds them; the
reference loader (the authors' package) reads ``model.safetensors`` only,
so the weights stay in the reference format and it drafts over the whole
vocabulary.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash.errors import InputError

FILE_NAME = "draft_head.safetensors"
# Earlier forms, read and never written: a JSON file of token ids, and a safetensors file whose tensor vLLM rejects.
OLDER_FILE_NAMES = ("draft_vocab.json", "draft_vocab.safetensors")


@dataclass(frozen=True)
class DraftVocab:
    token_ids: torch.Tensor  # [V'] target ids, ascending
    index: torch.Tensor  # [V] the position of each target id in token_ids, -1 for ids outside

    @classmethod
    def of(cls, token_ids: list[int] | torch.Tensor, vocab_size: int) -> DraftVocab:
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise InputError(f"a draft vocabulary needs target ids in [0, {vocab_size}), got {ids.numel()} ids from {ids[:1].tolist()} to {ids[-1:].tolist()}")
        index = torch.full((vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        return cls(ids, index)

    @classmethod
    def most_frequent(cls, responses: list[list[int]], size: int, vocab_size: int, always: list[int] = ()) -> DraftVocab:
        """The ``size`` tokens written most often in ``responses`` (ties by id), and the ``always`` ones (stop tokens)."""
        counts = Counter(token for response in responses for token in response)
        chosen = list(dict.fromkeys(list(always) + [token for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]))[:size]
        return cls.of(chosen, vocab_size)

    def __len__(self) -> int:
        return self.token_ids.numel()

    def coverage(self, tokens: list[int]) -> float:
        """The share of ``tokens`` the vocabulary holds."""
        held = self.index[torch.as_tensor(tokens, dtype=torch.long)] >= 0
        return float(held.float().mean()) if held.numel() else 0.0

    def head(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head the drafter projects onto."""
        return lm_head_weight[self.token_ids.to(lm_head_weight.device)]

    def save(self, path: Path, lm_head_weight: torch.Tensor, dtype: torch.dtype) -> None:
        """vLLM's form: the head rows of ``lm_head_weight`` (the target's) in ``dtype``, and ``d2t``."""
        offsets = self.token_ids - torch.arange(len(self))
        rows = self.head(lm_head_weight).detach().to(dtype=dtype, device="cpu").contiguous()
        save_file({"lm_head.weight": rows, "d2t": offsets}, str(path), metadata={"format": "pt", "vocab_size": str(self.index.numel())})

    @classmethod
    def load(cls, directory: Path) -> DraftVocab | None:
        """The vocabulary saved beside a drafter, or None when it drafts over the full vocabulary."""
        directory = Path(directory)
        path, (json_path, older) = directory / FILE_NAME, (directory / name for name in OLDER_FILE_NAMES)
        try:
            if path.is_file():
                with safe_open(str(path), framework="pt") as f:
                    offsets = f.get_tensor("d2t")
                    return cls.of(offsets + torch.arange(offsets.numel()), int(f.metadata()["vocab_size"]))
            if json_path.is_file():
                data = json.loads(json_path.read_text())
                return cls.of(data["token_ids"], int(data["vocab_size"]))
            if older.is_file():
                with safe_open(str(older), framework="pt") as f:
                    return cls.of(f.get_tensor("token_ids"), int(f.metadata()["vocab_size"]))
        except (ValueError, KeyError, TypeError, OSError, SafetensorError) as err:
            raise InputError(f"{directory} holds no readable draft vocabulary ({err}): {FILE_NAME} holds d2t, with vocab_size in its metadata") from err
        return None
