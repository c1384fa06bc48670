"""Training the drafter on the target's hidden states: settings → feature source → model and optimizer → loop → save.

One process per device; ``dflash.distributed`` holds everything about ranks,
so with one process this is a plain single-device loop. The pieces live in
their own modules: the sample order and batches (``batch``), where hidden
states come from (``features``), one optimizer step (``step``), checkpoints
(``checkpoint``), the compile cache (``compile_cache``) and the preflight gate
(``preflight.gate``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from dflash import distributed
from dflash.batch import Schedule, idle_batch, make_batch, rank_slice, step_shapes
from dflash.checkpoint import Progress, load_checkpoint, resume_point, save_checkpoint, save_drafter
from dflash.compile_cache import compile_cache_hits, log_compile_cache_hits, use_warm_cache
from dflash.config import DrafterConfig, TrainConfig
from dflash.distributed import Layout, all_reduce_sum
from dflash.features import CachedFeatures, HiddenStateCache, Meter, OnlineFeatures, ReceivedFeatures, serve_features, total_rate
from dflash.model import DFlashConfig
from dflash.step import compile_drafter, drafter_config_for, normalise_globally, train_step, training_drafter, validation_metrics
from dflash.target import Target, preparation_dtype
from dflash.vocab import DraftVocab

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    steps: int
    resumed_from: int
    final_loss: float
    seconds: float
    tokens_per_second: float  # training: sample tokens (no padding) of the global batches per second, after the first step
    first_step_seconds: float  # the first step alone: compiling (or loading compiled graphs) and warming up
    target_tokens_per_second: float  # hidden states: tokens per second of target forward, summed over the ranks that run it
    world: int  # processes
    threads: int  # intra-op threads per process
    compile_cache: dict  # hits and misses of the whole run: a miss is a graph the warmup did not compile
    draft_vocab: int | None = None  # tokens the drafter drafts (None: the target's whole vocabulary)
    draft_vocab_coverage: float = 1.0  # the share of the training responses' tokens it holds
    validation_accuracy: list[float] | None = None  # per block position 1..B-1 on the validation samples, at the end
    validation_tau: float | None = None  # teacher-forced acceptance length on them, at the end
    peak_memory_gb: float | None = None  # CUDA: the most this rank's device held


@dataclass(frozen=True)
class RunContext:
    """What a drafter rank's loop reads: the run's inputs, its settings, where it writes, its place in the topology."""

    target: Target
    samples: pd.DataFrame
    config: DFlashConfig
    cfg: TrainConfig
    schedule: Schedule
    layout: Layout
    checkpoint_dir: Path
    out_dir: Path
    metrics_path: Path
    tracker: object | None = None
    vocab: DraftVocab | None = None
    vocab_coverage: float = 1.0  # the share of the training responses' tokens the vocabulary holds
    validation: pd.DataFrame | None = None
    checks: HiddenStateCache | None = None  # the target's rows of the validation samples

    @property
    def feature_width(self) -> int:
        return len(self.config.target_layer_ids) * self.config.hidden_size

    def head(self) -> torch.Tensor:
        """The frozen LM head rows the drafter projects onto."""
        weight = self.target.lm_head.weight
        return weight if self.vocab is None else self.vocab.head(weight)


def validation_due(previous: int, done: int, every: int, total: int) -> bool:
    """Whether the metrics row of step ``done`` (the last row was at ``previous``) carries validation accuracy:
    the first row at or after each multiple of ``every``, and the last row of the run."""
    return done // every > previous // every or done == total


# Settings that change what is logged or how often state is saved, never what is trained: a run resumes across them.
OBSERVATION_KEYS = {"train": ("log_every", "validate_every", "checkpoint_every"), "tracking": None}


def resumable_settings(run_config: dict) -> dict:
    """The settings a checkpoint belongs to: the run's config without ``OBSERVATION_KEYS``."""
    kept = {}
    for section, value in run_config.items():
        dropped = OBSERVATION_KEYS.get(section, ())
        if dropped is None:
            continue
        kept[section] = {k: v for k, v in value.items() if k not in dropped} if isinstance(value, dict) else value
    return kept


