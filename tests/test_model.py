"""The drafter: layer selection, the training mask (both kernels), training/inference agreement, the checkpoint format."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn.attention.flex_attention import create_mask

from dflash.attention import attend, build_training_mask, dflash_mask_mod
from dflash.config import DrafterConfig
from dflash.model import DFlashConfig, DFlashDrafter, DraftCache, target_layer_ids

# -- target_layer_ids -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, num_features, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B, the authors' checkpoints
        (30, 5, [1, 8, 14, 20, 27]),  # 7.5 -> 8 and 20.5 -> 20: Python's round (half to even)
        (36, 1, [18]),
        (7, 1, [3]),
        (6, 3, [1, 2, 3]),
        (28, 2, [1, 25]),
        (4, 2, [1, 1]),
    ],
)
def test_target_layer_ids_reference_rule(num_layers, num_features, expected):
    assert target_layer_ids(num_layers, num_features) == expected


def test_target_layer_ids_rejects_impossible_requests():
    with pytest.raises(ValueError, match="at least 1"):
        target_layer_ids(36, 0)
    with pytest.raises(ValueError, match="too shallow"):
        target_layer_ids(3, 2)


def test_for_target_takes_the_targets_shape(qwen3_target, llama_target):
    for target in (qwen3_target, llama_target):
        config = DFlashConfig.for_target(target.config, DrafterConfig(num_context_features=3), mask_token_id=126)
        assert config.target_layer_ids == [1, 2, 3]
        assert (config.hidden_size, config.vocab_size, config.num_target_layers) == (64, 128, 6)
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
        assert config.rope_theta == target.config.rope_parameters["rope_theta"]


def test_config_validation_names_the_problem(tiny_drafter_config):
    import dataclasses

    with pytest.raises(ValueError, match="mask_token_id 128 is outside"):
        dataclasses.replace(tiny_drafter_config, mask_token_id=128)
    with pytest.raises(ValueError, match="target_layer_ids"):
        dataclasses.replace(tiny_drafter_config, target_layer_ids=[1, 6])
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        dataclasses.replace(tiny_drafter_config, num_key_value_heads=3)


# -- the training mask ------------------------------------------------------------------------

# A hand-made batch: context of S=5 positions, blocks of B=2, two anchor slots per row.
# Row 0: anchors 2 and 4, both valid. Row 1: anchor 1 valid, the second slot is padding.
# Keys are [context 0..4 | block 0 (keys 5, 6) | block 1 (keys 7, 8)].
MASK_S, MASK_B = 5, 2
MASK_ANCHORS = torch.tensor([[2, 4], [1, 0]])
MASK_VALID = torch.tensor([[True, True], [True, False]])
#                 context        block0  block1
EXPECTED_MASK = torch.tensor(
    [
        [  # row 0
            [1, 1, 0, 0, 0, 1, 1, 0, 0],  # block 0 (anchor 2): context 0,1 and its own block
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],  # block 1 (anchor 4): context 0..3 and its own block
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
        ],
        [  # row 1
            [1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0 (anchor 1): context 0 and its own block
            [1, 0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0, 0],  # padding block: sees nothing
            [0, 0, 0, 0, 0, 0, 0, 0, 0],
        ],
    ],
    dtype=torch.bool,
)


def test_mask_mod_semantics_on_a_hand_made_case():
    mod = dflash_mask_mod(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B)
    dense = create_mask(mod, 2, 1, 4, MASK_S + 4, device="cpu")[:, 0]
    assert torch.equal(dense, EXPECTED_MASK)


def test_sdpa_mask_opens_only_empty_rows():
    mask = build_training_mask(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B, backend="sdpa")
    empty = ~EXPECTED_MASK.any(-1)
    assert torch.equal(mask.empty_rows[:, 0, :, 0], empty)
    assert torch.equal(mask.dense[:, 0], EXPECTED_MASK | empty[..., None])


def test_the_drafted_mask_is_the_rows_of_each_blocks_drafted_positions():
    """B=2: each block's query 1 (rows 1 and 3 of the full mask) is all the last layer asks."""
    mask = build_training_mask(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B, backend="sdpa")
    drafted = EXPECTED_MASK[:, [1, 3]]
    assert torch.equal(mask.drafted.empty_rows[:, 0, :, 0], ~drafted.any(-1))
    assert torch.equal(mask.drafted.dense[:, 0], drafted | ~drafted.any(-1, keepdim=True))
    mod = dflash_mask_mod(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B, queries_per_block=MASK_B - 1)
    assert torch.equal(create_mask(mod, 2, 1, 2, MASK_S + 4, device="cpu")[:, 0], drafted)


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_the_drafted_rows_alone_equal_every_row_computed_then_the_anchors_dropped(tiny_drafter_config, backend):
    """The last layer computes no output at the anchors: what it gives the drafted positions is what computing every
    position would (two layers, so that the first still computes the anchors whose keys the last one reads)."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_drafter_config, num_hidden_layers=2)
    drafter = DFlashDrafter(config).eval()
    anchors, valid, features, blocks, ctx_pos, blk_pos = _training_inputs(config)
    mask = build_training_mask(anchors, valid, features.shape[1], config.block_size, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drafted = drafter(features, blocks, ctx_pos, blk_pos, mask=mask)
        context = drafter.hidden_norm(drafter.fc(features))
        rope = drafter.rotary(blk_pos, torch.float32), drafter.rotary(ctx_pos, torch.float32)
        every = blocks
        for i, layer in enumerate(drafter.layers):
            every = layer(every, context, *rope, mask, None, i)
        every = drafter.norm(every)
    assert drafted.shape == (2, 3 * (config.block_size - 1), 64)
    torch.testing.assert_close(drafted, every.view(2, 3, config.block_size, 64)[:, :, 1:].flatten(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_kernels_apply_exactly_the_expected_mask(backend):
    """Read the mask back out of the kernel: with equal scores, a query averages the one-hot values of the keys it sees."""
    keys = MASK_S + 4
    head_dim = 16
    q = torch.zeros(2, 2, 4, head_dim)
    k = torch.zeros(2, 2, keys, head_dim)
    v = torch.eye(keys, head_dim).expand(2, 2, keys, head_dim).contiguous()
    mask = build_training_mask(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex on CPU warns that it runs unfused
        out = attend(q, k, v, mask, scale=1.0)[..., :keys]
    counts = EXPECTED_MASK.sum(-1, keepdim=True).clamp(min=1)
    expected = (EXPECTED_MASK.float() / counts)[:, None].expand_as(out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # Padding queries give exactly zero, not NaN and not an average over everything.
    assert torch.equal(out[1, :, 2:], torch.zeros_like(out[1, :, 2:]))


def _training_inputs(config: DFlashConfig, seed: int = 0):
    """Two rows of S=12 context positions, three anchors each (row 1 has one padding slot), blocks of 4."""
    generator = torch.Generator().manual_seed(seed)
    seq, block = 12, config.block_size
    anchors = torch.tensor([[0, 5, 8], [3, 6, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    features = torch.randn(2, seq, len(config.target_layer_ids) * config.hidden_size, generator=generator)
    block_embeddings = torch.randn(2, anchors.shape[1] * block, config.hidden_size, generator=generator)
    context_positions = torch.arange(seq).expand(2, seq)
    block_positions = (anchors[:, :, None] + torch.arange(block)).flatten(1)
    return anchors, valid, features, block_embeddings, context_positions, block_positions


def test_flex_and_sdpa_give_the_same_drafter_output(tiny_drafter_config):
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config).eval()
    anchors, valid, features, blocks, ctx_pos, blk_pos = _training_inputs(tiny_drafter_config)
    outputs = {}
    for backend in ("flex", "sdpa"):
        mask = build_training_mask(anchors, valid, features.shape[1], tiny_drafter_config.block_size, backend=backend)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs[backend] = drafter(features, blocks, ctx_pos, blk_pos, mask=mask)
    assert torch.isfinite(outputs["sdpa"]).all()
    torch.testing.assert_close(outputs["flex"], outputs["sdpa"], rtol=1e-5, atol=1e-5)
    # The anchor at 0 sees no context at all, only its own block: still finite and equal in both.
    assert outputs["sdpa"].shape == (2, 3 * (tiny_drafter_config.block_size - 1), 64)
    assert torch.isfinite(outputs["flex"][0, :3]).all()


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_under_bf16_autocast_attention_gets_one_dtype(tiny_drafter_config, backend, monkeypatch):
    """The norms' fp32 weights would make q and k fp32 beside a bf16 v: torch releases before pytorch#165468's fix raise."""
    import dflash.model

    seen = []
    original = dflash.model.attend
    monkeypatch.setattr(dflash.model, "attend", lambda q, k, v, *a, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or original(q, k, v, *a, **kw))
    drafter = DFlashDrafter(tiny_drafter_config).eval()
    anchors, valid, features, blocks, ctx_pos, blk_pos = _training_inputs(tiny_drafter_config)
    mask = build_training_mask(anchors, valid, features.shape[1], tiny_drafter_config.block_size, backend=backend)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = drafter(features, blocks, ctx_pos, blk_pos, mask=mask)
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen), seen
    assert torch.isfinite(out.float()).all()


def test_sdpa_backward_is_finite_and_padding_blocks_get_no_gradient(tiny_drafter_config):
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config)
    anchors, valid, features, blocks, ctx_pos, blk_pos = _training_inputs(tiny_drafter_config)
    features.requires_grad_(True)
    mask = build_training_mask(anchors, valid, features.shape[1], tiny_drafter_config.block_size, backend="sdpa")
    out = drafter(features, blocks, ctx_pos, blk_pos, mask=mask)
    drafted = tiny_drafter_config.block_size - 1  # rows per block in the output
    # Loss on the padding block of row 1 only: it saw nothing, so no gradient reaches the context.
    out[1, 2 * drafted :].square().sum().backward(retain_graph=True)
    assert torch.equal(features.grad, torch.zeros_like(features.grad))
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)
    # Loss on row 0's block at anchor 5: gradient reaches context positions 0..4 only.
    features.grad = None
    out[0, drafted : 2 * drafted].square().sum().backward()
    touched = features.grad[0].abs().sum(-1) > 0
    assert touched.tolist() == [True] * 5 + [False] * 7
    assert features.grad[1].abs().sum() == 0


def test_rotary_angles_stay_fp32_in_a_drafter_cast_to_bf16(tiny_drafter_config):
    """Far apart positions keep their angles when the drafter decodes in bf16: cos and sin are the fp32 drafter's,
    rounded once at the end (frequencies rounded to bf16 would turn position 3000's angles by up to a few radians)."""
    drafter = DFlashDrafter(tiny_drafter_config)
    positions = torch.tensor([[0, 7, 300, 3000]])
    exact = drafter.rotary(positions, torch.bfloat16)
    half = drafter.to(torch.bfloat16).rotary(positions, torch.bfloat16)
    assert all(torch.equal(h, e) for h, e in zip(half, exact))


def test_training_block_equals_inference_with_cache(tiny_drafter_config):
    """A block trained at anchor a sees what the drafter sees at inference with positions 0..a-1 in its cache."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config).eval()
    block = tiny_drafter_config.block_size
    anchors, valid, features, blocks, ctx_pos, blk_pos = _training_inputs(tiny_drafter_config)
    mask = build_training_mask(anchors, valid, features.shape[1], block, backend="sdpa")
    with torch.no_grad():
        trained = drafter(features, blocks, ctx_pos, blk_pos, mask=mask)
        for slot, split in ((1, 2), (2, 3)):  # row 0: anchor 5 (context fed as 0..1 then 2..4), anchor 8 (0..2 then 3..7)
            anchor = int(anchors[0, slot])
            cache = DraftCache()
            # First chunk: an earlier draft step, with some other block (never cached).
            drafter(features[:1, :split], torch.randn(1, block, 64), ctx_pos[:1, :split], torch.arange(split, split + block)[None], cache=cache)
            assert cache.length == split
            inferred = drafter(
                features[:1, split:anchor],
                blocks[:1, slot * block : (slot + 1) * block],
                ctx_pos[:1, split:anchor],
                blk_pos[:1, slot * block : (slot + 1) * block],
                mask=None,
                cache=cache,
            )
            assert cache.length == anchor
            assert len(cache.keys) == tiny_drafter_config.num_hidden_layers
            torch.testing.assert_close(inferred[0], trained[0, slot * (block - 1) : (slot + 1) * (block - 1)], rtol=1e-5, atol=1e-5)


def test_block_output_ignores_context_at_and_after_its_anchor(tiny_drafter_config):
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config).eval()
    anchors, valid, features, blocks, ctx_pos, blk_pos = _training_inputs(tiny_drafter_config)
    mask = build_training_mask(anchors, valid, features.shape[1], 4, backend="sdpa")
    changed = features.clone()
    changed[0, 5:] += 10.0  # positions at and after anchor 5 of row 0
    with torch.no_grad():
        before = drafter(features, blocks, ctx_pos, blk_pos, mask=mask)
        after = drafter(changed, blocks, ctx_pos, blk_pos, mask=mask)
    assert torch.equal(before[0, :6], after[0, :6])  # blocks at anchors 0 and 5 (3 drafted rows each): unchanged
    assert not torch.allclose(before[0, 6:], after[0, 6:])  # the block at anchor 8 sees 5..7
    assert torch.equal(before[1], after[1])  # the other row never sees row 0


# -- the checkpoint format --------------------------------------------------------------------

# The key set of the authors' published config.json (z-lab/Qwen3-4B-DFlash-b16, z-lab/Qwen3-8B-DFlash-b16).
REFERENCE_CONFIG_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "bos_token_id",
    "dflash_config", "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range",
    "intermediate_size", "layer_types", "max_position_embeddings", "max_window_layers", "model_type",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers", "rms_norm_eps",
    "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size",
}  # fmt: skip


def reference_weight_shapes(layers: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, features: int) -> dict:
    shapes = {"fc.weight": (hidden, features * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


@pytest.fixture
def saved_drafter(tmp_path, tiny_drafter_config):
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config).eval()
    with torch.no_grad():  # make the norms distinguishable from their ones-initialisation
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    directory = drafter.save_pretrained(tmp_path / "drafter")
    return drafter, directory


def test_saved_config_is_the_reference_config(saved_drafter):
    _, directory = saved_drafter
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]  # no temp files left
    data = json.loads((directory / "config.json").read_text())
    assert set(data) == REFERENCE_CONFIG_KEYS
    assert data["architectures"] == ["DFlashDraftModel"]
    assert data["model_type"] == "qwen3"
    assert data["dflash_config"] == {"mask_token_id": 126, "target_layer_ids": [1, 2, 3]}
    assert (data["block_size"], data["num_target_layers"], data["num_hidden_layers"]) == (4, 6, 2)
    assert (data["hidden_size"], data["intermediate_size"], data["vocab_size"]) == (64, 128, 128)
    assert (data["num_attention_heads"], data["num_key_value_heads"], data["head_dim"]) == (4, 2, 16)
    assert data["layer_types"] == ["full_attention", "full_attention"]
    assert data["tie_word_embeddings"] is False and data["attention_bias"] is False
    assert data["rope_theta"] == 1_000_000.0 and data["rms_norm_eps"] == 1e-6


def test_saved_weights_are_exactly_the_reference_tensors(saved_drafter):
    _, directory = saved_drafter
    state = load_file(str(directory / "model.safetensors"))
    expected = reference_weight_shapes(layers=2, hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, features=3)
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    assert all(t.dtype == torch.float32 for t in state.values())


def test_round_trip_is_exact(saved_drafter, tiny_drafter_config):
    drafter, directory = saved_drafter
    loaded = DFlashDrafter.from_pretrained(directory)
    # config.json records the dtype the weights were stored in (fp32 here).
    assert loaded.config == dataclasses.replace(tiny_drafter_config, dtype="float32")
    original, reloaded = drafter.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    assert all(torch.equal(original[k], reloaded[k]) for k in original)
    anchors, valid, features, blocks, ctx_pos, blk_pos = _training_inputs(tiny_drafter_config)
    mask = build_training_mask(anchors, valid, features.shape[1], 4, backend="sdpa")
    with torch.no_grad():
        assert torch.equal(drafter(features, blocks, ctx_pos, blk_pos, mask=mask), loaded(features, blocks, ctx_pos, blk_pos, mask=mask))
    as_bf16 = DFlashDrafter.from_pretrained(directory, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in as_bf16.parameters())


def _edit_config(directory, edit):
    path = directory / "config.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_block_size_is_read_from_dflash_config(saved_drafter):
    _, directory = saved_drafter

    def nested_only(data):
        data["dflash_config"]["block_size"] = 8
        del data["block_size"]

    _edit_config(directory, nested_only)
    assert DFlashDrafter.from_pretrained(directory).block_size == 8

    def both(data):  # both present: dflash_config wins, as in the authors' loader
        data["block_size"] = 16
        data["dflash_config"]["block_size"] = 10

    _edit_config(directory, both)
    assert DFlashDrafter.from_pretrained(directory).block_size == 10


def test_missing_files_are_named(saved_drafter):
    _, directory = saved_drafter
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors does not exist"):
        DFlashDrafter.from_pretrained(directory)
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        DFlashDrafter.from_pretrained(directory)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DFlashDrafter.from_pretrained(directory / "nowhere")


def test_bad_json_is_named(saved_drafter):
    _, directory = saved_drafter
    (directory / "config.json").write_text('{"architectures": ["DFlashDraftModel"],')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        DFlashDrafter.from_pretrained(directory)


def test_wrong_architecture_is_named(saved_drafter):
    _, directory = saved_drafter
    _edit_config(directory, lambda d: d.update(architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(ValueError, match=r"architectures=\['Qwen3ForCausalLM'\] is not a DFlash drafter"):
        DFlashDrafter.from_pretrained(directory)


def test_missing_config_field_is_named(saved_drafter):
    _, directory = saved_drafter
    _edit_config(directory, lambda d: d["dflash_config"].pop("mask_token_id"))
    with pytest.raises(ValueError, match="dflash_config.mask_token_id"):
        DFlashDrafter.from_pretrained(directory)


def test_weights_with_missing_or_extra_tensors_are_named(saved_drafter):
    _, directory = saved_drafter
    path = directory / "model.safetensors"
    state = load_file(str(path))
    missing = {k: v for k, v in state.items() if k != "layers.1.self_attn.k_norm.weight"}
    save_file(missing, str(path))
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.k_norm.weight'\], unexpected \[\]"):
        DFlashDrafter.from_pretrained(directory)
    save_file({**state, "lm_head.weight": torch.zeros(128, 64)}, str(path))
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['lm_head.weight'\]"):
        DFlashDrafter.from_pretrained(directory)
    save_file({**state, "fc.weight": torch.zeros(64, 128)}, str(path))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 128\), config.json implies \(64, 192\)"):
        DFlashDrafter.from_pretrained(directory)


def test_flex_kernels_are_wrapped_once_by_mask_building_never_inside_a_trace():
    """torch.compile called inside a Dynamo trace returns the raw function: the compiled kernels are made once, by
    build_training_mask (which never runs traced), and a mask carries its kernel to attend."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.attention import compiled_flex_kernels

    first, second = compiled_flex_kernels(), compiled_flex_kernels()
    assert first is second and all(hasattr(kernel, "_torchdynamo_orig_callable") for kernel in first)
    mask = build_training_mask(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), 8, 4, "flex")
    assert mask.kernel is flex_attention  # the CPU runs flex eagerly (forward only); CUDA gets first[1]


