"""The Snakemake workflow as users run it: entry points, the whole DAG on a tiny target, reruns, bad configs.

Snakemake runs in a subprocess exactly as users type it (``snakemake --cores 1
train``), started from the virtual environment's ``snakemake`` script with a PATH
that does not contain the environment: the workflow must find its interpreter
itself. It runs in the root of a scratch copy of the project (Snakefile,
workflow, the dflash package, profiles) whose ``config/config.yaml`` is the
config under test: the jobs' ``python -m dflash`` imports the copy, so edits
made to this checkout while the tests run do not rerun jobs halfway. Caches
(DFLASH_CACHE_DIR, the compile cache, Hugging Face, matplotlib) go to scratch
directories too.

The whole-DAG run (``config/test.yaml``: a random 6-layer chat model with a
trained byte-level tokenizer, a dozen prompts, 4 training steps, 2 prompts per
evaluation set) happens once per module; its artifacts and reruns are then
checked by several tests. Reruns are read from dry runs' job lists (the
``--list-changes params`` listing is unreliable in Snakemake 9).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import require_chromium
from tiny_chat_target import UNUSED, build_tiny_inputs

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILES = ["Snakefile", "workflow", "dflash", "profiles", "envs", "pyproject.toml"]
VENV_BIN = Path(sys.executable).parent
SNAKEMAKE = VENV_BIN / "snakemake"
TEST_CONFIG = ROOT / "config" / "test.yaml"
DEFAULT_CONFIG = ROOT / "config" / "config.yaml"

PREFLIGHT = {"env_check", "smoke_imports", "repro_fx_race", "warmup_cache"}
TRAIN_JOBS = {"prepare_target", "prepare_data", "train"} | PREFLIGHT
EVALUATE_JOBS = TRAIN_JOBS | {"evaluate"}
ALL_JOBS = EVALUATE_JOBS | {"report", "all"}
SUMMARY_COLUMNS = [
    "set",
    "prompts",
    "block_size",
    "tau",
    "speedup",
    "tpot_ar_ms",
    "tpot_dflash_ms",
    "lossless",
    "pld_tau",
    "pld_speedup",
    "tpot_pld_ms",
    "pld_lossless",
    "hybrid_tau",
    "hybrid_speedup",
    "tpot_hybrid_ms",
    "hybrid_lossless",
    "hybrid_lookup_share",
    "hybrid_drafter_share",
    "verified",
    "val_tau",
    "val_tau_gated",
    "device",
    "target_dtype",
]
EVAL_SETS = ["chat", "local", "humaneval"]

_JOB = re.compile(r"^(?:local)?rule (\w+):\s*$", re.MULTILINE)
_IMPORT_TIME = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(dflash(?:\.\w+)*)\s*$", re.MULTILINE)
_NOTHING = "Nothing to be done"


# -- running Snakemake -------------------------------------------------------------------------------


def without_venv(path: str) -> str:
    """PATH without the virtual environment's bin directory: as in a shell where it is not activated."""
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and Path(p).resolve() != VENV_BIN.resolve())


def snakemake_env(scratch: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "CONDA_PREFIX", "PYTHONPROFILEIMPORTTIME")}
    env["PATH"] = without_venv(env.get("PATH", "/usr/bin:/bin"))
    scratch.mkdir(parents=True, exist_ok=True)
    env.update(
        # The tiny target is dominated by per-op overhead: one thread per job is fastest.
        DFLASH_CPU_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(scratch / "hf"),
        DFLASH_CACHE_DIR=str(scratch / "dflash"),
        TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
        MPLCONFIGDIR=str(scratch / "matplotlib"),
        XDG_CACHE_HOME=str(scratch / "xdg"),
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
    )
    env.update(extra)
    return env


def readable(text: str, lines: int = 60) -> str:
    """The tail of Snakemake's output, without import-time profiling lines."""
    kept = [line for line in text.splitlines() if not line.startswith("import time:")]
    return "\n".join(kept[-lines:])


