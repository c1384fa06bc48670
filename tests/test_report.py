"""The report page, built from a small run's artifacts with known numbers: what it shows under which headers, that
it holds everything it shows, and (where Chromium is installed) that a browser lays it out whole."""

from __future__ import annotations

import json
import os
import re

import pandas as pd
import pytest
from conftest import require_chromium

from dflash.errors import InputError
from dflash.report.browser import check_page
from dflash.report.build import RunArtifacts, build_report
from dflash.report.page import duration

# Plain decoding 10 and 12 ms per token on the two prompts; the arms' mean times give speedups of 11/7 (drafter),
# 11/7.5 (lookup) and 11/4.75 (hybrid). Per prompt, the drafter's 10/8 and 12/6 have quartiles 1.4375 and 1.8125,
# lookup's 2.0 and 1.2 have 1.4 and 1.8, the hybrid's 2.5 and 2.18 have 2.26 and 2.42.
PER_PROMPT = {
    "prompt_id": ["a", "b"],
    "tpot_ar_ms": [10.0, 12.0],
    "tpot_dflash_ms": [8.0, 6.0],
    "tpot_pld_ms": [5.0, 10.0],
    "tpot_hybrid_ms": [4.0, 5.5],
    "acceptance_lengths": ["1 2 3", "2 2"],
    "per_position_acceptance": ["0.5 0.25 0.1", "0.6 0.2 0.0"],
    "predictions": ["1:0.5:1 2:0.3:0", "1:0.7:1"],
}
SUMMARY = {
    "set": ["chat"],
    "prompts": [2],
    "block_size": [4],
    "tau": [1.5],
    "speedup": [11 / 7],
    "tpot_ar_ms": [11.0],
    "lossless": [True],
    "pld_tau": [1.8],
    "pld_speedup": [11 / 7.5],
    "pld_lossless": [True],
    "hybrid_tau": [2.1],
    "hybrid_speedup": [11 / 4.75],
    "hybrid_lossless": [False],
    "device": ["cpu"],
    "target_dtype": ["float32"],
}
TRAIN = {
    "steps": 1000,
    "resumed_from": 0,
    "final_loss": 2.5,
    "seconds": 1321.0,
    "tokens_per_second": 12345.6,
    "first_step_seconds": 40.2,
    "validation_tau": 1.54,
    "validation_accuracy": [0.42, 0.1, 0.02],
    "topology": "colocated 1x1 cpu",
    "world": 1,
    "threads": 2,
    "draft_vocab": 8192,
    "draft_vocab_coverage": 0.951,
    "compile_cache": {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 0},
    "samples": 3200,
}
TARGET = {"source": "embedded", "architecture": "LlamaForCausalLM", "num_layers": 30, "hidden_size": 576, "num_attention_heads": 9}
TARGET |= {"vocab_size": 49152, "parameters": 134515008, "dtype": "float32"}
BENCHMARK_HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def small_run(root) -> RunArtifacts:
    (root / "train").mkdir(parents=True)
    (root / "eval").mkdir()
    (root / "benchmarks").mkdir()
    metrics = pd.DataFrame({"step": [10, 20], "loss": [4.0, 3.0], "acc_1": [0.2, 0.4], "acc_2": [0.1, 0.2], "acc_3": [0.0, 0.1]})
    metrics["val_acc_1"], metrics["val_tau"] = [None, 0.42], [None, 1.54]
    metrics.to_csv(root / "train" / "metrics.csv", index=False)
    (root / "train" / "summary.json").write_text(json.dumps(TRAIN))
    (root / "card.json").write_text(json.dumps({"source": "sharegpt", "prompts": 3300, "samples": 3200}))
    pd.DataFrame(SUMMARY).to_csv(root / "eval" / "summary.csv", index=False)
    pd.DataFrame(PER_PROMPT).to_csv(root / "eval" / "chat.csv", index=False)
    cost = {"relative": [1.0, 1.1, 1.2, 1.3], "step_ms": 7.5, "decoded": {"1": {"relative": 1.0, "verifies": 10}}, "learnt": [1.0, 1.1, 1.2, 1.3]}
    (root / "eval" / "verify_cost.json").write_text(json.dumps(cost))
    (root / "env.json").write_text(json.dumps({"summary": "env_check: ok, torch 2.13.0+cpu", "cuda": {"device_count": 0, "built_with": None}}))
    (root / "target.json").write_text(json.dumps(TARGET))
    (root / "benchmarks" / "train.tsv").write_text(BENCHMARK_HEADER + "1321.0\t0:22:01\t2048.0\t1\t1\t1\t0\t0\t90\t1300\n")
    (root / "benchmarks" / "evaluate.tsv").write_text(BENCHMARK_HEADER + "3725.0\t1:02:05\tNA\t1\t1\t1\t0\t0\t90\t1300\n")
    # A previous report's own benchmark: stale by the time the page is rebuilt, and not shown.
    (root / "benchmarks" / "report.tsv").write_text(BENCHMARK_HEADER + "3.0\t0:00:03\t300\t1\t1\t1\t0\t0\t90\t3\n")
    finished = 1_780_000_000
    os.utime(root / "benchmarks" / "train.tsv", (finished, finished))
    os.utime(root / "benchmarks" / "evaluate.tsv", (finished + 3725, finished + 3725))
    return RunArtifacts(
        root / "train" / "metrics.csv",
        root / "train" / "summary.json",
        root / "card.json",
        root / "eval" / "summary.csv",
        root / "env.json",
        root / "target.json",
        root / "benchmarks",
    )


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    written = build_report(small_run(root), {"train.lr": 0.002, "eval.sets": ["chat"]}, root / "report")
    return written[-1]


