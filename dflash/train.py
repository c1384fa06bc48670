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
from dataclasses import dataclass, field
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
from dflash.features import CachedFeatures, HiddenStateCache, Meter, OnlineFeatures, total_rate
from dflash.model import DFlashConfig
from dflash.step import ValidationData, compile_drafter, drafter_config_for, normalise_globally, train_step, training_drafter, validation_metrics
from dflash.target import Target, preparation_dtype
from dflash.transport import ReceivedFeatures, serve_features
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
class RunPaths:
    """Where a run writes: the hidden-state caches, its checkpoints (one run's), the drafter, the metrics CSV."""

    hidden_cache: Path
    checkpoints: Path
    drafter: Path
    metrics: Path


@dataclass(frozen=True)
class RunSettings:
    """What a run trains: the drafter's shape, the training settings, the seed, and (for benchmarks) a step limit."""

    drafter: DrafterConfig
    train: TrainConfig
    seed: int = 0
    max_steps: int | None = None


@dataclass(frozen=True)
class RunContext:
    """What a drafter rank's loop reads: the run's inputs and settings, where it writes, its place in the topology."""

    target: Target
    samples: pd.DataFrame
    config: DFlashConfig
    cfg: TrainConfig
    schedule: Schedule
    layout: Layout
    paths: RunPaths
    vocab: DraftVocab | None = None

    def head(self) -> torch.Tensor:
        """The frozen LM head rows the drafter projects onto."""
        weight = self.target.lm_head.weight
        return weight if self.vocab is None else self.vocab.head(weight)


def validation_due(previous: int, done: int, every: int, total: int) -> bool:
    """Whether the metrics row of step ``done`` (the last row was at ``previous``) carries validation accuracy:
    the first row at or after each multiple of ``every``, and the last row of the run."""
    return done // every > previous // every or done == total


# Settings that change what is logged or how often state is saved, never what is trained: a run resumes across them.
OBSERVATION_KEYS = {"train": ("log_every", "validate_every", "checkpoint_every"), "topology": ("collective_timeout_s",), "tracking": None}


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


# -- the parts of a drafter rank's loop --------------------------------------------------------


class Validator:
    """Per-position accuracy and teacher-forced τ of the drafter on the validation samples, on the metric rows due."""

    def __init__(self, run: RunContext, data: ValidationData):
        self.run, self.data = run, data

    def due(self, previous: int, done: int) -> bool:
        return validation_due(previous, done, self.run.cfg.validate_every, self.run.schedule.total)

    def __call__(self, drafter) -> tuple[list[float], float]:
        run = self.run
        return validation_metrics(drafter, run.target, run.head(), self.data, run.config, run.cfg, run.layout)


class MetricsLog:
    """The run's metric rows: the accuracy counts of the logging window, each row's validation, the CSV and the
    tracker (rank 0). A resumed run starts from the rows and window of its checkpoint."""

    def __init__(self, run: RunContext, progress: Progress, validator: Validator | None = None, tracker=None):
        self.run, self.progress, self.validator, self.tracker = run, progress, validator, tracker
        if run.layout.is_main:
            run.paths.metrics.parent.mkdir(parents=True, exist_ok=True)
            run.paths.metrics.unlink(missing_ok=True)
            for row in progress.rows:
                write_metrics_row(run.paths.metrics, row)

    def count(self, loss: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor) -> float:
        """One step's loss and accuracy counts, summed over the drafter ranks (one all-reduce); the global loss."""
        layout, block = self.run.layout, self.run.config.block_size
        # Each rank's loss is its share of the global loss, times the ranks.
        stats = all_reduce_sum(torch.cat([loss.detach().reshape(1).double(), correct.double(), counted.double()]), layout).cpu()
        self.progress.correct += stats[1 : 1 + block]
        self.progress.counted += stats[1 + block :]
        return float(stats[0]) / layout.drafter_world

    def log(self, done: int, drafter, values: dict) -> None:
        """The row of step ``done``: ``values``, the window's accuracy per position, and validation where due."""
        progress, block = self.progress, self.run.config.block_size
        accuracy = (progress.correct / progress.counted.clamp(min=1)).tolist()
        row = {"step": done} | values | {f"acc_{k}": accuracy[k] for k in range(1, block)}
        previous = progress.rows[-1]["step"] if progress.rows else 0
        validated, tau = [float("nan")] * block, float("nan")
        if self.validator is not None and self.validator.due(previous, done):
            validated, tau = self.validator(drafter)
        row |= {f"val_acc_{k}": validated[k] for k in range(1, block)} | {"val_tau": tau}
        progress.rows.append(row)
        progress.correct.zero_()
        progress.counted.zero_()
        if self.run.layout.is_main:
            write_metrics_row(self.run.paths.metrics, row)
            if self.tracker is not None:
                self.tracker.log(row, step=done)

    def final_validation(self) -> tuple[list[float] | None, float | None]:
        if self.validator is None or not self.progress.rows:
            return None, None
        last = self.progress.rows[-1]
        return [last[f"val_acc_{k}"] for k in range(1, self.run.config.block_size)], last["val_tau"]


@dataclass
class Throughput:
    """Sample tokens per second of the global batches, measured from the end of the first step (which compiles)."""

    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    first_step_seconds: float = 0.0
    steady: tuple[float, int] | None = None  # (time, tokens) at the end of the first step

    def step(self, tokens: int) -> float:
        """Count a step's tokens; the running rate."""
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        if self.steady is None:
            self.first_step_seconds, self.steady = elapsed, (time.perf_counter(), self.tokens)
        return self.tokens / elapsed

    def steady_rate(self, end: float) -> float:
        tokens = self.tokens - self.steady[1] if self.steady else 0
        return tokens / (end - self.steady[0]) if tokens else self.tokens / max(end - self.start, 1e-9)


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
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, schedule.total, cfg.warmup_ratio))
    progress = Progress.fresh(run.config.block_size)
    if checkpoint is not None:
        progress = load_checkpoint(checkpoint, drafter, optimizer, scheduler, layout)
        log.info("resuming from %s (step %d of %d)", checkpoint, first, schedule.total)
    metrics, throughput, head, loss = MetricsLog(run, progress, validator, tracker), Throughput(), run.head(), float("nan")
    with tqdm(total=schedule.total, initial=first, desc="training drafter", unit="step", disable=not layout.is_main) as bar:
        for step in range(first, schedule.total):
            batch, tokens = batches(step)
            step_loss, correct, counted, grad_norm = train_step(forward, drafter, optimizer, run.target, batch, cfg, head)
            scheduler.step()
            loss = metrics.count(step_loss, correct, counted)
            rate = throughput.step(tokens)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
            done = step + 1
            if step == first and cfg.compile:
                log_compile_cache_hits(log)
            if done % cfg.log_every == 0 or done == schedule.total:
                values = {"epoch": schedule.epoch(step), "loss": loss, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0], "tokens_per_s": rate}
                metrics.log(done, drafter, values)
            if done % cfg.checkpoint_every == 0 and done < schedule.total:
                save_checkpoint(run.paths.checkpoints, done, drafter, optimizer, scheduler, progress, layout)
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