def run_snakemake(workdir: Path, env: dict, *args: str, check: bool = True, timeout: float = 1200) -> subprocess.CompletedProcess:
    """``snakemake ARGS`` in ``workdir``, a project root."""
    start = time.perf_counter()
    result = subprocess.run([str(SNAKEMAKE), *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    result.seconds = time.perf_counter() - start
    result.output = result.stdout + result.stderr
    if check and result.returncode != 0:
        logs = ""
        for log in sorted((workdir / "results" / "logs").glob("*.log")):
            logs += f"\n--- {log.name}\n{readable(log.read_text(), 25)}"
        raise AssertionError(f"snakemake {' '.join(args)} exited {result.returncode}:\n{readable(result.output)}{logs}")
    return result


def jobs(result: subprocess.CompletedProcess) -> set[str]:
    """The rules of the jobs a run executed, or a dry run would execute."""
    found = set(_JOB.findall(result.output))
    assert found or _NOTHING in result.output, readable(result.output)
    return found


def make_workdir(path: Path, config: dict | None = None, tiny: Path | None = None) -> Path:
    """A copy of the project at ``path`` with ``config`` as its config/config.yaml (the shipped one if None),
    and the tiny model and prompts under tiny/."""
    path.mkdir(parents=True)
    for name in PROJECT_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, path / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif source.is_file():
            shutil.copy2(source, path / name)
    if config is None:
        (path / "config").mkdir()
        shutil.copy2(DEFAULT_CONFIG, path / "config" / "config.yaml")
    else:
        write_config(path, config)
    if tiny is not None:
        shutil.copytree(tiny, path / "tiny")
    return path


def write_config(workdir: Path, config: dict) -> None:
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny chat model and prompt files that config/test.yaml reads."""
    return build_tiny_inputs(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def test_config() -> dict:
    return yaml.safe_load(TEST_CONFIG.read_text())


# -- cheap checks ------------------------------------------------------------------------------------


def test_lint_is_clean(tmp_path):
    """`snakemake --lint` in the project root."""
    result = run_snakemake(ROOT, snakemake_env(tmp_path), "--lint", check=False, timeout=300)
    assert result.returncode == 0, readable(result.output)


def _key_paths(value, prefix=""):
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in {prefix + k} | _key_paths(v, prefix + k + ".")}
    return set()


def test_test_config_sets_every_key_the_default_sets(test_config):
    """`--configfile config/test.yaml` merges over config/config.yaml: no default value may stay in effect."""
    missing = _key_paths(yaml.safe_load(DEFAULT_CONFIG.read_text())) - _key_paths(test_config)
    assert not missing, f"config/test.yaml leaves these keys of config/config.yaml in effect: {sorted(missing)}"


def test_default_config_dry_run_of_train(tmp_path):
    """`snakemake --cores 1 -n train` with the shipped CPU config plans the preflight, data and training jobs, and
    vLLM's environment, in which regeneration runs where it builds (data.generation.engine: auto)."""
    workdir = make_workdir(tmp_path / "work")
    result = run_snakemake(workdir, snakemake_env(tmp_path / "scratch"), "--cores", "1", "-n", "train", timeout=300)
    assert jobs(result) == TRAIN_JOBS | {"serve_env"}
    assert not (workdir / "results").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--cores", "1", "train"], TRAIN_JOBS),
        (["--cores", "1", "evaluate"], EVALUATE_JOBS),
        (["--cores", "1"], ALL_JOBS),
        (["repro_fx_race"], {"env_check", "smoke_imports", "repro_fx_race"}),  # no --cores: the default profile gives one
        (["--cores", "1", "llamacpp_build"], {"llamacpp_build"}),  # opt-in, and needs nothing of a run
        (["--cores", "1", "llamacpp_check"], TRAIN_JOBS | {"llamacpp_build", "llamacpp_convert", "llamacpp_check"}),  # opt-in, after train
    ],
    ids=["train", "evaluate", "everything", "repro_fx_race", "llamacpp_build", "llamacpp_check"],
)
def test_dry_run_of_each_entry_point(tmp_path, tiny, test_config, args, expected):
    workdir = make_workdir(tmp_path / "work", test_config, tiny)
    result = run_snakemake(workdir, snakemake_env(tmp_path / "scratch"), *args, "-n", timeout=300)
    assert jobs(result) == expected


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"train": {"lrr": 1}}, "train.lrr"),  # the typed config: unknown key
        ({"train": {"attention_backend": "xformers"}}, "train.attention_backend"),  # the typed config: not an allowed value
        ({"topology": {"kind": "colocated", "target_ranks": 1}}, "topology.target_ranks"),  # the typed config: cross-field rule
        ({"eval": {"sets": [{"name": "chat set", "source": "heldout"}]}}, "['eval']['sets'][0]['name']"),  # the JSON schema: name pattern
    ],
    ids=["unknown-key", "bad-enum", "cross-field", "schema-pattern"],
)
def test_bad_config_is_rejected_naming_the_key(tmp_path, bad, key):
    workdir = make_workdir(tmp_path / "work", bad)
    result = run_snakemake(workdir, snakemake_env(tmp_path / "scratch"), "--cores", "1", "-n", check=False, timeout=300)
    assert result.returncode != 0
    assert key in result.output, readable(result.output)
    assert not (workdir / "results").exists()


