"""The preflight stages, with known answers and injected faults.

Fast checks first; the stages that compile (the FX race, the compile-cache
warmup) are marked slow and run through the command line, so that the JSON
verdict contract is checked as the workflow reads it.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from dflash.batch import global_batches, padded_length, rank_slice, step_shapes
from dflash.cli import main
from dflash.compile_cache import use_warm_cache
from dflash.config import PreflightConfig, TopologyConfig, TrainConfig, cpu_threads
from dflash.errors import PreflightError
from dflash.preflight.env_check import env_check, supported_ranges
from dflash.preflight.fx_race import fx_race_safe, fx_tracing_flag
from dflash.preflight.gate import PROCESSES, THREADS, check_preflight
from dflash.preflight.race import Deterministic, RaceVerdict, Trials, judge
from dflash.preflight.smoke_imports import import_lines, smoke_imports
from dflash.preflight.verdict import Verdict, read_verdict, write_verdict
from dflash.preflight.warmup import _device_env

# The flag became thread-local after 2.13 (pytorch PR #168999); up to 2.13 the deterministic race must reproduce.
RACY_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) <= (2, 13)


def run_cli(argv: list[str]) -> int:
    """``python -m dflash ARGV`` in this process; the intra-op threads it sets are restored afterwards."""
    threads = torch.get_num_threads()
    try:
        return main(argv)
    finally:
        torch.set_num_threads(threads)


# -- verdicts ----------------------------------------------------------------------------------------


def test_verdict_round_trip_and_refusal(tmp_path):
    good = Verdict(stage="env_check")
    good.summarize("all fine")
    write_verdict(good, tmp_path / "env.json")
    assert read_verdict(tmp_path / "env.json", "env_check")["ok"] is True
    assert (tmp_path / "env.txt").read_text().startswith("env_check: ok")

    bad = Verdict(stage="env_check")
    bad.fail("the disk is full: free some space")
    bad.summarize("one problem")
    write_verdict(bad, tmp_path / "bad.json")
    with pytest.raises(RuntimeError, match="the disk is full: free some space"):
        read_verdict(tmp_path / "bad.json", "env_check")
    with pytest.raises(ValueError, match="expected 'warmup_cache'"):
        read_verdict(tmp_path / "env.json", "warmup_cache")
    with pytest.raises(FileNotFoundError, match="run the preflight stage warmup_cache"):
        read_verdict(tmp_path / "missing.json", "warmup_cache")


# -- env_check ---------------------------------------------------------------------------------------


def test_supported_ranges_are_the_projects():
    ranges = supported_ranges()
    assert ranges["torch"] == "<2.15,>=2.11"
    assert ranges["transformers"] == "<6,>=5.24"
    assert ranges["python"] == ">=3.10"
    assert "pytest" not in ranges  # an optional extra


def test_env_check_passes_on_a_cpu_topology(tmp_path):
    verdict = env_check(TopologyConfig(device="cpu", nproc_per_node=1), PreflightConfig(min_free_disk_gb=0.001), tmp_path / "results")
    assert verdict.ok, verdict.report()
    assert {"torch", "transformers", "datasets", "snakemake", "python"} <= set(verdict.versions)
    assert verdict.compiler["ok"] and verdict.directories["results"]["writable"]


def test_env_check_names_the_config_keys_when_devices_are_missing(tmp_path):
    asked = torch.cuda.device_count() + 8
    code = run_cli(
        [
            "env-check",
            "--topology",
            json.dumps({"device": "cuda", "nproc_per_node": asked}),
            "--results-dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "env.json"),
        ]
    )
    verdict = json.loads((tmp_path / "env.json").read_text())
    assert code == 1 and verdict["ok"] is False and verdict["torch_version"] == torch.__version__
    message = next(p for p in verdict["problems"] if "CUDA device(s) per node asked for" in p)
    assert "topology.nproc_per_node" in message and "topology.device" in message and "config/config.yaml" in message


def test_env_check_rejects_more_cpu_processes_than_cores_and_too_little_disk(tmp_path):
    topology = TopologyConfig(device="cpu", nproc_per_node=(os.cpu_count() or 1) + 1)
    verdict = env_check(topology, PreflightConfig(min_free_disk_gb=1e9), tmp_path)
    assert not verdict.ok
    assert any("topology.nproc_per_node" in p and "core" in p for p in verdict.problems)
    assert any("preflight.min_free_disk_gb" in p for p in verdict.problems)


# -- smoke_imports -----------------------------------------------------------------------------------


def test_import_lines_are_the_packages_own():
    lines = import_lines()
    assert any(where.startswith("dflash/checkpoint.py:") for where in lines["from dflash.model import DFlashConfig, DFlashDrafter"])
    assert not any(line.startswith("from __future__") for line in lines)


def test_smoke_imports_runs_each_backend(tmp_path):
    code = run_cli(["smoke-imports", "--topology", "{}", "--out", str(tmp_path / "smoke.json")])
    verdict = json.loads((tmp_path / "smoke.json").read_text())
    assert code == 0 and verdict["ok"], verdict["problems"]
    assert verdict["imports"] == len(import_lines()) and verdict["failed_imports"] == []
    sdpa, flex = verdict["backends"]["sdpa"], verdict["backends"]["flex"]
    assert sdpa["trained"] is True and flex["trained"] is False  # flex has no CPU backward in torch 2.13
    assert flex["forward_loss"] == pytest.approx(sdpa["forward_loss"], rel=1e-4)


def test_a_broken_import_names_the_symbol_and_the_module():
    verdict = smoke_imports("cpu", list(import_lines()) + ["from dflash.model import NoSuchName"])
    assert not verdict.ok and verdict.backends == {}
    (failure,) = verdict.failed_imports
    assert "'NoSuchName'" in failure["error"] and "'dflash.model'" in failure["error"]


def test_a_misplaced_name_points_to_where_it_lives():
    # The field report: a reproduction died because DFlashConfig was not where it was assumed.
    verdict = smoke_imports("cpu", ["from dflash.drafter import DFlashConfig"])
    (problem,) = verdict.problems
    assert "'dflash.drafter' does not exist" in problem and "DFlashConfig is defined in dflash.model" in problem


def test_smoke_imports_cli_fails_on_a_broken_import(tmp_path, monkeypatch, capsys):
    from dflash.preflight import smoke_imports as module

    broken = {**module.import_lines(), "from dflash.attention import flash_attend": ["dflash/model.py:24"]}
    monkeypatch.setattr(module, "import_lines", lambda: broken)
    code = run_cli(["smoke-imports", "--topology", "{}", "--out", str(tmp_path / "smoke.json")])
    assert code == 1
    err = capsys.readouterr().err
    assert "'flash_attend'" in err and "'dflash.attention'" in err and "dflash/model.py:24" in err


# -- repro_fx_race -------------------------------------------------------------------------------------


def test_fx_race_safe_sets_the_mitigation_in_its_own_thread_only():
    seen = {}

    @fx_race_safe
    def worker():
        seen["worker"] = torch._dynamo.config.force_compile_during_fx_trace

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["worker"] is True
    assert torch._dynamo.config.force_compile_during_fx_trace is False


def _race_verdict(path, reproduced: bool = True, mitigated_errors: int = 0, shared_flag: bool = True):
    """A race verdict judged from given experiment results, written as the stage writes it."""
    verdict = RaceVerdict(shared_flag=shared_flag, deterministic=Deterministic(reproduced=reproduced), mitigated=Trials(trials=3, errors=mitigated_errors))
    judge(verdict)
    verdict.summarize("a test verdict")
    write_verdict(verdict, path)
    return verdict


def test_the_race_verdict_is_a_diagnostic_that_never_stops_training(tmp_path, caplog):
    """Training runs one thread of compiled code per process: a mitigation that does not hold is logged, not enforced."""
    verdict = _race_verdict(tmp_path / "race.json", mitigated_errors=2)
    assert verdict.ok and not verdict.mitigation_verified and verdict.safe_for == [PROCESSES]
    with caplog.at_level("WARNING", logger="dflash.preflight.gate"):
        verdicts = check_preflight([tmp_path / "race.json"], TopologyConfig(nproc_per_node=8))
    assert verdicts["repro_fx_race"]["safe_for"] == [PROCESSES]
    assert any("Training is unaffected" in r.message and r.levelname == "WARNING" for r in caplog.records)
    caplog.clear()
    _race_verdict(tmp_path / "verified.json")
    with caplog.at_level("WARNING", logger="dflash.preflight.gate"):
        assert check_preflight([tmp_path / "verified.json"], TopologyConfig())["repro_fx_race"]["safe_for"] == [PROCESSES, THREADS]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_broken_reproduction_fails_the_stage_but_not_training(tmp_path, capsys, caplog):
    from dflash.cli import _finish

    verdict = _race_verdict(tmp_path / "race.json", reproduced=False)
    assert not verdict.ok and "the reproduction is broken" in verdict.problems[0]
    # By hand the stage fails; in the workflow (--diagnostic) it writes the verdict, prints its problems and exits 0.
    with pytest.raises(PreflightError, match="the reproduction is broken"):
        _finish(verdict, tmp_path / "by-hand.json")
    _finish(verdict, tmp_path / "diagnostic.json", diagnostic=True)
    assert "the reproduction is broken" in capsys.readouterr().out
    assert json.loads((tmp_path / "diagnostic.json").read_text())["ok"] is False
    with caplog.at_level("WARNING", logger="dflash.preflight.gate"):
        check_preflight([tmp_path / "diagnostic.json"], TopologyConfig())
    assert any("FAILED" in r.message for r in caplog.records)
    # Every other failed verdict still stops training.
    failed = Verdict(stage="smoke_imports")
    failed.fail("an import is missing")
    write_verdict(failed, tmp_path / "smoke.json")
    with pytest.raises(PreflightError, match="preflight stage smoke_imports failed"):
        check_preflight([tmp_path / "smoke.json"], TopologyConfig())
    # A torch whose FX flag is per thread cannot race: nothing to reproduce, threads are safe.
    per_thread = _race_verdict(tmp_path / "later.json", reproduced=False, shared_flag=False)
    assert per_thread.ok and per_thread.safe_for == [PROCESSES, THREADS]


@pytest.mark.slow
def test_repro_fx_race_reproduces_and_the_mitigation_holds(tmp_path):
    out = tmp_path / "repro_fx_race.json"
    code = run_cli(
        ["repro-fx-race", "--topology", "{}", "--preflight", json.dumps({"repro_fx_race": {"threads": 2, "trials": 3, "steps": 3}}), "--out", str(out)]
    )
    verdict = json.loads(out.read_text())
    assert code == 0 and verdict["ok"], verdict["problems"]
    assert verdict["torch_version"] == torch.__version__ and verdict["mitigation"]
    if RACY_TORCH:
        deterministic = verdict["deterministic"]
        assert deterministic["reproduced"] and "symbolically trace a dynamo-optimized function" in deterministic["error"]
        assert deterministic["flag_set_by"][0].startswith("torch/fx/_symbolic_trace.py:") and "Tracer.trace" in deterministic["flag_set_by"][0]
        assert not deterministic["mitigated_raised"]
        assert verdict["natural"]["trials"] == 3 and verdict["natural"]["errors"] >= 1
    mitigated = verdict["mitigated"]
    assert mitigated["trials"] == 3 and mitigated["errors"] == 0
    assert mitigated["flag_stuck"] == 0 and mitigated["eager_calls"] == 0 and mitigated["other_errors"] == []
    assert verdict["mitigation_verified"] and verdict["safe_for"] == [PROCESSES, THREADS]
    assert not fx_tracing_flag()


@pytest.mark.slow
def test_silent_eager_fallback_is_counted():
    """With ``error_on_nested_fx_trace=False`` the racing call runs eagerly instead of raising; the probe must see it."""
    from collections import Counter

    from dflash.preflight.race import RaceBlock, _call_during_trace, _inputs, race_compile_settings

    eager = Counter()
    block = RaceBlock(eager)
    inputs = _inputs(29, torch.device("cpu"), seed=0)
    with race_compile_settings(mitigate=False):
        block(*inputs)
        block(*inputs)
    assert eager["eager"] == 0  # compiled calls leave no count

    def quietly():
        with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
            block(*inputs)

    error, _, _ = _call_during_trace(quietly, mitigate=False)
    assert error is None
    assert eager["eager"] == (1 if RACY_TORCH else 0)


# -- warmup_cache --------------------------------------------------------------------------------------


def test_warmup_compiles_for_the_device_index_training_uses(monkeypatch):
    """The device index is in the compiled graphs' cache keys: cudaN compiles for cuda:N, never for a device renumbered by pinning."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert _device_env("cpu")[0] == "cpu"
    visible = torch.cuda.device_count()
    if visible > 1:
        device, env = _device_env("cuda1")
        assert device == "cuda:1" and env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(PreflightError, match=rf"cuda:{visible}, but this job sees {visible} CUDA device"):
        _device_env(f"cuda{visible}")
    with pytest.raises(ValueError, match="preflight.warmup.devices"):
        _device_env("gpu0")


