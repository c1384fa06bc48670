"""Training the drafter on the target's hidden states.

Reads top to bottom: the sample order, hidden-state sources (a disk cache
computed once, or the target online), batch assembly, the loss through the
target's frozen LM head, and the loop (AdamW, warmup + cosine, clipping,
metrics, resumable checkpoints).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from dflash.attention import build_training_mask
from dflash.config import DrafterConfig, TrainConfig
from dflash.model import DFlashConfig, DFlashDrafter
from dflash.objective import Blocks, build_blocks, default_gamma, position_accuracy, sample_anchors, sample_positions
from dflash.preflight.warmup import log_compile_cache_hits, use_warm_cache
from dflash.target import Target

log = logging.getLogger(__name__)


# -- data order ------------------------------------------------------------------------------


def _seeded(*parts: int) -> torch.Generator:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The order samples are seen in an epoch: a function of the seed and the epoch only, never of the topology."""
    return torch.randperm(num_samples, generator=_seeded(seed, epoch)).tolist()


def global_batches(num_samples: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices of each optimizer step of an epoch; the last partial batch is kept."""
    order = epoch_order(num_samples, seed, epoch)
    return [order[i : i + batch_size] for i in range(0, num_samples, batch_size)]


def rank_slice(batch: list[int], rank: int, world: int) -> list[int]:
    """A data-parallel rank's share of a global batch (strided, so shares differ by at most one sample)."""
    return batch[rank::world]


# -- hidden states ---------------------------------------------------------------------------


class HiddenStateCache:
    """Target features of every sample, computed once and memory-mapped from disk (fp16, one row per token)."""

    def __init__(self, directory: Path):
        meta = json.loads((directory / "meta.json").read_text())
        self.offsets = np.asarray(meta["offsets"], dtype=np.int64)
        self.features = np.load(directory / "features.npy", mmap_mode="r")
        self.key = meta["key"]

    def __getitem__(self, index: int) -> torch.Tensor:
        begin, end = self.offsets[index], self.offsets[index + 1]
        return torch.from_numpy(np.asarray(self.features[begin:end], dtype=np.float32))

    @staticmethod
    def cache_key(samples: pd.DataFrame, target_source: str, layer_ids: list[int]) -> str:
        digest = hashlib.sha256(json.dumps([target_source, list(layer_ids)]).encode())
        for ids in samples["input_ids"]:
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]

    @classmethod
    def build(cls, directory: Path, target: Target, samples: pd.DataFrame, layer_ids: list[int], token_budget: int = 8192) -> "HiddenStateCache":
        """Compute (or reuse) the cache; written under a temporary name and renamed, so a crash leaves no half cache."""
        key = cls.cache_key(samples, target.source, layer_ids)
        meta_path = directory / "meta.json"
        if meta_path.is_file() and json.loads(meta_path.read_text()).get("key") == key:
            log.info("hidden-state cache hit: %s", directory)
            return cls(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lengths = [len(ids) for ids in samples["input_ids"]]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        width = len(layer_ids) * target.hidden_size
        tmp = directory / "features.tmp.npy"
        store = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(int(offsets[-1]), width))
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        with tqdm(total=int(offsets[-1]), desc="caching target hidden states", unit="tok", unit_scale=True) as bar:
            begin = 0
            while begin < len(order):
                end = begin + 1
                while end < len(order) and (end - begin + 1) * lengths[order[end]] <= token_budget:
                    end += 1
                rows = order[begin:end]
                ids, mask = pad_rows([samples["input_ids"].iloc[i] for i in rows], pad_value=0)
                feats = target.features(ids.to(target.device), mask.to(target.device), layer_ids).float().cpu().numpy()
                for r, i in enumerate(rows):
                    store[offsets[i] : offsets[i + 1]] = feats[r, : lengths[i]]
                bar.update(sum(lengths[i] for i in rows))
                begin = end
        store.flush()
        del store
        tmp.replace(directory / "features.npy")
        meta_path.write_text(json.dumps({"key": key, "layer_ids": list(layer_ids), "offsets": offsets.tolist()}))
        return cls(directory)


def pad_rows(rows: list, pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad integer rows into ``[b, S]`` with an attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


# -- one batch ---------------------------------------------------------------------------------


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S] bool
    features: torch.Tensor  # [b, S, K*H]
    anchors: torch.Tensor  # [b, A]
    valid: torch.Tensor  # [b, A]
    blocks: Blocks
    weight_total: torch.Tensor  # the loss normaliser: the decay weights' sum before any position sampling

    @property
    def tokens(self) -> int:
        return int(self.input_ids.ne(-1).sum())


