"""The report's inputs: a missing artifact is named, with the stage to rerun, before anything is written."""

from __future__ import annotations

import pytest

from dflash.errors import InputError
from dflash.report import build_report


def test_the_report_names_a_missing_evaluation_file_and_writes_nothing(tmp_path):
    for name in ("metrics.csv", "card.json", "summary.json"):
        (tmp_path / name).write_text("{}\n")
    evaluated = tmp_path / "eval"
    evaluated.mkdir()
    (evaluated / "summary.csv").write_text("set,prompts\nchat,2\n")
    (evaluated / "chat.csv").write_text("prompt_id\na\n")
    out = tmp_path / "report"
    # An evaluation from before verify_cost.json was written beside its summary.
    with pytest.raises(InputError, match=r"eval/verify_cost\.json, which do not exist: rerun"):
        build_report(tmp_path / "metrics.csv", tmp_path / "summary.json", tmp_path / "card.json", evaluated / "summary.csv", out)
    assert not out.exists()
    (evaluated / "chat.csv").unlink()
    with pytest.raises(InputError, match=r"eval/chat\.csv, .*eval/verify_cost\.json"):
        build_report(tmp_path / "metrics.csv", tmp_path / "summary.json", tmp_path / "card.json", evaluated / "summary.csv", out)
