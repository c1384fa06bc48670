"""One rank of a distributed training run on a tiny random target, for tests/test_distributed.py.

Run by torchrun (``python -m torch.distributed.run --nproc-per-node N tests/distributed_worker.py --spec JSON``),
or called in-process with one rank. Each drafter rank records what every step trained on and a hash
of its weights after the step, and writes them to ``<out>/rank<r>.json``; rank 0 also writes the
run's metrics and drafter as training does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import dflash.run
import dflash.train
from dflash import distributed
from dflash.config import DrafterConfig, TopologyConfig, TrainConfig, parse_section
from dflash.preflight.synthetic import synthetic_samples, tiny_target
from dflash.step import drafter_config_for

VOCAB = 128
MASK = 127


def weights_digest(module: torch.nn.Module) -> str:
    """A hash of the full weights (FSDP shards gathered: every drafter rank calls this)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run(spec: dict) -> None:
    torch.set_num_threads(1)
    out = Path(spec["out"])
    topology = parse_section(TopologyConfig, spec["topology"], "topology")
    layout = distributed.init(topology)
    target = tiny_target(seed=0)
    samples = synthetic_samples(spec["lengths"], VOCAB, seed=0)
    layer_ids = drafter_config_for(target, parse_section(DrafterConfig, spec["drafter"], "drafter")).target_layer_ids
    steps: list[dict] = []
    original = dflash.train.train_step

    def recording_step(forward, drafter, optimizer, target, batch, cfg, head=None):
        if spec.get("crash_at") is not None and len(steps) == spec["crash_at"]:
            os._exit(17)  # a crash between two steps: no cleanup, as after kill -9
        if spec.get("hang_at") is not None and len(steps) == spec["hang_at"] and layout.rank == spec["hang_rank"]:
            time.sleep(3600)  # alive but silent: its peers wait in the step's collectives
        # The rows must hold the target's own features of these samples, however they got here.
        expected = [target.features(torch.tensor([samples["input_ids"].iloc[i]]), None, layer_ids).features[0] for i in batch.indices]
        error = max((float((batch.features[r, : len(e)] - e).abs().max()) for r, e in enumerate(expected)), default=0.0)
        result = original(forward, drafter, optimizer, target, batch, cfg, head)
        steps.append({"indices": batch.indices, "feature_error": error, "weights": weights_digest(drafter)})
        return result

    dflash.train.train_step = recording_step
    try:
        settings = dflash.run.RunSettings(parse_section(DrafterConfig, spec["drafter"], "drafter"), parse_section(TrainConfig, spec["train"], "train"), seed=0)
        paths = dflash.run.RunPaths(
            hidden_cache=out / "cache" / "hidden-states", checkpoints=out / "cache" / "checkpoints", drafter=out / "drafter", metrics=out / "metrics.csv"
        )
        with distributed.naming_lost_ranks(layout, "training"):  # as the train stage
            result = dflash.train.train_drafter(target, samples, settings, paths, layout=layout)
    finally:
        dflash.train.train_step = original  # run in-process by a test, the module must be left as it was
    if layout.is_drafter:
        record = {"steps": steps, "resumed_from": result.resumed_from, "target_tokens_per_second": result.target_tokens_per_second}
        (out / f"rank{layout.rank}.json").write_text(json.dumps(record))
    distributed.shutdown(layout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    run(json.loads(parser.parse_args().spec))