def make_batch(
    samples: pd.DataFrame,
    indices: list[int],
    features: list[torch.Tensor],
    config: DFlashConfig,
    max_anchors: int,
    gamma: float,
    seed: int,
    epoch: int,
    sample_loss_positions: bool = False,
) -> Batch:
    """Pad the samples and draw their anchors (and sampled loss positions); all randomness of a
    sample depends on (seed, epoch, sample index) only, never on the batch or the topology."""
    ids, _ = pad_rows([samples["input_ids"].iloc[i] for i in indices], pad_value=0)
    loss_mask, _ = pad_rows([samples["loss_mask"].iloc[i] for i in indices], pad_value=0)
    loss_mask = loss_mask.bool()
    width = ids.shape[1]
    feats = torch.zeros(len(indices), width, features[0].shape[-1])
    anchors, valid = [], []
    for row, (i, f) in enumerate(zip(indices, features)):
        feats[row, : f.shape[0]] = f
        length = len(samples["input_ids"].iloc[i])
        a, v = sample_anchors(loss_mask[row : row + 1, :length], max_anchors, _seeded(seed, epoch, i))
        anchors.append(a)
        valid.append(v)
    anchors, valid = torch.cat(anchors), torch.cat(valid)
    blocks = build_blocks(ids, loss_mask, anchors, valid, config.block_size, config.mask_token_id, gamma)
    weight_total = blocks.weights.sum()
    if sample_loss_positions:
        blocks.weights = torch.cat([sample_positions(w[None], _seeded(seed, epoch, i, 1)) for i, w in zip(indices, blocks.weights)])
    return Batch(ids, loss_mask, feats, anchors, valid, blocks, weight_total)


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """Weighted cross-entropy through a frozen LM head, in row chunks.

    Never holds more than ``chunk`` rows of logits: the gradient with respect to
    the hidden states is computed in the forward pass (the head is frozen, so
    nothing else needs the logits). Also returns the top-1 predictions.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, total, chunk):
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        predictions = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for begin in range(0, hidden.shape[0], chunk):
            h = hidden[begin : begin + chunk]
            logits = (h @ head_weight.to(h.dtype).t()).float()
            y, w = labels[begin : begin + chunk], weights[begin : begin + chunk]
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, y[:, None]).squeeze(1)) * w).sum()
            predictions[begin : begin + chunk] = logits.argmax(-1)
            if grad is not None:
                probs = torch.exp(logits - lse[:, None])
                probs[torch.arange(len(y), device=y.device), y] -= 1.0
                probs *= (w / total)[:, None]
                grad[begin : begin + chunk] = (probs.to(h.dtype) @ head_weight.to(h.dtype))
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(predictions)
        return loss / total, predictions

    @staticmethod
    def backward(ctx, grad_loss, _grad_predictions):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def compile_drafter(drafter: DFlashDrafter, enabled: bool):
    """The drafter's forward as training runs it: compiled with dynamic shapes (sequence lengths vary per batch).

    The compile-cache warmup compiles exactly this, so that training starts warm.
    """
    return torch.compile(drafter, dynamic=True) if enabled else drafter


def drafter_loss(
    drafter_forward,
    target: Target,
    batch: Batch,
    attention_backend: str,
    head_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decayed loss of one batch; also per-position correct and counted predictions."""
    device = target.device
    blocks = batch.blocks
    block_size = blocks.input_ids.shape[1] // batch.anchors.shape[1]
    mask = build_training_mask(batch.anchors.to(device), batch.valid.to(device), batch.input_ids.shape[1], block_size, attention_backend)
    with torch.no_grad():
        block_embeddings = target.embed(blocks.input_ids.to(device))
    context_positions = torch.arange(batch.input_ids.shape[1], device=device).expand(batch.input_ids.shape[0], -1)
    hidden = drafter_forward(batch.features.to(device), block_embeddings, context_positions, blocks.positions.to(device), mask)
    weights = blocks.weights.to(device).flatten()
    rows = weights.nonzero().squeeze(1)
    loss, predictions = FrozenHeadCrossEntropy.apply(
        hidden.flatten(0, 1)[rows],
        target.lm_head.weight,
        blocks.labels.to(device).flatten()[rows],
        weights[rows],
        batch.weight_total.to(device),
        head_chunk,
    )
    all_predictions = torch.full_like(weights, -1, dtype=torch.long)
    all_predictions[rows] = predictions
    correct, counted = position_accuracy(all_predictions.view_as(blocks.labels), blocks.labels.to(device), blocks.weights.to(device), block_size)
    return loss, correct, counted


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU (fp32 master weights), none on CPU, unless the config says otherwise."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def train_step(forward, drafter: torch.nn.Module, optimizer, target: Target, batch: Batch, cfg: TrainConfig):
    """One optimizer step: loss, backward, clipping, update. The compile-cache warmup runs exactly this."""
    device = target.device
    dtype = autocast_dtype(cfg.precision, device)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss, correct, counted = drafter_loss(forward, target, batch, cfg.attention_backend, cfg.head_chunk)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
    optimizer.step()
    return loss, correct, counted, grad_norm


