"""The linears of decoding on a CPU: the target's on oneDNN's packed-weight kernel, the drafter's too, in bf16 where
the CPU computes it natively.

torch's CPU ``linear`` runs a BLAS GEMM whose cost, for the few rows a verify
has, grows with the row count far faster than the work does (on some CPUs a
3-row product costs twice a 1-row one), and whose rows may round differently
with the row count. oneDNN's linear over a weight packed once (the kernel
inductor emits when it freezes a CPU model) costs about the same for 1 to 4
rows, and, packed for a batch of 2 or more, gives every row bitwise the same
result whatever the row count, so a verify's linears compute what k single
steps' would. Attention's products still round with the row count (a few 1e-6
per layer in fp32 here), so a verify's logits match single steps' to about
1e-5, not bitwise: outputs could part only where the top two logits tie that
closely, which ``lossless`` checks on every prompt.

``pack_linears`` swaps the modules only where that invariance is checked to
hold on the machine at hand; elsewhere (CUDA, no oneDNN, a build that rounds
per row count) the model is left as it is.

The draft side needs no exactness (whatever it proposes, the target decides),
only speed and acceptance. Each proposal streams the drafter's weights and its
head from memory after a target forward has evicted them from cache, so its
cost is their size: ``draft_linears`` runs the drafter in bf16 on the packed
kernel where the CPU computes bf16 natively (half the bytes; its training ran
in bf16 autocast), else in fp32. int8 (fbgemm's dynamic-quantization linear,
int8 weights per output channel) streams a quarter of the bytes, but quantizes
each layer's input with one scale per tensor, which costs acceptance; it runs
only where named. torch has deprecated its quantized tensors (pytorch#184982);
where they are gone int8 is unavailable. On CUDA the drafter is left alone.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch import nn

from dflash.errors import PreflightError

log = logging.getLogger(__name__)

# The row count the weights are packed for: a batch hint of 1 selects a matrix-vector path whose rounding
# differs from the multi-row one, so every row count must share a hint of at least 2.
PACK_BATCH_HINT = 4
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# What each kernel needs, for the error where one is named and does not run.
KERNEL_NEEDS = {
    "packed": "oneDNN's packed linear, exact at every row count, for the model's dtype on a CPU",
    "bf16": "a CPU that computes bf16 natively (AVX-512 BF16 or AMX) and oneDNN's packed linear",
    "int8": "fbgemm's quantized linear, for a model in fp32 on a CPU",
}


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


def int8_linear(linear: nn.Linear) -> nn.Module:
    """``linear`` as fbgemm's dynamically quantized linear: int8 weights with a scale per output channel."""
    weight = linear.weight.detach().float()
    scales = (weight.abs().amax(1) / 127).clamp(min=1e-12).double()
    with warnings.catch_warnings():  # the deprecation of quantized tensors, which the module docstring states
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
    module = torch.ao.nn.quantized.dynamic.Linear(linear.in_features, linear.out_features, bias_=linear.bias is not None, dtype=torch.qint8)
    module.set_weight_bias(qweight, None if linear.bias is None else linear.bias.detach().float())
    return module


@functools.cache
def int8_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fbgemm's dynamically quantized linear runs here (fp32 on a CPU) and stays close to the float result."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    try:
        linear = nn.Linear(96, 80, bias=False)
        x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            exact = linear(x)
            return bool((int8_linear(linear)(x) - exact).abs().max() <= 0.05 * exact.abs().max())
    except (RuntimeError, AttributeError) as err:  # a build without fbgemm, or quantized tensors removed
        log.info("int8 dynamic-quantization linear unavailable: %s", err)
        return False