def test_the_page_shows_each_arms_speedup_with_its_spread_and_tau_under_readable_headers(page):
    text = page.read_text()
    for header in ("Speedup vs plain decoding (×)", "Tokens accepted per verify step (τ)", "Plain decoding (ms per token)", "prompt lookup"):
        assert f">{header}</th>" in text, header
    row = text[text.index("<td>chat</td>") :].split("</tr>")[0]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells == [
        "chat",
        "2",
        "1.57×<br><small>1.44–1.81</small>",
        "1.47×<br><small>1.40–1.80</small>",
        "2.32×<br><small>2.26–2.42</small>",
        "1.50",
        "1.80",
        "2.10",
        "11.0",
        "no: hybrid",
    ]
    assert '<td class="fail">no: hybrid</td>' in row


def test_the_page_shows_the_training_the_machine_the_config_and_each_stages_duration(page):
    text = page.read_text()
    assert "<th>Steps</th><td>1,000</td>" in text
    assert "<th>Wall time of the steps</th><td>22 min 01 s (the first 40.2 s, compiling)</td>" in text
    assert "<th>Draft vocabulary</th><td>8,192 tokens, 95.1% of response tokens</td>" in text
    assert "<th>Validation accuracy per draft position</th><td>0.42 · 0.10 · 0.02</td>" in text
    assert "<th>Parameters</th><td>134.5 M</td>" in text
    assert "<th>Preflight</th><td>env_check: ok, torch 2.13.0+cpu</td>" in text
    assert "<th>train.lr</th><td>0.002</td>" in text and "<th>eval.sets</th><td>[&quot;chat&quot;]</td>" in text
    # In the order the stages finished.
    stages = text[text.index('rowspan="1">Stage</th>') :].split("</table>")[0]
    assert re.findall(r"<tr><td>(\w+)</td><td class=\"num\">([^<]+)</td><td class=\"num\">([^<]+)</td>", stages) == [
        ("train", "22 min 01 s", "2.0 GiB"),
        ("evaluate", "1 h 02 min", "—"),
    ]
    assert '<td>all stages above</td><td class="num">1 h 24 min</td>' in stages


def test_the_page_holds_every_plot_and_fetches_nothing(page):
    text = page.read_text()
    images = re.findall(r'<img src="([^"]+)" alt="([^"]+)"', text)
    assert sorted(alt for _, alt in images) == sorted(p.name for p in page.parent.glob("*.png"))
    assert len(images) == 6 and all(src.startswith("data:image/png;base64,") for src, _ in images)
    assert "<script" not in text and "http" not in text and "<link" not in text


@pytest.mark.parametrize("seconds, shown", [(None, "—"), (0.25, "250 ms"), (13.34, "13.3 s"), (61, "1 min 01 s"), (3599.6, "1 h 00 min"), (7384, "2 h 03 min")])
def test_durations_read_as_a_person_reads_them(seconds, shown):
    assert duration(seconds) == shown


def test_the_report_names_a_missing_evaluation_file_and_writes_nothing(tmp_path):
    artifacts = small_run(tmp_path)
    (tmp_path / "eval" / "verify_cost.json").unlink()
    out = tmp_path / "report"
    # An evaluation from before verify_cost.json was written beside its summary.
    with pytest.raises(InputError, match=r"eval/verify_cost\.json, which do not exist: rerun"):
        build_report(artifacts, {}, out)
    assert not out.exists()
    (tmp_path / "eval" / "chat.csv").unlink()
    with pytest.raises(InputError, match=r"eval/chat\.csv, .*eval/verify_cost\.json"):
        build_report(artifacts, {}, out)


def test_chromium_lays_the_page_out_whole_and_keeps_a_screenshot(page, tmp_path):
    require_chromium()
    verdict = check_page(page, tmp_path / "page.png", tmp_path / "check.json")
    assert verdict["ok"] and verdict["problems"] == [] and verdict["overflows"] == []
    assert len(verdict["images"]) == 6 and all(image["width"] > 0 for image in verdict["images"])
    assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "check.json").read_text())["ok"] is True


def test_chromium_names_an_image_that_did_not_load_and_a_cell_that_overflows(tmp_path):
    require_chromium()
    broken = tmp_path / "broken.html"
    broken.write_text(
        '<!doctype html><html><body style="width:300px"><table><tr><td style="max-width:100px">'
        + "x" * 400
        + '</td></tr></table><img src="missing.png" alt="missing.png"></body></html>'
    )
    with pytest.raises(InputError, match=r"image missing\.png did not load; table 0: 'x+' overflows") as failure:
        check_page(broken, tmp_path / "broken.png", tmp_path / "check.json")
    assert "screenshot" in str(failure.value)
    written = json.loads((tmp_path / "check.json").read_text())
    assert written["ok"] is False and (tmp_path / "broken.png").is_file()