# -- the whole DAG, once -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, tiny, test_config):
    """Every entry point in turn on one working directory, as a user would type them:

    1. ``snakemake --cores 1 train``      the preflight checks, target, data, training
    2. ``snakemake --cores 1 evaluate``   then evaluation only
    3. ``snakemake --cores 1``            then the report only
    4. ``snakemake repro_fx_race``        nothing left to do
    5. ``snakemake -n``                   nothing left to do: no volatile params
    6. an evaluation setting changed, ``snakemake --cores 1``: evaluate and report only
    7. ``snakemake --report results/report.html``

    Python's import-time profile of every job lands in the job's log, which tells
    which package modules each job imported.
    """
    base = tmp_path_factory.mktemp("e2e")
    workdir = make_workdir(base / "work", test_config, tiny)
    env = snakemake_env(base / "scratch", PYTHONPROFILEIMPORTTIME="1")
    # The venv is not on PATH: `python` there is some other interpreter, or none.
    assert shutil.which("python", path=env["PATH"]) != str(VENV_BIN / "python")
    steps = {}
    steps["train"] = run_snakemake(workdir, env, "--cores", "1", "train")
    steps["train_outputs"] = sorted(str(p.relative_to(workdir)) for p in (workdir / "results").iterdir())
    steps["evaluate"] = run_snakemake(workdir, env, "--cores", "1", "evaluate")
    steps["evaluate_outputs"] = sorted(str(p.relative_to(workdir)) for p in (workdir / "results").iterdir())
    steps["everything"] = run_snakemake(workdir, env, "--cores", "1")
    steps["repro_fx_race"] = run_snakemake(workdir, env, "repro_fx_race")
    steps["dry_run"] = run_snakemake(workdir, env, "-n")
    changed = copy.deepcopy(test_config)
    changed["eval"]["max_new_tokens"] -= 2
    write_config(workdir, changed)
    steps["eval_changed"] = run_snakemake(workdir, env, "--cores", "1")
    steps["report"] = run_snakemake(workdir, env, "--report", "results/report.html")
    steps["workdir"] = workdir
    steps["config"] = changed
    steps["env"] = {k: v for k, v in env.items() if k != "PYTHONPROFILEIMPORTTIME"}
    for name, result in steps.items():
        if isinstance(result, subprocess.CompletedProcess):
            print(f"{name}: {result.seconds:.0f} s, jobs {sorted(_JOB.findall(result.output))}")
    return steps


@pytest.mark.slow
def test_entry_points_run_the_whole_dag_in_stages(e2e):
    assert jobs(e2e["train"]) == TRAIN_JOBS
    assert "results/eval" not in e2e["train_outputs"] and "results/train" in e2e["train_outputs"]
    assert jobs(e2e["evaluate"]) == {"evaluate"}
    assert "results/report" not in e2e["evaluate_outputs"]
    assert jobs(e2e["everything"]) == {"report", "all"}
    assert jobs(e2e["repro_fx_race"]) == set()
    # A second look finds nothing to redo: no volatile value in any job's params.
    assert jobs(e2e["dry_run"]) == set()


@pytest.mark.slow
def test_changing_an_evaluation_setting_reran_evaluate_and_report_only(e2e):
    assert jobs(e2e["eval_changed"]) == {"evaluate", "report", "all"}
    per_set = pd.read_csv(e2e["workdir"] / "results" / "eval" / "chat.csv")
    assert (per_set["output_tokens"] <= e2e["config"]["eval"]["max_new_tokens"]).all()