def kernel_available(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` runs here for a model in ``dtype``; ``bf16`` casts the model to bf16 first, and is available
    where the CPU computes bf16 natively."""
    from dflash.target import native_bf16

    if kernel == "packed":
        return packed_kernel_available(device, dtype)
    if kernel == "bf16":
        return device.type == "cpu" and native_bf16(device) and packed_kernel_available(device, torch.bfloat16)
    return kernel == "default" or int8_kernel_available(device, dtype)


def resolve_kernel(
    kernel: str, device: torch.device, dtype: torch.dtype, choices: tuple[str, ...], auto: tuple[str, ...] | None = None, *, setting: str
) -> str:
    """The kernel of ``choices`` the config key ``setting`` names: ``auto`` is the first of ``auto`` (all ``choices``
    unless given) available here, ``default`` last; a named one is insisted on (a ``PreflightError`` where it does
    not run)."""
    if kernel == "auto":
        return next(k for k in (*(choices if auto is None else auto), "default") if kernel_available(k, device, dtype))
    if kernel not in (*choices, "default"):
        raise ValueError(f"unknown linear kernel {kernel!r}: expected auto or one of {', '.join((*choices, 'default'))}")
    if not kernel_available(kernel, device, dtype):
        raise PreflightError(
            f"{setting}: the {kernel} linear kernel needs {KERNEL_NEEDS[kernel]}, which this {device} lacks (model in {dtype}): set it to auto"
        )
    return kernel


def kernel_of(module: nn.Module) -> str:
    """The kernel the first linear of ``module`` (itself included) runs on."""
    for child in module.modules():
        if isinstance(child, PackedLinear):
            return "packed"
        if isinstance(child, torch.ao.nn.quantized.dynamic.Linear):
            return "int8"
    return "default"


def projection(weight: torch.Tensor, kernel: str = "default"):
    """``x -> x @ weight.t()`` (``x`` cast to the weight's dtype) on ``kernel``, for a frozen ``weight``."""
    if kernel == "default":
        return lambda x: x.to(weight.dtype) @ weight.t()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    module = PackedLinear(linear) if kernel == "packed" else int8_linear(linear)
    return lambda x: module(x.to(weight.dtype))


def swap_linears(model: nn.Module, kernel: str) -> int:
    """Swap every ``nn.Linear`` of ``model`` (frozen, for inference) for ``kernel``'s module; the number swapped."""
    if kernel == "default":
        return 0
    make = PackedLinear if kernel == "packed" else int8_linear
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                swapped += 1
    log.info("%d linears on the %s kernel", swapped, kernel)
    return swapped


def pack_linears(model: nn.Module, kernel: str = "auto") -> int:
    """The target's linears on oneDNN's packed kernel (exact at every row count); the number swapped.

    ``kernel`` (``eval.linear_kernel``): ``auto`` packs where ``packed_kernel_available``, ``packed`` insists (a
    ``PreflightError`` where it is unavailable), ``default`` leaves the model alone.
    """
    parameter = next(model.parameters())
    return swap_linears(model, resolve_kernel(kernel, parameter.device, parameter.dtype, ("packed",), setting="eval.linear_kernel"))


DRAFT_KERNELS = ("bf16", "packed", "int8")
AUTO_DRAFT_KERNELS = ("bf16", "packed")  # int8 only where named: its per-tensor activation scales cost acceptance


def resolve_draft_kernel(drafter: nn.Module, kernel: str = "auto") -> str:
    """The kernel ``eval.draft_kernel`` names for ``drafter`` here (``auto``: bf16 where native, else packed, else default)."""
    parameter = next(drafter.parameters())
    return resolve_kernel(kernel, parameter.device, parameter.dtype, DRAFT_KERNELS, AUTO_DRAFT_KERNELS, setting="eval.draft_kernel")


def draft_linears(drafter: nn.Module, kernel: str = "auto") -> str:
    """A drafter's linears on the kernel ``resolve_draft_kernel`` chooses, cast to bf16 first for ``bf16``; the kernel
    chosen, which its head's ``projection`` shares (``kernel_of(drafter.layers)``, in ``drafter.dtype``).

    In int8, ``fc`` stays on the float kernel: it reads the target's hidden states, whose massive activations (a few
    channels thousands of times the median) an int8 activation scale per tensor cannot represent."""
    chosen = resolve_draft_kernel(drafter, kernel)
    parameter = next(drafter.parameters())
    if chosen == "bf16":
        drafter.to(torch.bfloat16)
        swap_linears(drafter, "packed")
    elif chosen == "int8":
        swap_linears(drafter.layers, "int8")
        swap_linears(drafter, resolve_kernel("auto", parameter.device, parameter.dtype, ("packed",), setting="eval.draft_kernel"))
    else:
        swap_linears(drafter, chosen)
    return chosen