# -- the loop ------------------------------------------------------------------------------------


def lr_factor(step: int, total_steps: int, warmup_ratio: float) -> float:
    """Linear warmup then cosine decay to zero."""
    warmup = max(1, int(math.ceil(warmup_ratio * total_steps)))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def drafter_config_for(target: Target, cfg: DrafterConfig) -> DFlashConfig:
    mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token_id(target)
    return DFlashConfig.for_target(
        target.config,
        mask_token_id=mask_token_id,
        num_hidden_layers=cfg.num_hidden_layers,
        num_context_features=cfg.num_context_features,
        block_size=cfg.block_size,
        layer_ids=cfg.layer_ids,
        intermediate_size=cfg.intermediate_size,
    )


def default_mask_token_id(target: Target) -> int:
    """A special token the chat template never emits: the highest-id added special token not used for chat."""
    tokenizer = target.tokenizer
    used = set(target.eos_token_ids) | {tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", "") or ""
    candidates = [
        token_id
        for token_id in sorted(getattr(tokenizer, "all_special_ids", []) + list(getattr(tokenizer, "added_tokens_decoder", {})))
        if token_id not in used and tokenizer.convert_ids_to_tokens(token_id) not in template and token_id < target.config.vocab_size
    ]
    if not candidates:
        raise ValueError(f"target {target.source!r} has no unused special token to serve as the mask; set drafter.mask_token_id")
    return max(candidates)


@dataclass
class TrainResult:
    steps: int
    resumed_from: int
    final_loss: float
    seconds: float
    tokens_per_second: float
    compile_cache: dict  # hits and misses after the first step: misses mean the warmup did not cover a graph


def write_metrics_row(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


# -- resumable checkpoints ---------------------------------------------------------------------
#
# They live outside the workflow's declared outputs (Snakemake deletes those before
# rerunning a job), one directory per run fingerprint. A checkpoint directory is
# written under a temporary name and renamed into place: a crash, even kill -9,
# mid-write leaves only a temporary directory, which is never loaded.

_STEP_PREFIX = "step-"


def complete_checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_STEP_PREFIX) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_STEP_PREFIX) :]))


