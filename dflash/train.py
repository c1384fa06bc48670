"""Training the drafter on the target's hidden states: settings → feature source → model and optimizer → loop → save.

One process per device; ``dflash.distributed`` holds everything about ranks,
so with one process this is a plain single-device loop. The pieces live in
their own modules: what a run is (``run``), the sample order and batches
(``batch``), where hidden states come from (``features``), one optimizer step
(``step``), what the run logs (``metrics``), checkpoints (``checkpoint``), the
compile cache (``compile_cache``) and the preflight gate (``preflight.gate``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from dflash import distributed
from dflash.batch import Schedule, idle_batch, make_batch, rank_slice, step_shapes
from dflash.checkpoint import Progress, load_checkpoint, resume_point, save_checkpoint, save_drafter
from dflash.compile_cache import compile_cache_hits, log_compile_cache_hits, use_warm_cache
from dflash.distributed import Layout
from dflash.features import CachedFeatures, HiddenStateCache, Meter, OnlineFeatures, total_rate
from dflash.metrics import MetricsLog, TokenRate, Validator
from dflash.optim import build_optimizer
from dflash.run import RunContext, RunPaths, RunSettings, TrainResult, resumable_settings
from dflash.step import ValidationData, compile_drafter, drafter_config_for, normalise_globally, train_step, training_drafter
from dflash.target import Target, preparation_dtype
from dflash.transport import ReceivedFeatures, serve_features
from dflash.vocab import DraftVocab

log = logging.getLogger(__name__)


class Batches:
    """Step ``step``'s batch on this rank: its share of the global batch, its features from the source, labelled and
    normalised over the whole global batch (a stand-in row of zero weight when the share is empty)."""

    def __init__(self, run: RunContext, source):
        self.run, self.source = run, source
        self.lengths = [len(ids) for ids in run.samples["input_ids"]]

    def __call__(self, step: int):
        run = self.run
        global_batch = run.schedule.batch(step)
        share = rank_slice(global_batch, run.layout.rank, run.layout.drafter_world)
        rows = self.source(step, share)
        if share:
            batch = make_batch(run.samples, share, rows, run.config, run.cfg, run.schedule.seed, run.schedule.epoch(step), run.vocab)
        else:
            batch = idle_batch(run.samples, global_batch[0], run.config.feature_width, run.config, run.cfg)
        normalise_globally(batch, run.layout)
        return batch, sum(self.lengths[i] for i in global_batch)


def feature_source(run: RunContext, first: int, meter: Meter):
    """Where this rank's hidden states come from, by the layout: the disk cache (built here, every rank a shard), the
    target on this rank (colocated), or the target ranks (split, drafter side). ``None`` on a split target rank,
    which serves its drafter ranks here and trains nothing."""
    online = OnlineFeatures(run.target, run.samples, run.config.target_layer_ids, meter, run.cfg.distill_top_k)
    if run.cfg.hidden_states == "cache":
        cache = HiddenStateCache.build(run.paths.hidden_cache, online, run.layout)
        return CachedFeatures(cache) if run.layout.is_drafter else None
    if run.layout.kind == "colocated":
        return online
    if run.layout.is_drafter:
        lengths = [len(ids) for ids in run.samples["input_ids"]]
        return ReceivedFeatures(run.layout, run.schedule, lengths, run.config.feature_width, run.target.dtype, run.cfg.distill_top_k)
    serve_features(run.layout, online, run.schedule, first)
    return None


# -- the run ------------------------------------------------------------------------------------


def draft_vocabulary(samples: pd.DataFrame, size: int | None, target: Target) -> tuple[DraftVocab | None, float]:
    """The ``size`` tokens the training responses use most (None: the whole vocabulary), and the share of the responses'
    tokens they hold. The responses' tokens are gathered only for this, and dropped here: at scale they are gigabytes."""
    if not size:
        return None, 1.0
    responses = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(samples["input_ids"], samples["loss_mask"])]
    vocab = DraftVocab.most_frequent(responses, size, target.config.vocab_size, target.eos_token_ids)
    return vocab, vocab.coverage([t for response in responses for t in response])


