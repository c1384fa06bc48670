"""The persistent torch.compile cache a process compiles into and loads from.

``warmup_cache`` fills one cache directory per drafter device; training points
its process at that directory before it compiles (``use_warm_cache``) and
reports after its first step whether every graph came from it
(``log_compile_cache_hits``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def use_compile_cache(cache_dir: str | Path) -> Path:
    """Point this process's torch.compile caches (FX graph, AOT autograd, Triton) at ``cache_dir``; call before the first compile."""
    cache_dir = Path(cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    return cache_dir


def use_warm_cache(verdict: dict) -> Path:
    """Point the compile caches at the directory a (read, ok) ``warmup_cache`` verdict warmed."""
    if verdict["torch_version"] != torch.__version__:
        log.warning("%s was warmed by torch %s, this is torch %s: every compile will miss", verdict.get("path"), verdict["torch_version"], torch.__version__)
    cache_dir = use_compile_cache(verdict["cache_dir"])
    log.info("compile cache: %s (warmed: cold %.1f s, warm %.1f s)", cache_dir, verdict["cold_seconds"], verdict["warm_seconds"])
    return cache_dir


def compile_cache_hits() -> dict[str, int]:
    """Cache hits and misses of this process's compiles so far."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "frames_compiled": counters["frames"]["ok"],
    }


def log_compile_cache_hits(logger: logging.Logger = log) -> dict[str, int]:
    """Log the hits after training's first steps; a miss means training compiled something the warmup did not."""
    hits = compile_cache_hits()
    logger.info(
        "compile cache: FX graph %d hit(s), %d miss(es); AOT autograd %d hit(s), %d miss(es)",
        hits["fxgraph_cache_hit"],
        hits["fxgraph_cache_miss"],
        hits["autograd_cache_hit"],
        hits["autograd_cache_miss"],
    )
    if hits["fxgraph_cache_miss"] or hits["autograd_cache_miss"]:
        logger.warning("training compiled graphs the warmup did not (shapes, settings or code differ): those compiled cold")
    return hits
