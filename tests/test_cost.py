"""The cost model: FLOPs and memory from shapes, with answers computed by hand."""

from __future__ import annotations

import pytest

from dflash.config import TrainConfig
from dflash.cost import Shape, balanced_target_ranks, drafter_flops, drafter_rank_memory, target_flops, target_weights

# hidden 4, intermediate 8, 1 layer, 2 heads of 2, 1 KV head, vocabulary 10.
SHAPE = Shape(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)


def test_layer_parameters_and_the_targets_pass():
    # Attention: q 4x4, k and v 4x2 each, o 4x4 = 48; MLP: 3 x 4x8 = 96.
    assert SHAPE.layer_params == 144
    # 3 tokens: 2 x 3 x (144 + 4x10 head) = 1104, and attention 2 x 1 layer x 3 x 3 x 2 heads x 2 = 72.
    assert target_flops(SHAPE, 3) == 1104 + 72


def test_the_drafters_step():
    cfg = TrainConfig(max_anchors=2, sample_loss_positions=False)
    # 2 anchors x block 2 = 4 block rows, of which the last (here the only) layer queries the 2 drafted ones;
    # 3 context tokens, features 8 wide: fusion 3x2x3x8x4 = 576; layer: q, o and MLP (144 - 16 parameters) over
    # 2 rows 3x2x2x128 = 1536, k and v (2x4x2 = 16) over 4 block rows and 3 context tokens 3x2x7x16 = 672;
    # attention 3x2x2x2x(1.5 + 2)x2x2 = 336; head 2x2x2 anchors x 1 position x 4 x 10 = 320.
    assert drafter_flops(SHAPE, 8, 3, cfg, block_size=2) == pytest.approx(576 + 1536 + 672 + 336 + 320)
    assert drafter_flops(SHAPE, 8, 3, cfg, block_size=2, vocab=5) == pytest.approx(576 + 1536 + 672 + 336 + 160)
    # Two layers: the first queries all 4 block rows, 3x2x4x128 = 3072 and attention 672 more; k and v twice.
    deep = Shape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)
    assert drafter_flops(deep, 8, 3, cfg, block_size=2) == pytest.approx(576 + 1536 + 3072 + 2 * 672 + 336 + 672 + 320)


def test_a_balanced_split():
    assert balanced_target_ranks(8, target_per_sample=24.0, drafter_per_sample=70.0) == 2  # 8 x 0.255
    assert balanced_target_ranks(8, target_per_sample=70.0, drafter_per_sample=24.0) == 6
    assert balanced_target_ranks(8, target_per_sample=1.0, drafter_per_sample=1000.0) == 1  # at least one of each side
    assert balanced_target_ranks(8, target_per_sample=1000.0, drafter_per_sample=1.0) == 7


def test_memory_parts_and_what_reduces_them():
    cfg = TrainConfig(max_anchors=2, precision="fp32", head_chunk=3)
    bf16_head = target_weights(SHAPE, 2, holds_layers=False)
    assert bf16_head == 2 * (2 * 4 * 10)  # embedding and head only, in bf16
    assert target_weights(SHAPE, 2, holds_layers=True) == bf16_head + 2 * 144
    memory = drafter_rank_memory(SHAPE, 8, rows=2, tokens=3, cfg=cfg, block_size=2, target=bf16_head)
    assert memory.target == bf16_head
    assert memory.training_state == 16 * (8 * 4 + 144)
    assert memory.head == 4 * 2 * 3 * 10
    assert memory.total == memory.target + memory.training_state + memory.activations + memory.head
    sharded = drafter_rank_memory(SHAPE, 8, 2, 3, cfg, 2, target=bf16_head, shards=4)
    assert sharded.training_state == memory.training_state / 4
    deep = Shape(hidden=4, intermediate=8, layers=6, heads=2, kv_heads=1, head_dim=2, vocab=10)
    kept = drafter_rank_memory(deep, 8, 2, 3, cfg, 2, bf16_head).activations
    checkpointed = drafter_rank_memory(deep, 8, 2, 3, TrainConfig(max_anchors=2, precision="fp32", activation_checkpointing=True), 2, bf16_head).activations
    assert checkpointed < kept
