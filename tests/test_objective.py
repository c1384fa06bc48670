"""The training objective on hand-made cases with answers written out in full."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.objective import (
    build_blocks,
    decay_weights,
    decayed_loss,
    default_gamma,
    dpace_weights,
    loss_normaliser,
    position_accuracy,
    sample_anchors,
)

# -- anchors ----------------------------------------------------------------------------------

#                           0  1  2  3  4  5  6  7
LOSS_MASK = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]])
# A position may anchor when it and the next one are in the loss mask:
# 1 (1,2), 2 (2,3) and 5 (5,6); not 3 (4 is out), not 6 (7 is out), never the last position.
CANDIDATES = [1, 2, 5]


def test_anchors_are_exactly_the_candidates_when_they_fit():
    anchors, valid = sample_anchors(LOSS_MASK, max_anchors=3, generator=torch.Generator().manual_seed(0))
    assert anchors.tolist() == [CANDIDATES]
    assert valid.tolist() == [[True, True, True]]
    assert anchors.dtype == torch.long and valid.dtype == torch.bool


def test_too_few_candidates_are_padded_with_invalid_zeros():
    anchors, valid = sample_anchors(LOSS_MASK, max_anchors=5, generator=torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[1, 2, 5, 0, 0]]
    assert valid.tolist() == [[True, True, True, False, False]]
    # More slots than positions in the row.
    anchors, valid = sample_anchors(LOSS_MASK, max_anchors=10, generator=torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[1, 2, 5] + [0] * 7]
    assert valid.tolist() == [[True] * 3 + [False] * 7]


def test_rows_are_independent_and_a_row_without_candidates_is_all_padding():
    loss_mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1],  # candidates 0..4
            [1, 0, 1, 0, 1, 0],  # none: no two neighbours in the loss mask
            [0, 0, 0, 0, 1, 1],  # only 4
            [0, 0, 0, 0, 0, 0],  # none (an all-prompt row)
        ]
    )
    anchors, valid = sample_anchors(loss_mask, max_anchors=5, generator=torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[0, 1, 2, 3, 4], [0] * 5, [4, 0, 0, 0, 0], [0] * 5]
    assert valid.tolist() == [[True] * 5, [False] * 5, [True] + [False] * 4, [False] * 5]


def test_anchors_are_drawn_without_replacement_sorted_and_uniform():
    rows = 3000
    loss_mask = LOSS_MASK.expand(rows, -1)
    anchors, valid = sample_anchors(loss_mask, max_anchors=2, generator=torch.Generator().manual_seed(0))
    assert valid.all()
    assert (anchors[:, 0] < anchors[:, 1]).all()  # sorted and distinct
    pairs = {tuple(p) for p in anchors.tolist()}
    assert pairs == {(1, 2), (1, 5), (2, 5)}
    # Each candidate is in 2 of the 3 possible pairs: drawn in ~2/3 of the rows.
    for c in CANDIDATES:
        share = (anchors == c).any(1).float().mean().item()
        assert abs(share - 2 / 3) < 0.05, (c, share)


def test_anchors_are_reproducible_from_the_seed():
    loss_mask = torch.ones(4, 64, dtype=torch.long)
    first = sample_anchors(loss_mask, 8, generator=torch.Generator().manual_seed(123))
    again = sample_anchors(loss_mask, 8, generator=torch.Generator().manual_seed(123))
    other = sample_anchors(loss_mask, 8, generator=torch.Generator().manual_seed(124))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    # No position anchors twice in a row, and the last position never anchors.
    assert all(len(set(row)) == 8 for row in first[0].tolist())
    assert (first[0] <= 62).all()


def test_anchor_count_must_be_positive():
    with pytest.raises(ValueError, match="max_anchors must be at least 1"):
        sample_anchors(LOSS_MASK, 0)


# -- blocks -----------------------------------------------------------------------------------

MASK_ID = 99


def test_build_blocks_on_a_hand_made_case():
    #                             0   1   2   3   4   5
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1]])
    anchors = torch.tensor([[1, 3, 4, 0]])
    valid = torch.tensor([[True, True, True, False]])
    gamma = 2.0
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(3, gamma), mask_token_id=MASK_ID)

    d1 = 1.0  # exp(-(k-1)/gamma) at k=1
    d2 = math.exp(-1 / gamma)  # at k=2
    #                                  anchor 1            anchor 3            anchor 4            padding (anchor 0)
    assert blocks.input_ids.tolist() == [[11, MASK_ID, MASK_ID, 13, MASK_ID, MASK_ID, 14, MASK_ID, MASK_ID, 10, MASK_ID, MASK_ID]]
    assert blocks.positions.tolist() == [[1, 2, 3, 3, 4, 5, 4, 5, 6, 0, 1, 2]]
    assert blocks.labels.tolist() == [[11, 12, 13, 13, 14, 15, 14, 15, 0, 10, 11, 12]]
    expected_weights = torch.tensor(
        [
            [
                0.0, d1, d2,  # positions 2 and 3 in the loss mask
                0.0, 0.0, d2,  # position 4 is outside the loss mask
                0.0, d1, 0.0,  # position 6 is past the end of the row
                0.0, 0.0, 0.0,  # padding block
            ]
        ]
    )  # fmt: skip
    torch.testing.assert_close(blocks.weights, expected_weights, rtol=0, atol=1e-7)
    assert blocks.weights.flatten().nonzero().squeeze(1).tolist() == [1, 2, 5, 7]


def test_greedy_labels_follow_the_targets_continuation_until_the_text_leaves_it():
    """A reply the target did not write: position k predicts the target's greedy token after a+k-1, and trains
    only while the reply's tokens a+1..a+k-1 are the ones the target would have written."""
    #                              0   1   2   3   4   5   6   7
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    # The target's greedy next token after each position: it agrees with the text after 1 (12), 2 (13) and
    # 4 (15), writes 40 after 3 (the text has 14) and 41 after 5 (the text has 16).
    greedy = torch.tensor([[11, 12, 13, 40, 15, 41, 17, 0]])
    loss_mask = torch.ones(1, 8)
    anchors, valid = torch.tensor([[1, 4]]), torch.tensor([[True, True]])
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(4, 1e9), mask_token_id=MASK_ID, greedy=greedy)
    assert blocks.input_ids.tolist() == [[11, MASK_ID, MASK_ID, MASK_ID, 14, MASK_ID, MASK_ID, MASK_ID]]
    # Labels: greedy[a + k - 1] (position 0 never trains). Weights (no decay at gamma 1e9): after anchor 1 the text
    # agrees at 2 (12) and 3 (13), so position 3, which needs both, trains (label 40, the target's token after 3);
    # after anchor 4 it agrees at 5 (15), not at 6 (16, where the target writes 41): position 2 trains, 3 does not.
    assert blocks.labels.tolist() == [[11, 12, 13, 40, 40, 15, 41, 17]]
    assert blocks.weights.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]]
    # Text the target wrote itself: its greedy tokens are the next tokens, and the labels are the text's own.
    own = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(4, 1e9), MASK_ID, greedy=torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1))
    plain = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(4, 1e9), MASK_ID)
    assert torch.equal(own.labels, plain.labels) and torch.equal(own.weights, plain.weights)