def test_drafter_world_counts_the_data_parallel_ranks():
    assert TopologyConfig().drafter_world == 1
    assert TopologyConfig(nproc_per_node=3).drafter_world == 3
    assert TopologyConfig(kind="split", nnodes=2, nproc_per_node=4, target_ranks=3).drafter_world == 5


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_step_shapes_hold_every_batch_shape_of_any_run(ranks):
    """Known answers, then brute force: every rank's batch of every epoch, for many seeds, has a listed shape."""
    lengths = [5, 9, 12, 17, 30, 31]  # padded to 8: 8, 16, 16, 24, 32, 32
    cfg = TrainConfig(batch_size=4, pad_multiple=8)
    shapes = step_shapes(lengths, cfg, ranks)
    expected = {
        # Full batches of 4 rows: the longest of 4 is at least the 4th shortest (17); the epoch's last batch has 2.
        1: [(4, 24), (4, 32), (2, 16), (2, 24), (2, 32)],
        # Shares of 2 and 2, then of 1 and 1.
        2: [(2, 16), (2, 24), (2, 32), (1, 8), (1, 16), (1, 24), (1, 32)],
        # Shares of 2, 1, 1, then 1, 1 and an idle rank's one stand-in row.
        3: [(2, 16), (2, 24), (2, 32), (1, 8), (1, 16), (1, 24), (1, 32)],
    }[ranks]
    assert shapes == expected
    for seed in range(40):
        for epoch in range(3):
            for batch in global_batches(len(lengths), cfg.batch_size, seed, epoch):
                for rank in range(ranks):
                    share = rank_slice(batch, rank, ranks) or batch[:1]
                    assert (len(share), padded_length(max(lengths[i] for i in share), 8)) in shapes