def save_checkpoint(directory: Path, step: int, drafter: torch.nn.Module, optimizer, scheduler, keep: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{_STEP_PREFIX}{step:08d}"
    staging = directory / f".tmp-{final.name}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    torch.save(
        {
            "drafter": drafter.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        staging / "state.pt",
    )
    (staging / "meta.json").write_text(json.dumps({"step": step}))
    staging.rename(final)
    for old in complete_checkpoints(directory)[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: Path, drafter: torch.nn.Module, optimizer, scheduler) -> int:
    # weights_only: the restricted unpickler, which cannot run code from the file.
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    drafter.load_state_dict(state["drafter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return json.loads((path / "meta.json").read_text())["step"]


# -- the loop ------------------------------------------------------------------------------------


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
) -> TrainResult:
    """Single-process training (the colocated topology with one rank); resumes from the last complete checkpoint."""
    torch.manual_seed(seed)
    config = drafter_config_for(target, drafter_cfg)
    drafter = DFlashDrafter(config).to(target.device)
    gamma = cfg.gamma or default_gamma(config.block_size)
    store = HiddenStateCache.build(hidden_cache_dir, target, samples, config.target_layer_ids)
    forward = compile_drafter(drafter, cfg.compile)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(samples) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs if max_steps is None else min(max_steps, steps_per_epoch * cfg.epochs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg.warmup_ratio))
    checkpoints = complete_checkpoints(checkpoint_dir)
    first = load_checkpoint(checkpoints[-1], drafter, optimizer, scheduler) if checkpoints else 0
    if first:
        log.info("resuming from %s (step %d of %d)", checkpoints[-1], first, total)
    elif metrics_path.exists():
        metrics_path.unlink()  # a fresh run: rows of an earlier, different run would mislead
    start, tokens_seen, loss_value, compile_cache = time.perf_counter(), 0, float("nan"), {}
    correct_sum = torch.zeros(config.block_size)
    counted_sum = torch.zeros(config.block_size)
    batches: dict[int, list[list[int]]] = {}
    with tqdm(total=total, initial=first, desc="training drafter", unit="step") as bar:
        for step in range(first, total):
            epoch, index = divmod(step, steps_per_epoch)
            if epoch not in batches:
                batches = {epoch: global_batches(len(samples), cfg.batch_size, seed, epoch)}
            indices = batches[epoch][index]
            batch = make_batch(
                samples, indices, [store[i] for i in indices], config, cfg.max_anchors, gamma, seed, epoch, cfg.sample_loss_positions
            )
            loss, correct, counted, grad_norm = train_step(forward, drafter, optimizer, target, batch, cfg)
            scheduler.step()
            tokens_seen += int(batch.input_ids.numel())
            loss_value = float(loss)
            correct_sum += correct.cpu()
            counted_sum += counted.cpu()
            elapsed = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", acc1=f"{float(correct[1] / counted[1].clamp(min=1)):.2f}", tok_s=f"{tokens_seen / elapsed:.0f}")
            done = step + 1
            if step == first and cfg.compile:
                compile_cache = log_compile_cache_hits(log)
            if done % cfg.log_every == 0 or done == total:
                acc = (correct_sum / counted_sum.clamp(min=1)).tolist()
                row = {"step": done, "epoch": epoch, "loss": loss_value, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_seen / elapsed}
                row.update({f"acc_{k}": acc[k] for k in range(1, config.block_size)})
                write_metrics_row(metrics_path, row)
                if tracker is not None:
                    tracker.log(row, step=done)
                correct_sum.zero_()
                counted_sum.zero_()
            if done % cfg.checkpoint_every == 0 and done < total:
                save_checkpoint(checkpoint_dir, done, drafter, optimizer, scheduler)
    drafter.save_pretrained(out_dir)
    elapsed = time.perf_counter() - start
    return TrainResult(
        steps=total,
        resumed_from=first,
        final_loss=loss_value,
        seconds=elapsed,
        tokens_per_second=tokens_seen / max(elapsed, 1e-9),
        compile_cache=compile_cache,
    )


def check_preflight(paths: list[Path], topology) -> dict[str, dict]:
    """Training refuses to start unless every preflight verdict says ok and the race verdict says the
    configured execution is safe. Returns the verdicts by stage (warmups by device)."""
    from dflash.preflight.race import execution_is_safe
    from dflash.preflight.verdict import read_verdict

    verdicts = {}
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist: run the preflight stages first (snakemake runs them before train)")
        stage = json.loads(Path(path).read_text()).get("stage", "?")
        verdict = read_verdict(path, stage) | {"path": str(path)}
        verdicts[f"warmup_cache/{verdict['device']}" if stage == "warmup_cache" else stage] = verdict
    if "repro_fx_race" in verdicts:
        # One process per device, one thread each calling compiled code: the FX flag is never shared.
        safe, reason = execution_is_safe(verdicts["repro_fx_race"], topology, threads_per_process=1)
        if not safe:
            raise RuntimeError(f"training would hit the torch.compile FX-tracing race: {reason}")
        log.info("repro_fx_race: %s", reason)
    return verdicts


def device_name(kind: str, local_rank: int = 0) -> str:
    """The device wildcard of the preflight stages: ``cpu`` or ``cuda<local rank>``."""
    return "cpu" if kind == "cpu" else f"cuda{local_rank}"


def run_train_stage(sections: dict, args) -> TrainResult:
    """The ``train`` stage: drafter, metrics CSV, summary JSON under ``args.out_dir``; checkpoints under ``args.checkpoint_dir``."""
    from dflash.config import canonical_json, config_hash
    from dflash.data import read_samples
    from dflash.target import load_from_manifest
    from dflash.tracking import open_tracker

    verdicts = check_preflight(args.preflight, sections["topology"])
    if sections["train"].compile:
        warmup = verdicts.get(f"warmup_cache/{device_name(sections['topology'].device)}")
        if warmup is None:
            log.warning("no compile-cache warmup for this device: the first training step compiles cold")
        else:
            use_warm_cache(warmup["path"])
    target = load_from_manifest(args.target_manifest)
    samples = read_samples(args.samples)
    run_config = {key: json.loads(canonical_json(value)) for key, value in sections.items()} | {"seed": args.seed}
    fingerprint = config_hash(run_config | {"samples": HiddenStateCache.cache_key(samples, target.source, [])})
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tracking = sections["tracking"]
    tracker = open_tracker(tracking.wandb_mode, tracking.project, fingerprint, out_dir.parent / "wandb", run_config)
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
    )
    summary = dataclasses.asdict(result) | {"fingerprint": fingerprint, "samples": len(samples)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if tracker is not None:
        tracker.summary(summary)
        tracker.finish()
    log.info("trained %d steps in %.0f s (%.0f tokens/s); drafter at %s", result.steps, result.seconds, result.tokens_per_second, out_dir / "drafter")
    return result
