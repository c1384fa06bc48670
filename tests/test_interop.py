"""Interop with the DFlash authors' package (PyPI ``dflash==0.1.0``).

Their package and ours share the import name ``dflash``, so theirs is never
installed and never imported here: the wheel is fetched once with
``pip download --no-deps``, checked against its sha256, unpacked into a cache
directory, and imported only in a subprocess whose ``sys.path`` starts with
that directory. The subprocess loads what we saved with their
``DFlashDraftModel.from_pretrained``, runs their forward pass and their
``dflash_generate``, and writes the results to files that this test compares
with ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import EOS, MASK, build_drafter, build_target, qwen3_config, random_prompt
from safetensors.torch import load_file, save_file

from dflash.acquire import cache_root
from dflash.decoding.generate import speculative_generate
from dflash.model import DFlashDrafter, target_layer_ids

AUTHORS_REQUIREMENT = "dflash==0.1.0"
AUTHORS_WHEEL = "dflash-0.1.0-py3-none-any.whl"
AUTHORS_SHA256 = "b3fe38d9413efc30a952c8b38b34f1dcc696ba6d7b865acbf540a34cc53afaa2"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def authors_package() -> Path:
    """The authors' wheel, unpacked into ``$DFLASH_CACHE_DIR/authors-dflash-0.1.0`` (default ``~/.cache/dflash``); fetched once."""
    root = cache_root() / "authors-dflash-0.1.0"
    if (root / "dflash" / "model.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--timeout", "20", "--retries", "1",
               "-q", "-d", tmp, AUTHORS_REQUIREMENT]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(tmp) / AUTHORS_WHEEL
        if result.returncode != 0 or not wheel.is_file():
            why = " | ".join(result.stderr.strip().splitlines()[-2:])
            pytest.skip(f"cannot fetch {AUTHORS_REQUIREMENT} with pip (exit {result.returncode}): {why}")
        digest = _sha256(wheel)
        assert digest == AUTHORS_SHA256, f"{AUTHORS_WHEEL} has sha256 {digest}, expected {AUTHORS_SHA256}: the published wheel changed"
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".authors-dflash.", dir=root.parent))
        try:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(staging)
            staging.chmod(0o755)
            try:
                staging.rename(root)
            except OSError:  # another session unpacked it first
                if not (root / "dflash" / "model.py").is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


# Runs in a clean interpreter: the authors' package first on sys.path, ours nowhere.
AUTHORS_SCRIPT = r"""
import json, sys, time, warnings
from pathlib import Path

job = json.loads(Path(sys.argv[1]).read_text())
sys.path.insert(0, job["authors_dir"])
import torch
torch.set_num_threads(1)
import dflash
assert Path(dflash.__file__).resolve().parent.parent == Path(job["authors_dir"]).resolve(), dflash.__file__
import dflash.model as authors
from dflash.model import DFlashDraftModel, build_target_layer_ids, dflash_generate, extract_context_feature
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

# dflash_generate(return_stats=True) times with torch.cuda.synchronize(), which a CPU-only torch refuses;
# time without it (this only changes their timing helper, not decoding).
authors._cuda_time = time.perf_counter

out = {"dflash_file": dflash.__file__}
tensors = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["layer_ids"] = {f"{t},{k}": build_target_layer_ids(t, k) for t, k in job["layer_id_cases"]}

    fwd = job["forward"]
    model, info = DFlashDraftModel.from_pretrained(fwd["drafter"], dtype=torch.float32, output_loading_info=True)
    model.eval()
    target = AutoModelForCausalLM.from_pretrained(fwd["target"], dtype=torch.float32).eval()
    out["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
    out["drafter_attrs"] = {"block_size": model.block_size, "mask_token_id": model.mask_token_id,
                            "target_layer_ids": list(model.target_layer_ids)}
    inputs = load_file(fwd["inputs"])
    with torch.no_grad():
        hidden_states = target(inputs["context_ids"], output_hidden_states=True).hidden_states
        tensors["features"] = extract_context_feature(hidden_states, model.target_layer_ids)
        tensors["hidden"] = model(
            position_ids=inputs["position_ids"],
            noise_embedding=inputs["noise_embedding"],
            target_hidden=inputs["target_hidden"],
            past_key_values=None,
            use_cache=False,
        )
        tensors["logits"] = model.compute_logits(tensors["hidden"], target.get_output_embeddings())
    model.save_pretrained(fwd["resave_dir"])

    out["generate"] = []
    for case in job["generate"]:
        model = DFlashDraftModel.from_pretrained(case["drafter"], dtype=torch.float32).eval()
        target = AutoModelForCausalLM.from_pretrained(case["target"], dtype=torch.float32).eval()
        runs = []
        for prompt in case["prompts"]:
            ids = torch.tensor([prompt])
            if case["api"] == "spec_generate":
                output_ids = model.spec_generate(target, ids, case["max_new_tokens"], stop_token_ids=case["stop_token_ids"])
                lengths = None
            else:
                stats = dflash_generate(model, target, ids, case["max_new_tokens"], stop_token_ids=case["stop_token_ids"],
                                        block_size=case["block_size"], return_stats=True)
                output_ids, lengths = stats.output_ids, [int(a) for a in stats.acceptance_lengths]
            runs.append({"new_tokens": output_ids[0, len(prompt):].tolist(), "acceptance_lengths": lengths})
        out["generate"].append(runs)
out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught})
save_file({k: v.contiguous() for k, v in tensors.items()}, job["tensors_out"])
Path(job["json_out"]).write_text(json.dumps(out, indent=1))
"""

