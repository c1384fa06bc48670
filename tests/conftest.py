"""Shared fixtures: tiny random targets (Llama- and Qwen3-shaped) and tiny drafters.

Everything runs on the CPU, offline, with fixed seeds. The targets are built from
configs (no download): 6 layers, hidden 64, 4 heads, 2 KV heads, vocabulary 128.
Token 127 is the end-of-sequence token and 126 the drafter's mask token; prompts
are drawn from [1, 120) so that neither appears in them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `pytest` from anywhere imports this checkout's dflash
    sys.path.insert(0, str(REPO_ROOT))

import dataclasses

import pytest
import torch

# Tiny models are dominated by per-op overhead; extra threads only add contention
# (one thread is 5-10x faster here than the default on a busy 2-core machine).
torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "1")))

from dflash.preflight.synthetic import TINY_SHAPE as SHAPE

VOCAB = SHAPE["vocab_size"]
EOS = 127
MASK = 126
PROMPT_HIGH = 120  # prompts use ids in [1, PROMPT_HIGH): never EOS nor MASK

TINY_SHAPE = SHAPE | dict(num_hidden_layers=6, max_position_embeddings=512, bos_token_id=0, eos_token_id=EOS, tie_word_embeddings=False)


def llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_SHAPE, **overrides})


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY_SHAPE, **overrides})


def build_target(config, seed: int = 0):
    """A random causal LM from ``config``, in fp32 eval mode, wrapped as a ``Target``."""
    from transformers import AutoModelForCausalLM

    from dflash.target import Target

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return Target.from_model(model, tokenizer=None)


def build_drafter(target_config, seed: int = 0, init_std: float = 0.02, mask_token_id: int = MASK, **kwargs):
    """A random drafter shaped for ``target_config`` (2 layers, 3 context features, block 8 unless overridden)."""
    from dflash.config import DrafterConfig
    from dflash.model import DFlashConfig, DFlashDrafter

    options = dict(num_hidden_layers=2, num_context_features=3, block_size=8) | kwargs
    config = DFlashConfig.for_target(target_config, DrafterConfig(**options), mask_token_id)
    config = dataclasses.replace(config, initializer_range=init_std)
    torch.manual_seed(seed)
    return DFlashDrafter(config).eval()


def random_prompt(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, PROMPT_HIGH, (1, length), generator=generator)


@pytest.fixture(scope="session")
def llama_target():
    return build_target(llama_config(), seed=0)


@pytest.fixture(scope="session")
def qwen3_target():
    return build_target(qwen3_config(), seed=1)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def any_target(request, llama_target, qwen3_target):
    return {"llama": llama_target, "qwen3": qwen3_target}[request.param]


@pytest.fixture(scope="session")
def qwen3_drafter(qwen3_target):
    return build_drafter(qwen3_target.config, seed=2)


@pytest.fixture
def tiny_drafter_config():
    """A drafter config written out by hand (no target needed)."""
    from dflash.model import DFlashConfig

    return DFlashConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=6,
        target_layer_ids=[1, 2, 3],
        mask_token_id=MASK,
        block_size=4,
        initializer_range=0.2,
    )


def require_chromium() -> str:
    """Headless Chromium for the report's browser check: skip without it, unless DFLASH_REQUIRE_CHROMIUM=1 (.ci/run
    installs it, so there a skip would hide a failure)."""
    from dflash.errors import PreflightError
    from dflash.report.browser import find_browser

    try:
        return find_browser()
    except PreflightError as missing:
        if os.environ.get("DFLASH_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"DFLASH_REQUIRE_CHROMIUM=1 but {missing}")
        pytest.skip(str(missing))