def train_drafter(
    target: Target,
    samples: pd.DataFrame,
    settings: RunSettings,
    paths: RunPaths,
    layout: Layout | None = None,
    validation: pd.DataFrame | None = None,
    tracker=None,
) -> TrainResult:
    """Train on this rank's part of the topology (one process: the whole run); resumes from the last complete checkpoint.

    Every rank of the run calls this. Rank 0 writes the metrics, the checkpoints and the drafter.
    ``validation`` samples are never trained on: per-position accuracy and τ on them are logged.
    """
    layout = layout or distributed.single_process(target.device)
    cfg, config = settings.train, drafter_config_for(target, settings.drafter)
    # Target ranks draft nothing: only drafter ranks gather the responses' tokens.
    vocab, coverage = draft_vocabulary(samples, settings.drafter.draft_vocab_size, target) if layout.is_drafter else (None, 1.0)
    run = RunContext(
        target=target,
        samples=samples,
        config=config,
        cfg=cfg,
        schedule=Schedule.for_run(len(samples), cfg, settings.seed, settings.max_steps),
        layout=layout,
        paths=paths,
        vocab=vocab,
    )
    validator = None
    if validation is not None and len(validation):
        cache = paths.hidden_cache.with_name(f"{paths.hidden_cache.name}-validation")
        rows = HiddenStateCache.build(cache, OnlineFeatures(target, validation, config.target_layer_ids), layout)
        validator = Validator(run, ValidationData(validation, rows, vocab, settings.seed))
    first, checkpoint = resume_point(paths.checkpoints, layout)
    meter, start = Meter(), time.perf_counter()
    source = feature_source(run, first, meter)
    # The target's throughput is summed over the ranks where its work ends: once the cache is built, or after serving.
    target_rate = total_rate(meter, layout) if cfg.hidden_states == "cache" else None
    if source is None:  # a target rank: its part is done
        result = TrainResult(
            steps=run.schedule.total, resumed_from=first, final_loss=float("nan"), seconds=time.perf_counter() - start, tokens_per_second=0.0,
            first_step_seconds=0.0, target_tokens_per_second=0.0, world=layout.world, threads=torch.get_num_threads(), compile_cache={},
        )  # fmt: skip
    else:
        result = _train(run, Batches(run, source), first, checkpoint, validator, tracker)
    rate = target_rate if target_rate is not None else total_rate(meter, layout)
    return dataclasses.replace(result, target_tokens_per_second=rate, draft_vocab_coverage=coverage)


def _train(run: RunContext, batches: Batches, first: int, checkpoint: Path | None, validator: Validator | None, tracker) -> TrainResult:
    """A drafter rank's loop."""
    layout, cfg, schedule = run.layout, run.cfg, run.schedule
    torch.manual_seed(schedule.seed)
    drafter = training_drafter(run.config, cfg, layout.device)
    distributed.shard(drafter, layout)
    forward = distributed.replicate(compile_drafter(drafter, cfg.compile), layout)
    optimizer = build_optimizer(drafter, cfg, schedule.total)
    progress = Progress.fresh(run.config.block_size)
    if checkpoint is not None:
        progress = load_checkpoint(checkpoint, drafter, optimizer, layout)
        log.info("resuming from %s (step %d of %d)", checkpoint, first, schedule.total)
    metrics, throughput, head, loss = MetricsLog(run, progress, validator, tracker), TokenRate(), run.head(), float("nan")
    with tqdm(total=schedule.total, initial=first, desc="training drafter", unit="step", disable=not layout.is_main) as bar:
        for step in range(first, schedule.total):
            batch, tokens = batches(step)
            step_loss, correct, counted, grad_norm = train_step(forward, drafter, optimizer, run.target, batch, cfg, head)
            loss = metrics.count(step_loss, correct, counted)
            rate = throughput.step(tokens)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
            done = step + 1
            if step == first and cfg.compile:
                log_compile_cache_hits(log)
            if done % cfg.log_every == 0 or done == schedule.total:
                values = {"epoch": schedule.epoch(step), "loss": loss, "grad_norm": grad_norm, "lr": optimizer.lr, "tokens_per_s": rate}
                metrics.log(done, drafter, values)
            if done % cfg.checkpoint_every == 0 and done < schedule.total:
                save_checkpoint(run.paths.checkpoints, done, drafter, optimizer, progress, layout)
    end = time.perf_counter()
    save_drafter(drafter, run.config, run.paths.drafter, layout, run.vocab, run.target.lm_head.weight)
    accuracy, tau = metrics.final_validation()
    return TrainResult(
        steps=schedule.total,
        resumed_from=first,
        final_loss=loss,
        seconds=end - throughput.start,
        tokens_per_second=throughput.steady_rate(end),
        first_step_seconds=throughput.first_step_seconds,
        target_tokens_per_second=0.0,
        world=layout.world,
        threads=torch.get_num_threads(),
        compile_cache=compile_cache_hits() if cfg.compile else {},
        draft_vocab=len(run.vocab) if run.vocab is not None else None,
        validation_accuracy=accuracy,
        validation_tau=tau,
        peak_memory_gb=round(torch.cuda.max_memory_allocated(layout.device) / 1e9, 2) if layout.device.type == "cuda" else None,
    )