@pytest.mark.slow
def test_evaluation_summary_is_lossless_on_every_set(e2e):
    results = e2e["workdir"] / "results"
    summary = pd.read_csv(results / "eval" / "summary.csv")
    assert list(summary.columns) == SUMMARY_COLUMNS
    assert list(summary["set"]) == EVAL_SETS
    assert list(summary["prompts"]) == [2, 2, 2]
    assert (summary["block_size"] == 4).all()
    assert summary["lossless"].tolist() == [True, True, True]
    assert (summary["tau"] >= 1.0).all() and (summary["tau"] <= 4.0).all()
    assert (summary["speedup"] > 0).all()
    # The prompt-lookup arm decodes the same prompts in the same loop, as losslessly.
    assert summary["pld_lossless"].tolist() == [True, True, True] and (summary["pld_tau"] >= 1.0).all() and (summary["pld_speedup"] > 0).all()
    # So does the hybrid; the teacher-forced τ on validation is a τ of the block size.
    assert summary["hybrid_lossless"].tolist() == [True, True, True] and (summary["hybrid_tau"] >= 1.0).all()
    assert summary["val_tau"].between(1.0, 4.0).all() and summary["val_tau_gated"].between(1.0, 4.0).all()
    # config/test.yaml's trees: the drafter's 2 likeliest tokens at each of 3 positions, verifies of up to 7 tokens.
    assert summary["verified"].between(0.0, 6.0).all()
    cost = json.loads((results / "eval" / "verify_cost.json").read_text())
    assert len(cost["relative"]) == 7 and cost["relative"][0] == 1.0 and cost["draft"] > 0
    # ... the widths decoding verified, as it paid them (plain steps, every arm's first, among them), and the table
    # the gate ended with: each width decoding verified between its measured and its paid cost.
    decoded = {int(k): d for k, d in cost["decoded"].items()}
    assert 1 in decoded and set(decoded) <= set(range(1, 8)) and len(cost["learnt"]) == 7
    for k, d in decoded.items():
        measured, paid = cost["relative"][k - 1], d["relative"]
        assert min(measured, paid) - 1e-9 <= cost["learnt"][k - 1] <= max(measured, paid) + 1e-9
    assert (results / "eval" / "calibration.json").is_file()
    assert (summary["device"] == "cpu").all() and (summary["target_dtype"] == "float32").all()
    for name in EVAL_SETS:
        rows = pd.read_csv(results / "eval" / f"{name}.csv")
        assert len(rows) == 2 and rows["lossless"].all()


@pytest.mark.slow
def test_drafter_checkpoint_loads(e2e):
    from transformers import AutoTokenizer

    from dflash.model import DFlashDrafter

    drafter_dir = e2e["workdir"] / "results" / "train" / "drafter"
    assert sorted(p.name for p in drafter_dir.iterdir() if not p.name.startswith(".")) == ["config.json", "model.safetensors"]
    drafter = DFlashDrafter.from_pretrained(drafter_dir)
    tokenizer = AutoTokenizer.from_pretrained(e2e["workdir"] / "tiny" / "target")
    assert drafter.block_size == 4
    assert drafter.config.num_hidden_layers == 1
    assert drafter.config.target_layer_ids == [1, 2, 3]
    assert drafter.config.vocab_size == len(tokenizer)
    # The default mask token: the highest special token the chat template never emits.
    assert drafter.config.mask_token_id == tokenizer.convert_tokens_to_ids(UNUSED[-1])


