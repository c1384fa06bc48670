"""Synthetic targets and batches: the shapes training uses, without its data.

Preflight stages and tests need a target, samples and target features of the
right shapes, not of the right values: a tiny random Llama stands in for the
target, random token rows for the samples, random features for the target's
hidden states. Batches still go through ``dflash.batch.make_batch``, so they
are laid out exactly as in training. ``TINY_SHAPE`` is the one tiny shape
every stand-in (target, drafter, the race's attention layer, the tests') starts from.
"""

from __future__ import annotations

import pandas as pd
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.batch import Batch, TargetRow, make_batch
from dflash.config import DrafterConfig, TrainConfig
from dflash.model import DFlashConfig
from dflash.target import Target

TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_TARGET = TINY_SHAPE | dict(num_hidden_layers=4, max_position_embeddings=512)


def tiny_target(device: str | torch.device = "cpu", seed: int = 0) -> Target:
    """A random 4-layer Llama with a 128-token vocabulary; builds in milliseconds."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**TINY_TARGET))
    return Target.from_model(model.to(device), source="tiny-random-llama")


def tiny_drafter_config(target: Target, block_size: int = 4) -> DFlashConfig:
    return DFlashConfig.for_target(target.config, DrafterConfig(num_context_features=2, block_size=block_size), target.config.vocab_size - 1)


def synthetic_samples(lengths: list[int], vocab_size: int, seed: int = 0) -> pd.DataFrame:
    """Rows as ``prepare_data`` writes them: a prompt (no loss) then a response (loss) of two thirds of the row."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths):
        prompt = length // 3
        rows.append(
            {
                "prompt_id": f"synthetic-{i}",
                "input_ids": torch.randint(0, vocab_size, (length,), generator=generator).tolist(),
                "loss_mask": [0] * prompt + [1] * (length - prompt),
            }
        )
    return pd.DataFrame(rows)


def synthetic_batch(config: DFlashConfig, lengths: list[int], cfg: TrainConfig, seed: int = 0) -> Batch:
    """One training batch of rows with these lengths, built by ``make_batch`` on random target features,
    as if the target had written the rows (its greedy tokens are the rows' own next tokens)."""
    samples = synthetic_samples(lengths, config.vocab_size, seed)
    generator = torch.Generator().manual_seed(seed)
    width = config.feature_width
    rows = [TargetRow(torch.randn(len(ids), width, generator=generator), torch.tensor(ids[1:] + ids[:1])) for ids in samples["input_ids"]]
    return make_batch(samples, list(range(len(lengths))), rows, config, cfg, seed, epoch=0)