def run_train_stage(sections: dict, args) -> TrainResult:
    """The ``train`` stage, on every rank torchrun started: drafter, metrics CSV, summary JSON under
    ``args.out_dir`` (rank 0); checkpoints and the hidden-state cache under ``args.checkpoint_dir``."""
    from dflash.config import canonical_json, config_hash
    from dflash.data import read_samples
    from dflash.preflight.gate import check_preflight, device_name
    from dflash.target import load_from_manifest
    from dflash.tracking import open_tracker

    topology = sections["topology"]
    # An error on one rank ends its process; torchrun then stops the others, so no rank waits for it.
    layout = distributed.init(topology)
    verdicts = check_preflight(args.preflight, topology)
    samples = read_samples(args.samples)
    validation = read_samples(args.validation, allow_empty=True) if args.validation else None
    if sections["train"].compile and layout.is_drafter:
        warmup = verdicts.get(f"warmup_cache/{device_name(topology.device, layout.local_rank)}")
        if warmup is None:
            log.warning("no compile-cache warmup for this device: the first training step compiles cold")
        else:
            use_warm_cache(warmup)
            shapes = step_shapes([len(ids) for ids in samples["input_ids"]], sections["train"], layout.drafter_world)
            cold = sorted(set(shapes) - {tuple(shape) for shape in warmup["shapes"]})
            if cold:
                log.warning("the warmup did not compile %d batch shape(s) (rows, length) of this run: %s; those compile cold", len(cold), cold[:8])
    dtype = preparation_dtype(sections["train"].target_dtype, layout.device)
    target = load_from_manifest(args.target_manifest, device=layout.device, dtype=dtype, layers=layout.rank in layout.layer_holders)
    run_config = {key: json.loads(canonical_json(value)) for key, value in sections.items()} | {"seed": args.seed}
    fingerprint = config_hash(resumable_settings(run_config) | {"samples": HiddenStateCache.cache_key(samples, target.source, [])})
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tracking = sections["tracking"]
    tracker = open_tracker(tracking.wandb_mode, tracking.project, fingerprint, out_dir.parent / "wandb", run_config, rank=layout.rank)
    paths = RunPaths(
        hidden_cache=args.checkpoint_dir / "hidden-states",
        checkpoints=args.checkpoint_dir / fingerprint,
        drafter=out_dir / "drafter",
        metrics=out_dir / "metrics.csv",
    )
    settings = RunSettings(drafter=sections["drafter"], train=sections["train"], seed=args.seed)
    with distributed.naming_lost_ranks(layout, "training"):
        result = train_drafter(target, samples, settings, paths, layout=layout, validation=validation, tracker=tracker)
    if layout.is_main:
        where = f"{topology.kind} {topology.nnodes}x{topology.nproc_per_node} {topology.device}"
        summary = dataclasses.asdict(result) | {"fingerprint": fingerprint, "samples": len(samples), "topology": where}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if tracker is not None:
            tracker.summary(summary)
            tracker.finish()
        log.info(
            "trained %d steps in %.0f s (%.0f tokens/s; target %.0f tokens/s) on %d process(es); drafter at %s",
            result.steps, result.seconds, result.tokens_per_second, result.target_tokens_per_second, layout.world, out_dir / "drafter",
        )  # fmt: skip
    distributed.shutdown(layout)
    if layout.is_main:
        # The stage is complete (drafter, summary, tracker): its checkpoints would only let a later rerun (of changed
        # code, say) resume stale state. Until here, a failure leaves them for the rerun to resume from.
        shutil.rmtree(args.checkpoint_dir / fingerprint, ignore_errors=True)
    return result