def test_every_position_labels_train_each_position_on_the_targets_teacher_forced_token():
    """The same reply with ``greedy_path_only=False``: the labels are unchanged (the target's greedy token after
    a+k-1, the text as it stands), and every position in range and in the loss mask trains, past a disagreement too."""
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    greedy = torch.tensor([[11, 12, 13, 40, 15, 41, 17, 0]])
    anchors, valid = torch.tensor([[1, 4]]), torch.tensor([[True, True]])
    loss_mask = torch.ones(1, 8)
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(4, 1e9), MASK_ID, greedy=greedy, greedy_path_only=False)
    assert blocks.labels.tolist() == [[11, 12, 13, 40, 40, 15, 41, 17]]
    # After anchor 4, position 3 (text position 7) trains on 17, the target's token after 6, although the text left
    # the greedy path at 6 (16, where the target writes 41); on the greedy path alone it does not.
    assert blocks.weights.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]]
    on_path = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(4, 1e9), MASK_ID, greedy=greedy)
    assert on_path.weights.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]]
    # Outside the loss mask nothing trains either way.
    loss_mask[0, 7] = 0
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(4, 1e9), MASK_ID, greedy=greedy, greedy_path_only=False)
    assert blocks.weights.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]]


def test_the_loss_normaliser_is_the_weight_sum_or_the_count_of_weighted_positions():
    weights = torch.tensor([[0.0, 1.0, 0.5, 0.25, 0.0, 1.0, 0.0, 0.0]])
    assert loss_normaliser(weights, "weights").item() == pytest.approx(2.75)
    assert loss_normaliser(weights, "positions").item() == 4.0


