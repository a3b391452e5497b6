"""The HTML report: rendered from the real H200 results, checked for structure and escaping,
then loaded in headless Chromium (skipped where /usr/bin/chromium is absent)."""

import copy
import json
import os
import re
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest

from advisor.report.html import render_html, write_html

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CHROMIUM = Path("/usr/bin/chromium")
EVIL = '<script>alert("x")</script>'


@pytest.fixture(scope="module")
def analysis():
    return json.loads((RESULTS / "h200-analysis-2026-12-02.json").read_text())


@pytest.fixture(scope="module")
def bench():
    return json.loads((RESULTS / "h200-apply-2026-12-02.json").read_text())


def _history():
    """Two buckets; bucket 2048 has a compile error and a timeout among its trials."""
    out = []
    for bucket, base in ((128, 9.0), (2048, 18.0)):
        for n in range(8):
            failure = {3: "compile_error", 6: "timeout"}.get(n) if bucket == 2048 else None
            out.append({"bucket": bucket, "number": n, "state": "FAIL" if failure else "COMPLETE",
                        "value": None if failure else base - 0.3 * n + 0.2 * (n % 3), "failure": failure,
                        "done": n + 1, "best_ms": None})
    return out


RECIPE = {"schema_version": 1, "kind": "advisor.recipe", "buckets": [
    {"max_len": 128, "plan": {"fusions": ["add_rms_norm", "rope"]}, "measured": {"unfused_ms": 9.5, "tuned_ms": 7.0}},
    {"max_len": 2048, "plan": {"fusions": ["add_rms_norm"]}, "measured": {"unfused_ms": 18.4, "tuned_ms": 17.0}}]}


@pytest.fixture(scope="module")
def page(analysis, bench):
    return render_html(analyses=[analysis], bench=bench, recipe=RECIPE, history=_history(),
                       title="llama_hf on H200")