def test_activation_checkpointing_gives_the_same_gradients(tiny_drafter_config):
    """Recomputing each layer in the backward (train.activation_checkpointing) changes memory, not the result."""
    from dflash.config import TrainConfig
    from dflash.preflight.synthetic import synthetic_batch
    from dflash.step import drafter_loss, training_drafter

    cfg = TrainConfig(max_anchors=3, activation_checkpointing=True)
    batch = synthetic_batch(tiny_drafter_config, [30, 24], cfg)
    head = torch.randn(tiny_drafter_config.vocab_size, tiny_drafter_config.hidden_size)

    class Target:  # the frozen pieces drafter_loss reads
        device = torch.device("cpu")
        embed = torch.nn.Embedding(tiny_drafter_config.vocab_size, tiny_drafter_config.hidden_size)
        lm_head = torch.nn.Linear(tiny_drafter_config.hidden_size, tiny_drafter_config.vocab_size, bias=False)

    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        drafter = training_drafter(tiny_drafter_config, dataclasses.replace(cfg, activation_checkpointing=checkpointing), torch.device("cpu"))
        assert drafter.activation_checkpointing is checkpointing
        loss = drafter_loss(drafter, Target, batch, "sdpa", 64, head)[0]
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in drafter.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for plain, recomputed in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(plain, recomputed, rtol=1e-5, atol=1e-7)


