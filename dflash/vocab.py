"""The draft vocabulary: the target tokens a drafter can draft, a subset of the target's vocabulary.

A drafter over the whole vocabulary projects every drafted position through
the target's full LM head, which dominates the cost of a draft step and of
a training step when the vocabulary is large and the drafter small. A draft
vocabulary of the tokens the target writes most keeps only their rows of
the frozen head (EAGLE-3's ``d2t``): drafting and training get cheaper, and
a token outside it is never drafted (the target still writes it: decoding
stays lossless). The drafter's checkpoint keeps it in a JSON file of its
own, so that the weights stay in the reference format: serving engines load
every ``*.safetensors`` file of a drafter's directory and reject a tensor they
do not know (vLLM does), while a loader that does not know the JSON file
drafts over the full vocabulary.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dflash.errors import InputError

FILE_NAME = "draft_vocab.json"
LEGACY_FILE_NAME = "draft_vocab.safetensors"  # drafters saved before the JSON file: read, never written


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

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"vocab_size": self.index.numel(), "token_ids": self.token_ids.tolist()}) + "\n")

    @classmethod
    def load(cls, directory: Path) -> DraftVocab | None:
        """The vocabulary saved beside a drafter, or None when it drafts over the full vocabulary."""
        path, legacy = Path(directory) / FILE_NAME, Path(directory) / LEGACY_FILE_NAME
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                return cls.of(data["token_ids"], int(data["vocab_size"]))
            except (ValueError, KeyError, TypeError) as err:
                raise InputError(f"{path} is not a draft vocabulary ({err}): it holds vocab_size and token_ids") from err
        if legacy.is_file():
            with safe_open(str(legacy), framework="pt") as f:
                return cls.of(f.get_tensor("token_ids"), int(f.metadata()["vocab_size"]))
        return None