@pytest.mark.slow
def test_training_metrics_and_warm_start(e2e, test_config):
    results = e2e["workdir"] / "results"
    card = json.loads((results / "data" / "card.json").read_text())
    # 16 prompts; the hash split holds 4 out: 2 to evaluate, 2 to validate; the other 12 train.
    assert card["prompts"] == 16 and card["heldout_prompts"] == 2 and card["validation_samples"] == 2 and card["samples"] == card["train_prompts"] == 12
    train = test_config["train"]
    steps = math.ceil(card["samples"] / train["batch_size"]) * train["epochs"]
    summary = json.loads((results / "train" / "summary.json").read_text())
    assert summary["steps"] == steps
    metrics = pd.read_csv(results / "train" / "metrics.csv")
    assert metrics["step"].tolist() == list(range(1, steps + 1))  # log_every: 1
    assert {"loss", "grad_norm", "lr", "acc_1", "acc_2", "acc_3", "val_acc_1", "val_acc_2", "val_acc_3"} <= set(metrics.columns)
    # The validation accuracy is measured on held-out samples at the end at least (and every validate_every steps).
    assert metrics["val_acc_1"].notna().iloc[-1] and summary["validation_accuracy"] == pytest.approx(
        metrics[["val_acc_1", "val_acc_2", "val_acc_3"]].iloc[-1].tolist()
    )
    assert metrics["loss"].notna().all() and (metrics["loss"] > 0).all()
    # Training compiled nothing cold: every graph of the whole run came from the cache warmup_cache filled,
    # which warmed in training's conditions (its threads), so that the first step is as fast as the warmup's warm one.
    cache = summary["compile_cache"]
    assert cache["fxgraph_cache_hit"] > 0 and cache["fxgraph_cache_miss"] == 0 and cache["autograd_cache_miss"] == 0, cache
    warmup = json.loads((results / "preflight" / "warmup" / "cpu.json").read_text())
    assert summary["threads"] == warmup["warm"]["threads"] == warmup["cold"]["threads"]
    assert summary["first_step_seconds"] <= 1.5 * warmup["warm_first_step_seconds"], (summary["first_step_seconds"], warmup["warm_first_step_seconds"])


