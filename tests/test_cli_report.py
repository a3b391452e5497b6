"""`advisor report` renders the committed H200 results into one HTML file."""

import subprocess
import sys
from pathlib import Path

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
