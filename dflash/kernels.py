"""The target's linears on oneDNN's packed-weight kernel, for decoding on a CPU.

torch's CPU ``linear`` runs a BLAS GEMM whose cost, for the few rows a verify
has, grows with the row count far faster than the work does (on some CPUs a
3-row product costs twice a 1-row one), and whose rows may round differently
with the row count. oneDNN's linear over a weight packed once (the kernel
inductor emits when it freezes a CPU model) costs about the same for 1 to 4
rows, and, packed for a batch of 2 or more, gives every row bitwise the same
result whatever the row count: a verify of k tokens then computes exactly what
k single steps would, which is what keeps speculative decoding lossless.

``pack_linears`` swaps the modules only where that invariance is checked to
hold on the machine at hand; elsewhere (CUDA, no oneDNN, a build that rounds
per row count) the model is left as it is.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# The row count the weights are packed for: a batch hint of 1 selects a matrix-vector path whose rounding
# differs from the multi-row one, so every row count must share a hint of at least 2.
PACK_BATCH_HINT = 4
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a weight packed for oneDNN; ``weight`` stays the original parameter (ties kept)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


@functools.cache
def packed_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here and gives every row the same bits at every row count."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = PackedLinear(nn.Linear(96, 80, bias=False, dtype=dtype))
        x = torch.randn(16, 96, dtype=dtype, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            full = probe(x)
            return all(torch.equal(probe(x[i : i + k]), full[i : i + k]) for k in (1, 2, 3, 5, 8) for i in range(0, 16 - k, 3))
    except RuntimeError as err:  # an op missing from this build
        log.info("oneDNN packed linear unavailable: %s", err)
        return False


def projection(weight: torch.Tensor, packed: bool):
    """``x -> x @ weight.t()`` for a few rows of ``x``: on oneDNN's packed kernel when ``packed`` (and available here)."""
    if packed and packed_kernel_available(weight.device, weight.dtype):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        return PackedLinear(linear)
    return lambda x: x @ weight.t()


def pack_linears(model: nn.Module, kernel: str = "auto") -> int:
    """Swap every ``nn.Linear`` of ``model`` (frozen, for inference) for a ``PackedLinear``; the number swapped.

    ``kernel``: ``auto`` packs where ``packed_kernel_available``, ``packed`` insists (a ``RuntimeError`` where
    it is unavailable), ``default`` leaves the model alone.
    """
    if kernel == "default":
        return 0
    parameter = next(model.parameters())
    if not packed_kernel_available(parameter.device, parameter.dtype):
        if kernel == "packed":
            raise RuntimeError(f"oneDNN's packed linear is unavailable or not row-invariant for {parameter.dtype} on {parameter.device}")
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    log.info("%d linears on oneDNN's packed kernel", swapped)
    return swapped