def test_dpace_weighs_each_position_by_the_acceptance_that_rides_on_it():
    """Speculators' rule by hand, alpha 0.5. Block one trains positions 1..3 with confidences 0.8, 0.5, 0.2: smoothed
    0.9, 0.75, 0.6; their running products 0.9, 0.675, 0.405; each position weighs the sum of the products from
    itself on. Block two does not train position 2 (smoothed 1, weighed 0); the products run on past it."""
    confidence = torch.tensor([[1.0, 0.8, 0.5, 0.2], [1.0, 0.8, 0.3, 0.2]])
    trained = torch.tensor([[False, True, True, True], [False, True, False, True]])
    weights = dpace_weights(-confidence.log(), trained, alpha=0.5)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.98, 1.08, 0.405], [0.0, 1.44, 0.0, 0.54]]))
    # A drafter sure of every position (confidence 1) weighs position k by the trained positions from k on.
    torch.testing.assert_close(dpace_weights(torch.zeros(1, 4), torch.tensor([[False, True, True, True]]), 0.5), torch.tensor([[0.0, 3.0, 2.0, 1.0]]))


def test_block_weights_follow_the_recipes_decay():
    input_ids = torch.arange(40)[None]
    loss_mask = torch.ones(1, 40)
    anchors, valid = torch.tensor([[3]]), torch.tensor([[True]])
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, decay_weights(16, 7.0), mask_token_id=MASK_ID)
    expected = [0.0] + [math.exp(-(k - 1) / 7.0) for k in range(1, 16)]
    torch.testing.assert_close(blocks.weights[0], torch.tensor(expected), rtol=1e-6, atol=0)
    assert blocks.labels[0].tolist() == list(range(3, 19))  # block position k predicts the token at anchor + k
    assert blocks.positions[0].tolist() == list(range(3, 19))
    assert blocks.input_ids[0].tolist() == [3] + [MASK_ID] * 15


def test_default_gamma_matches_the_recipes():
    assert default_gamma(16) == 7.0
    assert default_gamma(10) == 5.0
    assert default_gamma(8) == 4.0
    assert 5.0 < default_gamma(12) < 7.0


# -- loss and accuracy ------------------------------------------------------------------------


def test_decayed_loss_is_the_weighted_mean_cross_entropy():
    logits = torch.tensor(
        [
            [0.0, 0.0],  # uniform: CE = ln 2 for either label
            [math.log(3.0), 0.0],  # p = (3/4, 1/4)
            [math.log(3.0), 0.0],
            [5.0, -5.0],  # weight 0: must not count
        ]
    )
    labels = torch.tensor([1, 0, 1, 1])
    weights = torch.tensor([1.0, 0.5, 0.25, 0.0])
    expected = (1.0 * math.log(2) + 0.5 * math.log(4 / 3) + 0.25 * math.log(4)) / 1.75
    loss = decayed_loss(logits, labels, weights)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # bf16 logits are promoted before the softmax.
    assert decayed_loss(logits.bfloat16(), labels, weights).item() == pytest.approx(expected, rel=1e-2)


def test_decayed_loss_gradient_reaches_only_weighted_rows():
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    decayed_loss(logits, torch.tensor([0, 1, 2, 3]), torch.tensor([0.0, 1.0, 0.0, 0.5])).backward()
    assert logits.grad[0].abs().sum() == 0 and logits.grad[2].abs().sum() == 0
    assert logits.grad[1].abs().sum() > 0 and logits.grad[3].abs().sum() > 0


def test_decayed_loss_refuses_a_batch_without_weight():
    with pytest.raises(ValueError, match="no position with positive loss weight"):
        decayed_loss(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), torch.zeros(3))


def test_position_accuracy_counts_per_block_position():
    # Two rows, two blocks each, block size 3: four blocks in all.
    predictions = torch.tensor([[5, 1, 2, 5, 1, 9], [5, 7, 2, 5, 1, 2]])
    labels = torch.tensor([[5, 1, 3, 5, 1, 2], [5, 1, 2, 5, 1, 2]])
    weights = torch.tensor([[0.0, 1.0, 0.8, 0.0, 1.0, 0.8], [0.0, 1.0, 0.8, 0.0, 1.0, 0.0]])
    correct, counted = position_accuracy(predictions, labels, weights, block_size=3)
    # Blocks: (row 0, block 0), (row 0, block 1), (row 1, block 0), (row 1, block 1).
    # Position 0 never counts (weight 0) although it always matches.
    # Position 1: counted in all 4 blocks; correct in 3 (row 1 block 0 predicted 7 for 1).
    # Position 2: counted in 3 (row 1 block 1 has weight 0); correct only in row 1 block 0 (2 != 3, 9 != 2).
    assert counted.tolist() == [0, 4, 3]
    assert correct.tolist() == [0, 3, 1]
