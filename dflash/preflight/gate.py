"""The gate between the preflight stages and training, and the names of the devices they run on.

``train`` calls ``check_preflight`` with the verdict files Snakemake hands it;
it refuses to start on a failed verdict, the race's excepted: training runs
one thread of compiled code per process, where the race cannot happen.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from dflash.config import TopologyConfig
from dflash.errors import ConfigError, MissingInputError
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


def check_preflight(paths: list[Path], topology: TopologyConfig) -> dict[str, dict]:
    """Training refuses to start unless every preflight verdict says ok, the race's excepted. Returns the verdicts
    by stage (warmups by device).

    Training runs one process per device (torchrun), one thread of compiled code each: the FX-tracing race, which
    needs two threads of one process, cannot happen there, so the ``repro_fx_race`` verdict is a diagnostic that
    training logs, whatever it says (a timeout while its threads compile, say, must not cost a run).
    """
    verdicts = {}
    for path in paths:
        if not Path(path).is_file():
            raise MissingInputError(f"{path} does not exist: run the preflight stages first (snakemake runs them before train)")
        data = json.loads(Path(path).read_text())
        stage = data.get("stage", "?")
        verdict = (data if stage == "repro_fx_race" else read_verdict(path, stage)) | {"path": str(path)}
        verdicts[f"warmup_cache/{verdict['device']}" if stage == "warmup_cache" else stage] = verdict
    race = verdicts.get("repro_fx_race")
    if race is not None:
        world = topology.world
        if race.get("ok") and THREADS in race.get("safe_for", []):
            log.info("repro_fx_race: %s; training runs %d process(es), one thread of compiled code each", race.get("summary"), world)
        else:
            log.warning(
                "repro_fx_race (%s): %s. Training is unaffected: it runs %d process(es), one thread of compiled code each, and the race "
                "needs two threads of one process; code that calls compiled functions from threads must not rely on the mitigation",
                race["path"],
                race.get("summary"),
                world,
            )
    return verdicts