def test_page_is_self_contained_with_valid_svg_charts(page):
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    svgs = re.findall(r"<svg\b.*?</svg>", page, flags=re.S)
    assert len(svgs) == 4  # budget, roofline, one history chart per bucket
    for svg in svgs:
        ET.fromstring(svg)  # well-formed XML: every escape and tag is closed
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=|@import|url\((?!#)""", page)  # nothing loaded from outside


def test_budget_roofline_and_after_fusion_bars_come_from_the_data(page, analysis):
    for key in ("launch/host", "memory", "compute", "idle/sync"):
        assert key in page
    assert "advisor (after fusion, measured)" in page and "eager (before fusion, measured)" in page
    ms = sum(analysis["shapes"][0]["budget"]["categories"].values())
    assert f"{ms:.3f} ms" in page
    c = analysis["ceilings"]
    assert f'{c["matmul_tflops"]["bfloat16"]:.3g} TFLOP/s · {c["copy_gbps"]:.0f} GB/s' in page
    plotted = sum(1 for s in analysis["shapes"] for o in s["budget"]["ops"]
                  if o["intensity"] > 0 and o["achieved_tflops"] > 0)
    assert page.count("<circle") == plotted + sum(t["state"] == "COMPLETE" for t in _history())


def test_every_candidate_appears_with_the_measured_plan_saving(page, analysis, bench):
    tables = re.findall(r"<h3>Fusion candidates at (\d+) tokens</h3>(<table>.*?</table>)", page, flags=re.S)
    assert [int(t) for t, _ in tables] == [s["seq_len"] for s in analysis["shapes"]]
    for s, (_, table) in zip(analysis["shapes"], tables):
        for c in s["candidates"]:
            assert f"<td>{c['family']}</td>" in table
        ms = {r["variant"]: r["ms"] for r in bench["rows"] if r["shape"] == s["seq_len"]}
        assert f"{ms['eager'] - ms['advisor']:.3f} ms" in table  # bench: eager - advisor
    assert "analysis only" in page and "applied at 32 sites" in page


def test_history_marks_failures_and_bench_table_lists_every_variant(page, bench):
    assert "bucket ≤ 2048 tokens: 8 trials, 2 failed" in page and "8 trials, 0 failed" in page
    assert "(compile_error)" in page and "(timeout)" in page
    assert "unfused 18.4 ms" in page  # the recipe's baseline for that bucket
    for variant in {r["variant"] for r in bench["rows"]}:
        assert f"<td>{variant}</td>" in page


def test_text_from_the_inputs_is_escaped(analysis):
    a = copy.deepcopy(analysis)
    op = next(o for o in a["shapes"][0]["budget"]["ops"] if o["achieved_tflops"] > 0)
    op["module"] = EVIL
    a["shapes"][0]["candidates"][0]["family"] = EVIL
    a["model"] = EVIL
    page = render_html(analyses=[a], title=EVIL)
    assert "<script" not in page
    assert page.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;") >= 5  # title x2, model, op, family


def test_without_bench_or_recipe_measured_savings_are_dashes(analysis):
    page = render_html(analyses=[analysis], title="t")
    assert "Tuning history" not in page and "<h2>Bench</h2>" not in page and "plan total" not in page
    assert "measured saving" in page and "—" in page


def test_write_html_is_atomic_and_leaves_no_temp_file(tmp_path, page):
    out = write_html(tmp_path / "sub" / "report.html", page)
    assert out.read_text(encoding="utf-8") == page
    assert [p.name for p in out.parent.iterdir()] == ["report.html"]


# ---- headless Chromium -----------------------------------------------------------------

def _png_pixels(data: bytes) -> np.ndarray:
    """(H, W, C) uint8 from an 8-bit, non-interlaced RGB/RGBA PNG (enough for a screenshot)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, head = 8, b"", None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", data[pos + 8:pos + 21])
        elif kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    w, h, depth, color, _, _, interlace = head
    assert depth == 8 and color in (2, 6) and interlace == 0, head
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * bpp)
    out, prev = np.zeros((h, w * bpp), np.uint8), np.zeros(w * bpp, np.uint8)
    for y in range(h):
        kind, row = raw[y, 0], raw[y, 1:]
        if kind == 0:
            cur = row.copy()
        elif kind == 1:  # Sub: running sum per channel, mod 256
            cur = row.reshape(w, bpp).cumsum(axis=0, dtype=np.uint8).ravel()
        elif kind == 2:  # Up
            cur = row + prev
        else:  # Average / Paeth: sequential along the row
            cur, r, p = bytearray(w * bpp), row.tolist(), prev.tolist()
            for i in range(w * bpp):
                a = cur[i - bpp] if i >= bpp else 0
                c = p[i - bpp] if i >= bpp else 0
                if kind == 3:
                    pred = (a + p[i]) // 2
                else:
                    pa, pb, pc = abs(p[i] - c), abs(a - c), abs(a + p[i] - 2 * c)
                    pred = a if pa <= pb and pa <= pc else (p[i] if pb <= pc else c)
                cur[i] = (r[i] + pred) & 0xFF
            cur = np.frombuffer(bytes(cur), np.uint8)
        out[y], prev = cur, cur
    return out.reshape(h, w, bpp)


def test_page_loads_in_headless_chromium_without_errors(tmp_path, page):
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (.ci/install-chromium.sh installs it)")
    html_path = write_html(tmp_path / "report.html", page)
    png = tmp_path / "shot.png"
    base = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    url = html_path.as_uri()
    env = {**os.environ, "HOME": str(tmp_path)}
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=60, env=env)
    shot = subprocess.run([*base, f"--screenshot={png}", "--window-size=1200,1600", url],
                          capture_output=True, text=True, timeout=60, env=env)
    assert dom.returncode == 0 and shot.returncode == 0, dom.stderr[-2000:] + shot.stderr[-2000:]
    assert "<h1>llama_hf on H200</h1>" in dom.stdout and dom.stdout.count("<svg") == 4
    bad = [line for line in (dom.stderr + shot.stderr).splitlines()
           if ("Uncaught" in line or "CONSOLE" in line) and (url in line or "report.html" in line)]
    assert not bad, bad
    pixels = _png_pixels(png.read_bytes())
    assert pixels.shape[:2] == (1600, 1200)
    colors = np.unique(pixels[..., :3].reshape(-1, 3), axis=0)
    inked = (pixels[..., :3] < 200).any(axis=-1).mean()
    assert len(colors) > 8 and inked > 0.02, (len(colors), inked)  # bars, text and charts drawn