@pytest.mark.slow
def test_the_training_levers_benchmark_trains_each_arm_on_the_runs_results(e2e, tmp_path):
    """benchmarks/training_levers.py on the run's data, target and compile cache: the default and every lever of the
    field's recipe at once each train to the end of their schedule, validated on the way."""
    workdir = e2e["workdir"]
    recipe = {
        "optimizer": "muon", "lr_schedule": "linear", "position_weights": "dpace", "sample_loss_positions": False,
        "labels": "every_position", "loss_normaliser": "positions",
    }  # fmt: skip
    command = [
        sys.executable, str(ROOT / "benchmarks" / "training_levers.py"), "--config", "config/config.yaml", "--results", "results",
        "--out", str(tmp_path), "--steps", "4", "--validate-every", "2", "--arm", "default", "{}", "--arm", "recipe", json.dumps(recipe),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=workdir, env=e2e["env"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, readable(result.stdout + result.stderr)
    rows = json.loads((tmp_path / "levers.json").read_text())["rows"]
    assert [row["arm"] for row in rows] == ["default", "recipe"]
    for row in rows:
        assert row["steps"] == 4 and 1.0 <= row["validation_tau"] <= 4.0 and [point["step"] for point in row["curve"]] == [2, 4]
        assert row["seconds_per_step"] > 0 and row["equal_time_tau"] is not None
    assert "recipe: " in result.stdout and "written to" in result.stdout


@pytest.mark.slow
def test_preflight_verdicts_are_ok(e2e):
    preflight = e2e["workdir"] / "results" / "preflight"
    for name in ("env.json", "smoke_imports.json", "repro_fx_race.json", "warmup/cpu.json"):
        verdict = json.loads((preflight / name).read_text())
        assert verdict["ok"] is True, (name, verdict.get("problems"), verdict.get("summary"))


@pytest.mark.slow
def test_report_renders_self_contained(e2e):
    assert "Report created" in e2e["report"].output
    page = (e2e["workdir"] / "results" / "report.html").read_text()
    plots = ("training_curves.png", "acceptance_histogram.png", "position_acceptance.png", "speedup.png", "calibration.png", "verify_cost.png")
    for item in (*plots, "summary.html", "metrics.csv", "summary.csv"):
        assert item in page, item
    # Self-contained: no script or stylesheet fetched from elsewhere.
    assert not re.search(r"<script[^>]*\ssrc=", page)
    assert not re.search(r"<link[^>]*href=[\"']https?:", page)


@pytest.mark.slow
def test_the_report_page_shows_the_runs_numbers_under_their_headers(e2e):
    results = e2e["workdir"] / "results"
    page = (results / "report" / "summary.html").read_text()
    summary = pd.read_csv(results / "eval" / "summary.csv")
    train = json.loads((results / "train" / "summary.json").read_text())
    assert "Speedup vs plain decoding (×)" in page and "Tokens accepted per verify step (τ)" in page
    for _, row in summary.iterrows():
        row_html = page[page.index(f"<td>{row['set']}</td>") :].split("</tr>")[0]
        for column in ("speedup", "pld_speedup", "hybrid_speedup"):
            assert f"{row[column]:.2f}×" in row_html, (row["set"], column)
    assert f"<th>Steps</th><td>{train['steps']:,}</td>" in page
    # The config's key values, as this run had them (the evaluation's max_new_tokens was changed before this report).
    assert f"<th>eval.max_new_tokens</th><td>{e2e['config']['eval']['max_new_tokens']}</td>" in page
    # A duration per stage that ran, from Snakemake's benchmark files.
    for stage in ("env_check", "prepare_data", "train", "evaluate"):
        assert f"<td>{stage}</td>" in page, stage
    assert "<td>report</td>" not in page  # the previous report's own benchmark, stale
    images = re.findall(r"<img src=\"([^\"]{0,30})", page)
    assert len(images) == 6 and all(src.startswith("data:image/png;base64,") for src in images)
    assert "<script" not in page and "http" not in page


@pytest.mark.slow
def test_check_report_renders_the_page_in_chromium(e2e):
    require_chromium()
    result = run_snakemake(e2e["workdir"], e2e["env"], "--cores", "1", "check_report", timeout=300)
    assert jobs(result) == {"check_report"}
    verdict = json.loads((e2e["workdir"] / "results" / "report" / "browser_check.json").read_text())
    assert verdict["ok"] and len(verdict["images"]) == 6 and all(image["width"] > 0 for image in verdict["images"])
    assert (e2e["workdir"] / "results" / "report" / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _declared_inputs(result: subprocess.CompletedProcess, package_dir: Path) -> dict[str, set[str]]:
    """Each executed job's declared package files, from Snakemake's job listing."""
    declared = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", result.output):
        header = _JOB.match(block)
        inputs = re.search(r"^\s+input: (.*)$", block, re.MULTILINE)
        if header and inputs:
            declared[header.group(1)] = {p for p in inputs.group(1).split(", ") if p.startswith(str(package_dir))}
    return declared


@pytest.mark.slow
def test_package_files_each_job_imports_are_its_inputs(e2e):
    """Every package module a job imported (Python's import-time profile in its log) is among its declared inputs."""
    workdir = e2e["workdir"]
    declared = {}
    for step in ("train", "evaluate", "everything"):
        declared |= _declared_inputs(e2e[step], workdir / "dflash")
    logs = workdir / "results" / "logs"
    checked = set()
    for rule, files in declared.items():
        # `all` runs nothing; smoke_imports imports every import line of the package as its check: those
        # modules are what it checks, not what it runs, and rerunning it for each of them would rerun training.
        if rule in ("all", "smoke_imports"):
            continue
        log = logs / f"{rule}.log"
        imported = set(_IMPORT_TIME.findall(log.read_text()))
        assert "dflash.cli" in imported, f"{log}: no import-time profile"
        missing = []
        for module in imported:
            path = workdir.joinpath(*module.split("."))
            file = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
            if str(file) not in files:
                missing.append(module)
        assert not missing, f"{rule} imported {sorted(missing)} but does not declare them as inputs"
        checked.add(rule)
    assert checked == ALL_JOBS - {"all", "smoke_imports"}


# -- what a change reruns: dry runs on the finished working directory --------------------------------


def _reorder(value):
    """Every mapping's keys in reverse order, recursively: the same settings, written differently."""
    if isinstance(value, dict):
        return {k: _reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reorder(v) for v in value]
    return value


def _set(config: dict, dotted: str, value) -> dict:
    config = copy.deepcopy(config)
    *parents, last = dotted.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return config


DOWNSTREAM_OF_TRAIN = {"train", "evaluate", "report", "all"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda c: _reorder(c), set()),
        # Spelled-out defaults (dflash/config.py) are the same settings.
        (lambda c: _set(_set(c, "train.weight_decay", 0.0), "data.prompts.split", "train"), set()),
        (lambda c: _set(c, "eval.max_new_tokens", 7), {"evaluate", "report", "all"}),
        (lambda c: _set(c, "eval.block_size", 3), {"evaluate", "report", "all"}),
        # Training loop settings: train and what follows; not the data, the target, or the compile-cache warmup.
        (lambda c: _set(c, "train.lr", 2.0e-3), DOWNSTREAM_OF_TRAIN),
        (lambda c: _set(c, "train.epochs", 3), DOWNSTREAM_OF_TRAIN),
        # A shape of the compiled training step: the warmup too.
        (lambda c: _set(c, "train.max_anchors", 2), {"warmup_cache"} | DOWNSTREAM_OF_TRAIN),
        (lambda c: _set(c, "drafter.num_hidden_layers", 2), {"warmup_cache"} | DOWNSTREAM_OF_TRAIN),
        # New samples: new batch shapes for the warmup to compile.
        (lambda c: _set(c, "data.generation.max_new_tokens", 12), {"prepare_data", "warmup_cache"} | DOWNSTREAM_OF_TRAIN),
        # How requests reach servers changes no response: nothing reruns.
        (lambda c: _set(_set(c, "data.generation.concurrency", 3), "data.generation.timeout", 30.0), set()),
        # How long ranks wait for each other changes nothing they compute.
        (lambda c: _set(c, "topology.collective_timeout_s", 120), set()),
        (lambda c: _set(c, "preflight.repro_fx_race.trials", 2), {"repro_fx_race"} | DOWNSTREAM_OF_TRAIN),
        (lambda c: _set(c, "target.dtype", "bfloat16"), {"prepare_target", "prepare_data", "warmup_cache"} | DOWNSTREAM_OF_TRAIN),
    ],
    ids=[
        "reordered-keys",
        "spelled-out-defaults",
        "eval-max_new_tokens",
        "eval-block_size",
        "train-lr",
        "train-epochs",
        "train-max_anchors",
        "drafter-layers",
        "data-generation",
        "data-transport",
        "collective-timeout",
        "preflight-race",
        "target-dtype",
    ],
)
def test_a_change_reruns_only_what_it_invalidates(e2e, change, expected):
    workdir = e2e["workdir"]
    original = (workdir / "config" / "config.yaml").read_text()
    try:
        write_config(workdir, change(copy.deepcopy(e2e["config"])))
        result = run_snakemake(workdir, e2e["env"], "-n", timeout=300)
    finally:
        (workdir / "config" / "config.yaml").write_text(original)
    assert jobs(result) == expected, readable(result.output, 120)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, expected",
    [
        # Nested values arrive as strings: each is parsed as the type its key declares.
        (["train={'lr': 0.002}"], DOWNSTREAM_OF_TRAIN),
        # An uncompiled drafter needs no compile-cache warmup.
        (["train={'compile': 'false', 'epochs': 3}"], DOWNSTREAM_OF_TRAIN),
        (["eval={'max_new_tokens': 7}", "preflight={'warmup': {'devices': ['cpu']}}"], {"evaluate", "report", "all"}),
    ],
    ids=["float", "bool-and-int", "int-and-list"],
)
def test_config_overrides_on_the_command_line(e2e, overrides, expected):
    result = run_snakemake(e2e["workdir"], e2e["env"], "-n", "--config", *overrides, timeout=300)
    assert jobs(result) == expected, readable(result.output, 120)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, named",
    [
        (["train={'epochs': 'three'}"], "train.epochs: expected int, got str 'three'"),
        (
            ["data={'prompts': {'source': '/nonexistent/prompts.jsonl'}}"],
            "data.prompts.source: '/nonexistent/prompts.jsonl' is a local path that does not exist",
        ),
    ],
    ids=["bad-value", "missing-file"],
)
def test_bad_command_line_config_is_named_before_any_job(e2e, overrides, named):
    result = run_snakemake(e2e["workdir"], e2e["env"], "-n", "--config", *overrides, check=False, timeout=300)
    assert result.returncode != 0 and named in result.output, readable(result.output)


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, expected",
    [
        ("report/build", {"report", "all"}),
        ("decoding/generate", {"evaluate", "report", "all"}),
        ("tracking", DOWNSTREAM_OF_TRAIN),
        # Training state on disk and where hidden states come from: the training loop only, never the preflight stages.
        ("checkpoint", DOWNSTREAM_OF_TRAIN),
        ("features", DOWNSTREAM_OF_TRAIN),
        ("data", {"prepare_data", "warmup_cache"} | DOWNSTREAM_OF_TRAIN),
        ("preflight/race", {"repro_fx_race"} | DOWNSTREAM_OF_TRAIN),
        # smoke_imports runs the drafter's training step on each attention backend, as warmup_cache and train do.
        ("objective", {"smoke_imports", "repro_fx_race", "warmup_cache"} | DOWNSTREAM_OF_TRAIN),
    ],
    ids=["report", "decoding", "tracking", "checkpoint", "features", "data", "preflight-race", "objective"],
)
def test_a_code_change_reruns_the_jobs_that_run_it(e2e, module, expected):
    """The package files a job runs are its inputs (the working directory is a copy of the project: its package may be edited)."""
    path = e2e["workdir"] / "dflash" / f"{module}.py"
    text, stat = path.read_text(), path.stat()
    try:
        path.write_text(text + "\n# an edit\n")
        result = run_snakemake(e2e["workdir"], e2e["env"], "-n", timeout=300)
    finally:
        path.write_text(text)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert jobs(result) == expected, readable(result.output, 120)


