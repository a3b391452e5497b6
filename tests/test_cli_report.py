"""`advisor report` renders the committed H200 results into one HTML file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_report_from_result_files(tmp_path):
    out = tmp_path / "r.html"
    proc = subprocess.run(
        [sys.executable, "-m", "advisor.cli", "report",
         "--analysis", str(RESULTS / "h200-analysis-2026-12-02.json"),
         "--bench", str(RESULTS / "h200-apply-2026-12-02.json"), "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert page.count("<svg") >= 2 and "add_rms_norm" in page


def test_report_bad_json_is_one_line(tmp_path):
    bad = tmp_path / "a.json"
    bad.write_text("{nope")
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "report", "--analysis", str(bad),
                           "--out", str(tmp_path / "r.html")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "cannot read JSON" in proc.stderr
    assert not (tmp_path / "r.html").exists()


ANALYSIS = RESULTS / "h200-analysis-2026-12-02.json"


@pytest.mark.parametrize("content,says", [
    ([], "not an advisor.analysis JSON"),
    ({"kind": "advisor.bench", "schema_version": 1}, "not an advisor.analysis JSON"),
    ({"kind": "advisor.analysis", "schema_version": 99}, "schema_version 99"),
    ({"kind": "advisor.analysis", "schema_version": 1, "shapes": "x"}, "$.shapes"),
    ({"kind": "advisor.analysis", "schema_version": 1, "shapes": [1]}, "$.shapes"),
    ({"kind": "advisor.analysis", "schema_version": 1, "shapes": [{}]}, "$.shapes[0]"),
    ({"kind": "advisor.analysis", "schema_version": 1, "shapes": [{"seq_len": 1, "candidates": [1]}]},
     "$.shapes[0]"),
])
def test_report_wrong_files_are_one_line(tmp_path, content, says, cli):
    bad = tmp_path / "a.json"
    bad.write_text(json.dumps(content))
    proc = cli("report", "--analysis", str(bad), "--out", "r.html", cwd=tmp_path)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "r.html").exists()


def test_report_refuses_a_missing_journal_and_an_unwritable_out(tmp_path, cli):
    proc = cli("report", "--analysis", str(ANALYSIS), "--journal", "typo.journal", "--out", "r.html",
               cwd=tmp_path)
    assert proc.returncode == 2 and "no such tune journal" in proc.stderr, proc.stderr
    assert not (tmp_path / "typo.journal").exists() and not (tmp_path / "r.html").exists()
    (tmp_path / "file").write_text("")
    proc = cli("report", "--analysis", str(ANALYSIS), "--out", "file/r.html", cwd=tmp_path)
    assert proc.returncode == 2 and "is not a folder" in proc.stderr, proc.stderr


def test_report_prints_predicted_vs_measured_from_a_leave_one_out(tmp_path):
    """Session 20's H100 analysis and ablation (same machine): the console table, unfolded
    in a log (not a terminal), and the count within ±25% per length."""
    proc = subprocess.run(
        [sys.executable, "-m", "advisor.cli", "report",
         "--analysis", str(RESULTS / "h100-s20A-analysis.json"),
         "--bench", str(RESULTS / "h100-s20A-ablate-h100-recipe.json"), "--out", str(tmp_path / "r.html")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "add_rms_norm_linear" in proc.stdout  # a family name in full: the table was not folded
    assert "1 tokens, leave-one-out: 3 of 7 families within ±25%" in proc.stdout
    assert "512 tokens, leave-one-out: 0 of 7 families within ±25%" in proc.stdout
    page = (tmp_path / "r.html").read_text()
    assert "Predicted within ±25% of measured: 3 of 7 families measured leave-one-out." in page
