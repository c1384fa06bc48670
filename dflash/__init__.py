"""DFlash drafters: the block-diffusion drafter, its training, and lossless speculative decoding."""

import importlib

# Resolved on first use, so that importing one stage module (``dflash.target``, say) does not execute
# the others: the workflow makes the package files a stage runs its inputs, and a change to
# ``decoding/generate.py`` must rerun evaluation only.
_EXPORTS = {
    "DFlashConfig": "dflash.model",
    "DFlashDrafter": "dflash.model",
    "target_layer_ids": "dflash.model",
    "speculative_generate": "dflash.decoding.generate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
