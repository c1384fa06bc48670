"""The FX-tracing race of torch.compile in threaded code, and the project's mitigation.

``torch.fx`` marks "a symbolic trace is running" in one module global. Every
call of a ``torch.compile``'d function checks it and raises when it is set,
so while one thread traces (inductor runs ``make_fx`` when it lazily compiles
a backward), any other thread calling compiled code fails with
"Detected that you are using FX to symbolically trace a dynamo-optimized
function". The preflight stage ``repro_fx_race`` reproduces it and verifies
the mitigation on the installed torch.

The mitigation tells Dynamo to run compiled code whatever the flag says.
Dynamo's config is per thread, so it must be set inside every thread that
calls compiled code: wrap the thread's function with ``fx_race_safe`` or its
body with ``fx_race_mitigation()``. Setting it in the main thread does not
reach the workers.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

MITIGATION = "dynamo.force_compile_during_fx_trace per thread"
RACE_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"

F = TypeVar("F", bound=Callable)


@contextmanager
def fx_race_mitigation() -> Iterator[None]:
    """Within this block, compiled calls made by the current thread ignore other threads' FX traces."""
    with torch._dynamo.config.patch(force_compile_during_fx_trace=True):
        yield


def fx_race_safe(fn: F) -> F:
    """Decorate a worker thread's target so that its compiled calls ignore other threads' FX traces."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with fx_race_mitigation():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def is_fx_race_error(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and RACE_ERROR in str(err)


def shared_fx_tracing_flag() -> bool:
    """Whether this torch keeps the flag the race is about in one module global, shared by all threads
    (up to 2.13; a later release makes it thread-local, and then threads cannot race on it)."""
    return isinstance(getattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", None), bool)


def fx_tracing_flag() -> bool:
    """The process-wide flag the race is about (False where this torch has none)."""
    return shared_fx_tracing_flag() and torch.fx._symbolic_trace._is_fx_tracing_flag


def clear_fx_tracing_flag() -> None:
    """Reset a flag left set by interleaved traces (only when no trace is running, e.g. between preflight trials)."""
    if shared_fx_tracing_flag():
        torch.fx._symbolic_trace._is_fx_tracing_flag = False


def _short_path(filename: str) -> str:
    """``torch/fx/_symbolic_trace.py`` rather than a full site-packages path; ``dflash/...`` for the project's files."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    if "dflash" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("dflash") :])
    return filename


# Frames that only pass a call on (decorators, context managers): they say nothing about who traces.
_PLUMBING = ("torch/_dynamo/eval_frame.py", "torch/_compile.py", "torch/utils/_contextlib.py", "/contextlib.py")


def frames_holding_trace(thread_id: int, limit: int = 12) -> list[str]:
    """The stack of a thread from the ``Tracer.trace`` frame that set the flag outwards, innermost first.

    Skips plumbing frames and stops after the first frame outside torch (the
    code that started the trace). Empty when the thread is not inside a trace.
    """
    frame = sys._current_frames().get(thread_id)
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    setter = next(
        (i for i, f in enumerate(stack) if f.f_code.co_name == "trace" and f.f_code.co_filename.endswith("fx/_symbolic_trace.py")),
        None,
    )
    if setter is None:
        return []
    lines = []
    for f in stack[setter:]:
        filename = Path(f.f_code.co_filename).as_posix()
        if filename.endswith(_PLUMBING):
            continue
        lines.append(f"{_short_path(filename)}:{f.f_lineno} {getattr(f.f_code, 'co_qualname', f.f_code.co_name)}")
        if "torch" not in Path(filename).parts or len(lines) >= limit:
            break
    return lines
