"""What training costs, estimated from shapes alone: FLOPs per sample on either side of a split topology,
and the peak memory of a drafter rank.

Estimates, not measurements: matrix products count 2 FLOPs per multiply-add, a training product 3 times
its forward (forward, input gradient, weight gradient; 2 for the frozen head). ``benchmarks/train_throughput.py``
prints the balance they imply for a config; ``warmup_cache`` compares the memory estimate with the device's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflash.config import TrainConfig
from dflash.objective import decay_weights, default_gamma


@dataclass(frozen=True)
class Shape:
    """The dimensions of a transformer stack that its cost depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> Shape:
        """From a transformers config or a ``DFlashConfig``."""
        heads = config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
        )

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate


def target_flops(target: Shape, tokens: int) -> float:
    """One teacher-forced pass over a sample of ``tokens``: every layer, causal attention, and the LM head (greedy labels)."""
    linear = 2 * tokens * (target.layers * target.layer_params + target.hidden * target.vocab)
    attention = 2 * target.layers * tokens * tokens * target.heads * target.head_dim  # QK^T and AV, half of the square
    return linear + attention


def drafter_flops(drafter: Shape, features: int, tokens: int, cfg: TrainConfig, block_size: int, vocab: int | None = None) -> float:
    """One sample's share of a training step: ``cfg.max_anchors`` blocks of ``block_size`` queries over ``tokens`` of
    context, the fused context (``features`` wide), and the LM head over the loss positions (``vocab``: the draft vocabulary)."""
    queries = cfg.max_anchors * block_size
    # Rows through q, o and the MLP over all layers: the last layer has none at the anchors (its output there feeds nothing).
    rows = (drafter.layers - 1) * queries + cfg.max_anchors * (block_size - 1)
    key_value = 2 * drafter.hidden * drafter.kv_heads * drafter.head_dim  # the k and v projections' parameters
    fusion = 3 * 2 * tokens * features * drafter.hidden
    layers = 3 * 2 * (rows * (drafter.layer_params - key_value) + drafter.layers * (queries + tokens) * key_value)
    attention = 3 * 2 * 2 * rows * (tokens / 2 + block_size) * drafter.heads * drafter.head_dim
    # Weighted positions per block: the decay's sum (sampled loss positions keep about that many).
    kept = float(decay_weights(block_size, cfg.gamma or default_gamma(block_size)).sum()) if cfg.sample_loss_positions else block_size - 1
    head = 2 * 2 * cfg.max_anchors * kept * drafter.hidden * (vocab or drafter.vocab)
    return fusion + layers + attention + head


def balanced_target_ranks(world: int, target_per_sample: float, drafter_per_sample: float) -> int:
    """The target ranks of a split of ``world`` ranks whose two sides take the same time per step (at equal speed)."""
    share = target_per_sample / (target_per_sample + drafter_per_sample)
    return min(world - 1, max(1, round(world * share)))


@dataclass(frozen=True)
class Memory:
    """Peak bytes of one drafter rank, by part."""

    target: float  # the target's weights this rank holds (the embedding and head only, on a split drafter rank)
    training_state: float  # fp32 weights, gradients and Adam's two moments of the drafter (sharded under FSDP)
    activations: float  # saved for the backward: block queries through every layer, the context, the features
    head: float  # one chunk of LM-head logits and its softmax, in fp32

    @property
    def total(self) -> float:
        return sum(asdict(self).values())


def target_weights(target: Shape, bytes_per_weight: int, holds_layers: bool) -> float:
    """The bytes of the target a drafter rank holds: its embedding and head, and its layers where it computes them."""
    embedding_and_head = 2 * target.hidden * target.vocab
    return bytes_per_weight * (embedding_and_head + (target.layers * target.layer_params if holds_layers else 0))


def drafter_rank_memory(drafter: Shape, features: int, rows: int, tokens: int, cfg: TrainConfig, block_size: int, target: float, shards: int = 1) -> Memory:
    """Peak memory of a drafter rank training ``rows`` samples of ``tokens`` (padded) per step, holding ``target``
    bytes of the target (``target_weights``) and 1/``shards`` of the drafter's training state."""
    params = features * drafter.hidden + drafter.layers * drafter.layer_params
    training_state = 16 * params / shards
    queries = rows * cfg.max_anchors * block_size
    activation_bytes = 2 if cfg.precision != "fp32" else 4
    per_query = drafter.hidden * 10 + drafter.intermediate * 3 + drafter.heads * drafter.head_dim * 2  # norms, projections, MLP, attention out
    layers_kept = 1 if cfg.activation_checkpointing else drafter.layers
    saved = activation_bytes * (queries * per_query * layers_kept + queries * drafter.hidden * drafter.layers)
    context = activation_bytes * rows * tokens * (drafter.hidden * 2 + drafter.layers * 2 * drafter.kv_heads * drafter.head_dim)
    inputs = 4 * rows * tokens * features  # the features arrive in fp32
    head = 4 * 2 * min(cfg.head_chunk, queries) * drafter.vocab
    return Memory(target=target, training_state=training_state, activations=saved + context + inputs, head=head)
