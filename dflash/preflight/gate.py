"""The gate between the preflight stages and training, and the names of the devices they run on.

``train`` calls ``check_preflight`` with the verdict files Snakemake hands it;
it refuses to start on a failed verdict, and on a race verdict that does not
cover how the run calls compiled code (``execution_is_safe``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from dflash.config import TopologyConfig
from dflash.errors import ConfigError, MissingInputError, PreflightError
from dflash.preflight.verdict import read_verdict

log = logging.getLogger(__name__)

# How training may call compiled code, as the race verdict's ``safe_for`` names it.
PROCESSES = "one_process_per_device"  # torchrun: no two threads share the flag
THREADS = "threads"  # several threads of one process call compiled code


def device_name(kind: str, index: int = 0) -> str:
    """The device wildcard of the per-device stages: ``cpu``, or ``cuda<local index>``."""
    return "cpu" if kind == "cpu" else f"cuda{index}"


def device_index(name: str) -> int | None:
    """The local CUDA index a device wildcard names (``None`` for ``cpu``)."""
    if name == "cpu":
        return None
    match = re.fullmatch(r"cuda(\d+)", name)
    if match is None:
        raise ConfigError(f"preflight.warmup.devices: {name!r} is neither 'cpu' nor 'cudaN' (e.g. cuda0)")
    return int(match.group(1))


def first_device(topology: TopologyConfig) -> torch.device:
    """The device the single-device preflight stages run on: the first GPU, or the CPU."""
    return torch.device("cuda", 0) if topology.device == "cuda" else torch.device("cpu")


def execution_is_safe(verdict: dict, topology: TopologyConfig, threads_per_process: int = 1) -> tuple[bool, str]:
    """Whether training may run as configured, given the ``repro_fx_race`` verdict (a dict, as read from JSON).

    One process per device (torchrun; ``threads_per_process`` 1) is always
    safe: the flag is per process. Several threads of one process calling
    compiled code are safe only where the verdict verified the mitigation,
    and each thread must run under ``dflash.preflight.fx_race.fx_race_safe``.
    """
    if threads_per_process <= 1:
        return True, f"{topology.nnodes * topology.nproc_per_node} process(es), one thread each calling compiled code: no shared FX flag"
    if verdict.get("torch_version") != torch.__version__:
        return False, f"the race verdict is for torch {verdict.get('torch_version')}, this is torch {torch.__version__}: rerun the repro_fx_race stage"
    if THREADS in verdict.get("safe_for", []):
        return True, f"{threads_per_process} threads per process, safe with {verdict['mitigation']} in every thread (verified on torch {torch.__version__})"
    return False, (
        f"{threads_per_process} threads per process would share the FX tracing flag and the mitigation is not verified on torch {torch.__version__} "
        f"({verdict.get('summary')}): run one process per device (torchrun)"
    )


def check_preflight(paths: list[Path], topology: TopologyConfig, threads_per_process: int = 1) -> dict[str, dict]:
    """Training refuses to start unless every preflight verdict says ok and the race verdict says the
    configured execution is safe. Returns the verdicts by stage (warmups by device).

    ``threads_per_process`` is how many threads of one process call compiled code: 1 under torchrun,
    where a mitigation that does not hold on this torch only warrants a warning.
    """
    verdicts = {}
    for path in paths:
        if not Path(path).is_file():
            raise MissingInputError(f"{path} does not exist: run the preflight stages first (snakemake runs them before train)")
        stage = json.loads(Path(path).read_text()).get("stage", "?")
        verdict = read_verdict(path, stage) | {"path": str(path)}
        verdicts[f"warmup_cache/{verdict['device']}" if stage == "warmup_cache" else stage] = verdict
    race = verdicts.get("repro_fx_race")
    if race is not None:
        safe, reason = execution_is_safe(race, topology, threads_per_process)
        if not safe:
            raise PreflightError(f"training would hit the torch.compile FX-tracing race: {reason}")
        log.info("repro_fx_race: %s", reason)
        if THREADS not in race.get("safe_for", []):
            log.warning(
                "the FX-race mitigation (%s) does not hold on torch %s (%s): safe here only because every process runs one thread of compiled code",
                race.get("mitigation"),
                race.get("torch_version"),
                race.get("path"),
            )
    return verdicts