def test_the_loss_reads_each_labelled_block_position_from_its_drafted_row(tiny_drafter_config):
    """drafter_loss maps block row (block, k) to drafted row (block, k - 1): the same loss as a weighted cross-entropy
    over the drafted rows laid back into their blocks (anchors padded), computed by hand."""
    from dflash.config import TrainConfig
    from dflash.preflight.synthetic import synthetic_batch
    from dflash.step import drafter_hidden, drafter_loss

    cfg = TrainConfig(max_anchors=3)
    batch = synthetic_batch(tiny_drafter_config, [30, 24], cfg)
    head = torch.randn(tiny_drafter_config.vocab_size, tiny_drafter_config.hidden_size)

    class Target:  # the frozen pieces drafter_loss reads
        device = torch.device("cpu")
        embed = torch.nn.Embedding(tiny_drafter_config.vocab_size, tiny_drafter_config.hidden_size)

    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config)
    with torch.no_grad():
        loss = drafter_loss(drafter, Target, batch, "sdpa", 64, head)[0]
        drafted = drafter_hidden(drafter, Target, batch, "sdpa")
    block = tiny_drafter_config.block_size
    rows = drafted.unflatten(1, (-1, block - 1))
    laid = torch.cat([torch.zeros_like(rows[:, :, :1]), rows], dim=2).flatten(1, 2)  # [b, A*B, H], anchors zero
    weights, labels = batch.blocks.weights.flatten(), batch.blocks.labels.flatten()
    assert weights.view(-1, block)[:, 0].eq(0).all() and weights.gt(0).sum() > 0
    per_row = torch.nn.functional.cross_entropy(laid.flatten(0, 1) @ head.t(), labels.clamp(min=0), reduction="none")
    expected = (per_row * weights).sum() / batch.weight_total
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