def lr_factor(step: int, total_steps: int, warmup_ratio: float) -> float:
    """Linear warmup then cosine decay to zero."""
    warmup = max(1, int(math.ceil(warmup_ratio * total_steps)))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def write_metrics_row(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


def train_drafter(
    target: Target,
    samples: pd.DataFrame,
    drafter_cfg: DrafterConfig,
    cfg: TrainConfig,
    seed: int,
    hidden_cache_dir: Path,
    checkpoint_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    tracker=None,
    max_steps: int | None = None,
    layout: Layout | None = None,
    validation: pd.DataFrame | None = None,
) -> TrainResult:
    """Train on this rank's part of the topology (one process: the whole run); resumes from the last complete checkpoint.

    Every rank of the run calls this. Rank 0 writes the metrics, the checkpoints and the drafter.
    ``validation`` samples are never trained on: the per-position accuracy on them is logged.
    """
    layout = layout or distributed.single_process(target.device)
    config = drafter_config_for(target, drafter_cfg)
    schedule = Schedule.for_run(len(samples), cfg, seed, max_steps)
    responses = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(samples["input_ids"], samples["loss_mask"])]
    vocab = (
        DraftVocab.most_frequent(responses, drafter_cfg.draft_vocab_size, target.config.vocab_size, target.eos_token_ids)
        if drafter_cfg.draft_vocab_size
        else None
    )
    coverage = vocab.coverage([t for response in responses for t in response]) if vocab is not None else 1.0
    first, checkpoint = resume_point(checkpoint_dir, layout)
    meter, start = Meter(), time.perf_counter()
    checks = None
    if validation is not None and len(validation):
        checks = HiddenStateCache.build(hidden_cache_dir.with_name(f"{hidden_cache_dir.name}-validation"), target, validation, config.target_layer_ids, layout)
    run = RunContext(target, samples, config, cfg, schedule, layout, checkpoint_dir, out_dir, metrics_path, tracker, vocab, coverage, validation, checks)
    idle = TrainResult(schedule.total, first, float("nan"), 0.0, 0.0, 0.0, 0.0, layout.world, torch.get_num_threads(), {})  # a target rank's
    # The target's throughput is summed over the ranks where its work ends: once the cache is built (every rank
    # builds a shard; split target ranks then leave), or after an online run.
    if cfg.hidden_states == "cache":
        source = CachedFeatures(HiddenStateCache.build(hidden_cache_dir, target, samples, config.target_layer_ids, layout, meter, cfg.distill_top_k))
        target_rate = total_rate(meter, layout)
        result = _train(run, source, first, checkpoint) if layout.is_drafter else idle
    else:
        if layout.kind == "colocated":
            result = _train(run, OnlineFeatures(target, samples, config.target_layer_ids, meter, cfg.distill_top_k), first, checkpoint)
        elif layout.is_drafter:
            lengths = [len(ids) for ids in samples["input_ids"]]
            result = _train(run, ReceivedFeatures(layout, schedule, lengths, run.feature_width, target.dtype, cfg.distill_top_k), first, checkpoint)
        else:
            serve_features(layout, target, samples, config.target_layer_ids, schedule, first, meter, cfg.distill_top_k)
            result = dataclasses.replace(idle, seconds=time.perf_counter() - start)
        target_rate = total_rate(meter, layout)
    return dataclasses.replace(result, target_tokens_per_second=target_rate)