@pytest.mark.slow
def test_a_cluster_job_runs_its_own_rule_only(e2e):
    """A SLURM job's own Snakemake (``--target-jobs <its job> --allowed-rules <its rule>``) runs that job alone, even
    where an upstream job looks outdated to it (here prepare_data, after an edit of the code it runs): never the
    upstream job inside the job's allocation, where it fails and Snakemake deletes the upstream job's outputs."""
    path = e2e["workdir"] / "dflash" / "data.py"
    text, stat = path.read_text(), path.stat()
    try:
        path.write_text(text + "\n# an edit\n")
        args = ["-n", "--target-jobs", "warmup_cache:", "--allowed-rules", "warmup_cache", "--force"]
        result = run_snakemake(e2e["workdir"], e2e["env"], *args, timeout=300)
    finally:
        path.write_text(text)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert jobs(result) == {"warmup_cache"}, readable(result.output, 120)


def _planned_resources(result: subprocess.CompletedProcess) -> list[tuple[str, dict[str, str]]]:
    """Each planned job's rule, wildcards and resources, from a dry run's job listing."""
    planned = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", result.output):
        header = _JOB.match(block)
        resources = re.search(r"^\s+resources: (.*)$", block, re.MULTILINE)
        wildcards = re.search(r"^\s+wildcards: (.*)$", block, re.MULTILINE)
        if header and resources:
            values = dict(item.split("=", 1) for item in resources.group(1).split(", "))
            planned.append((header.group(1), values | ({"wildcards": wildcards.group(1)} if wildcards else {})))
    return planned


