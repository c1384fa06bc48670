"""Does a DDP-wrapped compiled drafter run from a compile cache warmed without DDP, as the warmup warms it?

    python benchmarks/ddp_warm_cache.py            # cpu (gloo), or cuda (nccl) where a GPU is visible

Three fresh processes share one empty compile cache: the first runs the training step on a plain
compiled drafter (``dflash.step.compile_drafter``), as ``warmup_cache`` does; the second runs the same
step with the compiled drafter wrapped in DistributedDataParallel (a one-process group), as a drafter
rank does, and prints its FX-graph and AOT-autograd cache hits and misses; the third does the same with
Dynamo's default DDP graph splitting (``optimize_ddp``) turned back on, which compiles graphs the
warmup never saw. Prints one line per process; exits 1 when the DDP process misses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def step(mode: str, device: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dflash.compile_cache import compile_cache_hits
    from dflash.config import TrainConfig
    from dflash.preflight.synthetic import synthetic_batch, tiny_drafter_config, tiny_target
    from dflash.step import compile_drafter, train_step, training_drafter

    torch.manual_seed(0)
    target = tiny_target(device)
    config = tiny_drafter_config(target)
    cfg = TrainConfig(max_anchors=3, pad_multiple=16)
    drafter = training_drafter(config, cfg, torch.device(device))
    forward = compile_drafter(drafter, enabled=True)
    if mode != "plain":
        if mode == "ddp-split":
            torch._dynamo.config.optimize_ddp = True  # Dynamo's default, which compile_drafter turns off
            dist._DEFAULT_FIRST_BUCKET_BYTES = 1024  # DDPOptimizer requires first bucket <= the others; the tiny drafter needs KB buckets to split
        # A one-process group in memory: no port to collide with another run.
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        forward = DistributedDataParallel(forward, device_ids=[torch.device(device)] if device.startswith("cuda") else None, bucket_cap_mb=0.001)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    train_step(forward, drafter, optimizer, target, synthetic_batch(config, [40, 33], cfg), cfg)
    return compile_cache_hits()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(step(args.step, args.device)), flush=True)
        # No teardown: destroying a gloo group under a live DDP reducer can hang joining gloo's threads
        # (seen on torch 2.13), and this process has printed all it measures.
        os._exit(0)
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        for mode in ("plain", "ddp", "ddp-split"):
            done = subprocess.run([sys.executable, __file__, "--device", args.device, "--step", mode], env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    for mode, hits in results.items():
        print(
            f"{mode:>10}: FX graph {hits['fxgraph_cache_hit']} hit(s), {hits['fxgraph_cache_miss']} miss(es); AOT autograd {hits['autograd_cache_hit']} hit(s), {hits['autograd_cache_miss']} miss(es)"
        )
    ddp = results["ddp"]
    served = ddp["fxgraph_cache_hit"] > 0 and ddp["fxgraph_cache_miss"] == 0 and ddp["autograd_cache_miss"] == 0
    print("the DDP-wrapped drafter ran from the warm cache" if served else "the DDP-wrapped drafter compiled graphs the warmup did not")
    sys.exit(0 if served else 1)


if __name__ == "__main__":
    main()