@pytest.fixture
def tiny_target_manifest(tmp_path):
    """A tiny random Llama saved as a model directory with a word-level tokenizer, and its prepare_target manifest."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dflash.preflight.synthetic import TINY_TARGET

    directory = tmp_path / "tiny-target"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_TARGET)).save_pretrained(directory)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_TARGET["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t127").save_pretrained(directory)
    manifest = tmp_path / "target.json"
    manifest.write_text(json.dumps({"source": str(directory), "dtype": "float32"}))
    return manifest


@pytest.mark.slow
def test_warmup_second_start_runs_from_the_cache(tmp_path, tiny_target_manifest, monkeypatch):
    from dflash.preflight.synthetic import synthetic_samples

    out, cache, samples = tmp_path / "warmup" / "cpu.json", tmp_path / "compile_cache" / "cpu", tmp_path / "train.parquet"
    lengths = [20, 37, 45, 61, 90]
    synthetic_samples(lengths, 128).to_parquet(samples)
    train = {"batch_size": 2, "max_anchors": 3, "pad_multiple": 32}
    # Snakemake's OMP_NUM_THREADS under --cores 1: the warmup compiles with the threads training runs with regardless.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("DFLASH_CPU_THREADS", raising=False)
    code = run_cli(
        [
            "warmup-cache", "--devices", "cpu", "--target-manifest", str(tiny_target_manifest), "--samples", str(samples),
            "--drafter", json.dumps({"num_context_features": 2, "block_size": 4, "mask_token_id": 126}),
            "--train", json.dumps(train), "--topology", "{}", "--cache-root", str(cache.parent), "--out-dir", str(out.parent),
        ]
    )  # fmt: skip
    verdict = json.loads(out.read_text())
    # Every shape of the run, in both processes: 2 rows padded to 64 or 96; the epoch's last batch, 1 row, 32 to 96.
    assert verdict["shapes"] == [[2, 64], [2, 96], [1, 32], [1, 64], [1, 96]]
    for label in ("cold", "warm"):
        assert [[step["rows"], step["length"]] for step in verdict[label]["steps"]] == verdict["shapes"]
        assert verdict[label]["threads"] == cpu_threads(1)
    assert verdict["graphs"] >= 2  # a single row is specialised apart from two
    assert sum(step["graphs_compiled"] for step in verdict["warm"]["steps"]) == verdict["graphs"]
    assert code == 0 and verdict["ok"], verdict["problems"]
    assert verdict["torch_version"] == torch.__version__ and verdict["cache_dir"] == str(cache.resolve())
    assert verdict["cold"]["cache"]["fxgraph_cache_miss"] > 0
    warm = verdict["warm"]["cache"]
    assert warm["fxgraph_cache_hit"] > 0 and warm["autograd_cache_hit"] > 0
    assert warm["fxgraph_cache_miss"] == 0 and warm["autograd_cache_miss"] == 0
    assert 0 < verdict["warm_seconds"] < verdict["cold_seconds"]
    assert verdict["cold"]["steps"][0]["compile_seconds"] < verdict["cold_first_step_seconds"]
    assert verdict["speedup"] == pytest.approx(verdict["cold_seconds"] / verdict["warm_seconds"], rel=0.05)

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_warm_cache(read_verdict(out, "warmup_cache")) == cache.resolve()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.resolve())


def test_a_run_that_would_not_fit_fails_the_warmup_naming_the_keys(tmp_path, tiny_target_manifest):
    from dflash.config import DrafterConfig
    from dflash.preflight.warmup import WarmupVerdict, check_memory

    verdict = WarmupVerdict(shapes=[[8, 4096]])
    huge = TrainConfig(max_anchors=2_000_000, precision="fp32")  # some hundred GB of activations
    check_memory(verdict, "cpu", tiny_target_manifest, DrafterConfig(num_context_features=2, block_size=4), huge, TopologyConfig())
    assert not verdict.ok and verdict.memory["estimate"] > verdict.memory["available"]
    assert "train.activation_checkpointing" in verdict.problems[0] and "train.max_anchors" in verdict.problems[0]
    small = WarmupVerdict(shapes=[[2, 64]])
    check_memory(small, "cpu", tiny_target_manifest, DrafterConfig(num_context_features=2, block_size=4), TrainConfig(max_anchors=3), TopologyConfig())
    assert small.ok and 0 < small.memory["estimate"] < small.memory["available"]