def test_the_slurm_profile_plans_gpus_for_every_job_that_touches_one(tmp_path):
    """A dry run of the two-node SLURM config: every job on a device asks for the GPUs it uses."""
    workdir = make_workdir(tmp_path / "work")
    for name in ("gpu-8x.yaml", "slurm-2x8.yaml"):
        shutil.copy2(ROOT / "config" / name, workdir / "config" / name)
    args = ["-n", "-p", "--profile", "workflow/profiles/slurm", "--configfile", "config/gpu-8x.yaml", "config/slurm-2x8.yaml"]
    result = run_snakemake(workdir, snakemake_env(tmp_path / "scratch"), *args, timeout=300)
    planned = _planned_resources(result)
    gpus = {}
    for rule, resources in planned:
        key = f"{rule}/{resources['wildcards']}" if "wildcards" in resources else rule
        gpus[key] = int(resources.get("gpu", 0))
    assert gpus["env_check"] == 8  # counts the node's GPUs
    assert gpus["smoke_imports"] == gpus["repro_fx_race"] == gpus["evaluate"] == 1
    # One job warms the 8 devices of a node, each compiling for its own cuda:N: it sees 8 GPUs, not 1 + 2 + ... + 8.
    assert gpus["warmup_cache"] == 8
    assert gpus["prepare_data"] == gpus["train"] == 16  # every GPU of both nodes regenerates, then trains
    resources = dict(planned)
    assert resources["train"]["nodes"] == resources["prepare_data"]["nodes"] == "2"
    assert int(resources["prepare_data"]["runtime"]) >= 1440 and int(resources["train"]["runtime"]) >= 1440
    assert gpus["prepare_target"] == gpus["report"] == 0
    # The hub's prompts are fetched once, by a local rule, and every regenerating rank reads that copy.
    copy = "results/data/hub/HuggingFaceH4--ultrachat_200k--train_sft.parquet"
    assert gpus["fetch_dataset/dataset=HuggingFaceH4--ultrachat_200k--train_sft"] == 0
    assert re.search(rf"prepare-data --data '[^']*\"source\":\"{re.escape(copy)}\"", result.output)