def _train(run: RunContext, source, first: int, checkpoint: Path | None) -> TrainResult:
    """A drafter rank's loop."""
    layout, cfg, config, schedule = run.layout, run.cfg, run.config, run.schedule
    torch.manual_seed(schedule.seed)
    drafter = training_drafter(config, cfg, layout.device)
    distributed.shard(drafter, layout)
    forward = distributed.replicate(compile_drafter(drafter, cfg.compile), layout)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, schedule.total, cfg.warmup_ratio))
    lengths = [len(ids) for ids in run.samples["input_ids"]]
    head = run.head()
    progress = Progress.fresh(config.block_size)
    if checkpoint is not None:
        progress = load_checkpoint(checkpoint, drafter, optimizer, scheduler, layout)
        log.info("resuming from %s (step %d of %d)", checkpoint, first, schedule.total)
    if layout.is_main:
        # The rows of the run so far (a resumed run's are the checkpoint's; a fresh run's, none).
        run.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        run.metrics_path.unlink(missing_ok=True)
        for row in progress.rows:
            write_metrics_row(run.metrics_path, row)
    start, tokens_seen, loss_value = time.perf_counter(), 0, float("nan")
    first_step_seconds, steady = 0.0, (start, 0)  # throughput is measured from the end of the first step
    with tqdm(total=schedule.total, initial=first, desc="training drafter", unit="step", disable=not layout.is_main) as bar:
        for step in range(first, schedule.total):
            epoch, global_batch = schedule.epoch(step), schedule.batch(step)
            share = rank_slice(global_batch, layout.rank, layout.drafter_world)
            rows = source(step, share)
            if share:
                batch = make_batch(run.samples, share, rows, config, cfg, schedule.seed, epoch, run.vocab)
            else:
                batch = idle_batch(run.samples, global_batch[0], run.feature_width, config, cfg)
            normalise_globally(batch, layout)
            loss, correct, counted, grad_norm = train_step(forward, drafter, optimizer, run.target, batch, cfg, head)
            scheduler.step()
            # One all-reduce for the metrics: each rank's loss is its share of the global loss, times the ranks.
            stats = all_reduce_sum(torch.cat([loss.detach().reshape(1).double(), correct.double(), counted.double()]), layout).cpu()
            loss_value = float(stats[0]) / layout.drafter_world
            progress.correct += stats[1 : 1 + config.block_size]
            progress.counted += stats[1 + config.block_size :]
            tokens_seen += sum(lengths[i] for i in global_batch)
            elapsed = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_seen / elapsed:.0f}")
            done = step + 1
            if step == first:
                first_step_seconds, steady = elapsed, (time.perf_counter(), tokens_seen)
                if cfg.compile:
                    log_compile_cache_hits(log)
            if done % cfg.log_every == 0 or done == schedule.total:
                acc = (progress.correct / progress.counted.clamp(min=1)).tolist()
                row = {
                    "step": done,
                    "epoch": epoch,
                    "loss": loss_value,
                    "grad_norm": grad_norm,
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": tokens_seen / elapsed,
                }
                row.update({f"acc_{k}": acc[k] for k in range(1, config.block_size)})
                previous = progress.rows[-1]["step"] if progress.rows else 0
                checked = run.checks is not None and validation_due(previous, done, cfg.validate_every, schedule.total)
                validated, val_tau = (
                    validation_metrics(drafter, run.target, head, run.validation, run.checks, config, cfg, run.vocab, layout, schedule.seed)
                    if checked
                    else ([float("nan")] * config.block_size, float("nan"))
                )
                row.update({f"val_acc_{k}": validated[k] for k in range(1, config.block_size)})
                row["val_tau"] = val_tau
                progress.rows.append(row)
                progress.correct.zero_()
                progress.counted.zero_()
                if layout.is_main:
                    write_metrics_row(run.metrics_path, row)
                    if run.tracker is not None:
                        run.tracker.log(row, step=done)
            if done % cfg.checkpoint_every == 0 and done < schedule.total:
                save_checkpoint(run.checkpoint_dir, done, drafter, optimizer, scheduler, progress, layout)
    end = time.perf_counter()
    save_drafter(drafter, config, run.out_dir, layout, run.vocab)
    steady_tokens = tokens_seen - steady[1]
    return TrainResult(
        steps=schedule.total,
        resumed_from=first,
        final_loss=loss_value,
        seconds=end - start,
        tokens_per_second=steady_tokens / (end - steady[0]) if steady_tokens else tokens_seen / max(end - start, 1e-9),
        first_step_seconds=first_step_seconds,
        target_tokens_per_second=0.0,
        world=layout.world,
        threads=torch.get_num_threads(),
        compile_cache=compile_cache_hits() if cfg.compile else {},
        draft_vocab=len(run.vocab) if run.vocab is not None else None,
        draft_vocab_coverage=run.vocab_coverage,
        validation_accuracy=[progress.rows[-1][f"val_acc_{k}"] for k in range(1, config.block_size)] if run.checks is not None else None,
        validation_tau=progress.rows[-1].get("val_tau") if run.checks is not None else None,
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
    result = train_drafter(
        target,
        samples,
        sections["drafter"],
        sections["train"],
        args.seed,
        hidden_cache_dir=args.checkpoint_dir / "hidden-states",
        checkpoint_dir=args.checkpoint_dir / fingerprint,
        out_dir=out_dir / "drafter",
        metrics_path=out_dir / "metrics.csv",
        tracker=tracker,
        layout=layout,
        validation=validation,
    )
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