LAYER_ID_CASES = [(t, k) for t in range(4, 65) for k in range(1, 9)] + [(t, 1) for t in range(1, 4)]


def small_vocab_config():
    """8 tokens, no EOS: random drafts are right often enough to give acceptance lengths well above 1."""
    return qwen3_config(vocab_size=8, eos_token_id=None)


@pytest.fixture(scope="module")
def authors_run(authors_package, tmp_path_factory, qwen3_target, llama_target):
    """Everything the authors' code computes, in one subprocess; plus what we need to compare with it."""
    work = tmp_path_factory.mktemp("interop")
    qwen3_drafter = build_drafter(qwen3_target.config, seed=11, init_std=0.2)
    llama_drafter = build_drafter(llama_target.config, seed=12, init_std=0.2, block_size=16)
    small_target = build_target(small_vocab_config(), seed=1)  # seeds picked to give 7 partly accepted blocks
    small_drafter = build_drafter(small_target.config, seed=1, init_std=0.2, mask_token_id=7)
    models = {
        "qwen3": (qwen3_target, qwen3_drafter),
        "llama": (llama_target, llama_drafter),
        "small": (small_target, small_drafter),
    }
    for name, (target, drafter) in models.items():
        target.model.save_pretrained(work / f"{name}-target")
        drafter.save_pretrained(work / f"{name}-drafter")

    # One drafter forward, no cache: context of S=9 positions (two rows), a block of 8 at positions 9..16.
    seq, block = 9, qwen3_drafter.block_size
    ids = torch.cat([random_prompt(seq + 1, 40), random_prompt(seq + 1, 41)])
    features = qwen3_target.features(ids[:, :seq], None, qwen3_drafter.config.target_layer_ids).features
    block_ids = torch.cat([ids[:, seq:], torch.full((2, block - 1), MASK)], dim=1)
    inputs = {
        "context_ids": ids[:, :seq],
        "target_hidden": features,
        "noise_embedding": qwen3_target.embed(block_ids).detach(),
        "position_ids": torch.arange(seq + block).expand(2, -1).contiguous(),
    }
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(work / "inputs.safetensors"))
    with torch.no_grad():
        ours_hidden = qwen3_drafter(inputs["target_hidden"], inputs["noise_embedding"], torch.arange(seq)[None].expand(2, -1),
                                    torch.arange(seq, seq + block)[None].expand(2, -1))  # fmt: skip
        ours_logits = qwen3_target.lm_head(ours_hidden)

    small_prompts = [torch.randint(0, 7, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 8, 11)]
    cases = [
        # (model, prompts, api, block size, max new tokens, stop ids for both sides)
        ("qwen3", [random_prompt(n, 50 + n) for n in (4, 13)], "spec_generate", 8, 24, [EOS]),
        ("qwen3", [random_prompt(n, 60 + n) for n in (6, 10)], "dflash_generate", 4, 19, [EOS]),
        ("llama", [random_prompt(n, 70 + n) for n in (5, 12)], "dflash_generate", 16, 27, [EOS]),
        ("small", small_prompts, "dflash_generate", 8, 32, None),
        ("small", small_prompts, "dflash_generate", 4, 29, None),
    ]
    job = {
        "authors_dir": str(authors_package),
        "layer_id_cases": LAYER_ID_CASES,
        "forward": {
            "drafter": str(work / "qwen3-drafter"),
            "target": str(work / "qwen3-target"),
            "inputs": str(work / "inputs.safetensors"),
            "resave_dir": str(work / "resaved-by-authors"),
        },
        "generate": [
            {
                "target": str(work / f"{name}-target"),
                "drafter": str(work / f"{name}-drafter"),
                "prompts": [p[0].tolist() for p in prompts],
                "api": api,
                "block_size": block_size,
                "max_new_tokens": max_new,
                "stop_token_ids": stop,
            }
            for name, prompts, api, block_size, max_new, stop in cases
        ],
        "tensors_out": str(work / "authors.safetensors"),
        "json_out": str(work / "authors.json"),
    }
    (work / "job.json").write_text(json.dumps(job))
    (work / "authors_script.py").write_text(AUTHORS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONNOUSERSITE="1")
    result = subprocess.run(
        [sys.executable, str(work / "authors_script.py"), str(work / "job.json")],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"the authors' code failed:\n{result.stderr[-4000:]}"

    ours = {"hidden": ours_hidden, "logits": ours_logits, "features": features, "generate": []}
    for name, prompts, _api, block_size, max_new, stop in cases:
        target, drafter = models[name]
        ours["generate"].append([speculative_generate(target, drafter, p, max_new, block_size=block_size, stop_token_ids=stop or []) for p in prompts])
    return {
        "json": json.loads(Path(job["json_out"]).read_text()),
        "tensors": load_file(job["tensors_out"]),
        "ours": ours,
        "cases": cases,
        "work": work,
        "qwen3_drafter": qwen3_drafter,
    }


def test_authors_package_is_isolated(authors_run, authors_package):
    assert Path(authors_run["json"]["dflash_file"]).resolve() == (authors_package / "dflash" / "__init__.py").resolve()
    import dflash

    assert Path(dflash.__file__).resolve().parent == Path(__file__).resolve().parent.parent / "dflash"  # ours, here


def test_layer_id_rule_matches_the_authors(authors_run):
    theirs = authors_run["json"]["layer_ids"]
    for t, k in LAYER_ID_CASES:
        assert target_layer_ids(t, k) == theirs[f"{t},{k}"], (t, k)


def test_authors_load_our_checkpoint_completely(authors_run):
    info = authors_run["json"]["loading_info"]
    assert info.get("missing_keys") == [] and info.get("unexpected_keys") == [], info
    assert not info.get("mismatched_keys"), info
    drafter = authors_run["qwen3_drafter"]
    assert authors_run["json"]["drafter_attrs"] == {
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": drafter.config.target_layer_ids,
    }


def test_context_features_match_the_authors_extraction(authors_run):
    torch.testing.assert_close(authors_run["tensors"]["features"], authors_run["ours"]["features"], rtol=1e-5, atol=1e-5)


def test_drafter_forward_matches_the_authors(authors_run):
    theirs, ours = authors_run["tensors"], authors_run["ours"]
    # Theirs gives every block position, ours the drafted ones (1..7: the anchor's output feeds nothing).
    assert theirs["hidden"].shape == (2, 8, 64) and ours["hidden"].shape == (2, 7, 64)
    torch.testing.assert_close(theirs["hidden"][:, 1:], ours["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs["logits"][:, 1:], ours["logits"], rtol=1e-5, atol=1e-5)
    assert torch.equal(theirs["logits"][:, 1:].argmax(-1), ours["logits"].argmax(-1))


def test_we_load_a_checkpoint_the_authors_saved(authors_run):
    resaved = DFlashDrafter.from_pretrained(authors_run["work"] / "resaved-by-authors")
    original = authors_run["qwen3_drafter"]
    assert resaved.config.target_layer_ids == original.config.target_layer_ids
    assert (resaved.block_size, resaved.mask_token_id) == (original.block_size, original.mask_token_id)
    assert resaved.config.rope_theta == original.config.rope_theta
    for name, tensor in original.state_dict().items():
        assert torch.equal(resaved.state_dict()[name], tensor), name


def test_generation_matches_the_authors(authors_run):
    partial = 0
    for case, theirs, ours in zip(authors_run["cases"], authors_run["json"]["generate"], authors_run["ours"]["generate"]):
        name, prompts, api, block_size, max_new, stop = case
        for prompt, their_run, our_gen in zip(prompts, theirs, ours):
            label = (name, api, block_size, prompt.shape[1])
            assert their_run["new_tokens"] == our_gen.tokens.tolist(), label
            if their_run["acceptance_lengths"] is None:
                continue
            # Theirs records what each step committed (the last step cut to the budget or the stop token);
            # ours records accepted drafts + 1. They agree on every step but the last, which ours does not cut.
            lengths = our_gen.stats.acceptance_lengths
            committed = lengths[:-1] + [our_gen.stats.num_output_tokens - 1 - sum(lengths[:-1])] if lengths else []
            assert their_run["acceptance_lengths"] == committed, label
            partial += sum(1 < a < block_size for a in lengths[:-1])
    assert partial >= 3, "the drafts were never partly accepted: the comparison does not exercise the caches"


def test_authors_code_runs_on_our_transformers(authors_run):
    """With the installed transformers their code only warns about deprecations (e.g. ``past_key_values`` renamed ``cache``)."""
    warnings_seen = authors_run["json"]["warnings"]
    print("\n".join(["warnings from the authors' code:"] + warnings_seen))
    assert all(w.startswith(("FutureWarning", "DeprecationWarning")) for w in warnings_seen), warnings_seen
