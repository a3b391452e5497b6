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


def _decode_bench():
    """A bench --phase decode --generate 16 result at contexts 512 and 2048: the advisor row
    carries a verdict; torch.compile[reduce-overhead] failed (a forward row with ms None, and
    a generation row with ms_per_token None), with an error that must be escaped."""
    rows, gen = [], []
    for t, eager_ms in ((512, 8.0), (2048, 10.0)):
        rows += [{"shape": t, "variant": "eager", "ms": eager_ms, "kernels": 345, "speedup_vs_eager": 1.0},
                 {"shape": t, "variant": "advisor", "ms": eager_ms * 0.8, "kernels": 200,
                  "speedup_vs_eager": 1.25, "max_error": 0.03, "rel_error": 0.004, "matches_eager": True,
                  "verdict": "max |err| 0.03 beyond atol; as accurate as eager: vs fp32 0.011 (eager 0.012)"},
                 {"shape": t, "variant": "torch.compile[reduce-overhead]", "ms": None,
                  "error": f"RuntimeError: {EVIL} (at cache.py:12)", "speedup_vs_eager": None}]
        tokens = [[987654 + i for i in range(16)]]  # never shown
        gen += [{"shape": t, "variant": "eager", "new_tokens": 16, "ms_per_token": eager_ms,
                 "tokens_per_s": 1e3 / eager_ms, "speedup_vs_eager": 1.0, "tokens": tokens},
                {"shape": t, "variant": "advisor", "new_tokens": 16, "ms_per_token": eager_ms * 0.8,
                 "tokens_per_s": 1e3 / (eager_ms * 0.8), "speedup_vs_eager": 1.25,
                 "tokens_match": t == 512, "first_divergence": None if t == 512 else 3,
                 "compared_steps": 16 if t == 512 else 4, "max_error": 0.0625, "rel_error": 0.00213,
                 "logits_match": True, "matches_eager": True, "tokens": tokens},
                {"shape": t, "variant": "torch.compile[reduce-overhead]", "new_tokens": 16,
                 "ms_per_token": None, "tokens_per_s": None, "speedup_vs_eager": None,
                 "error": f"BackendCompilerFailed: {EVIL} (at graphs.py:7)", "matches_eager": False}]
    return {"schema_version": 1, "kind": "advisor.bench", "environment": {"torch": "2.5"},
            "meta": {"phase": "decode", "generate": 16, "shapes": [512, 2048]}, "rows": rows,
            "generation": gen, "applied": []}


@pytest.fixture(scope="module")
def gen_page(analysis):
    return render_html(analyses=[analysis], bench=_decode_bench(), title="decode <generate>")


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


def test_generation_section_has_a_chart_and_table_per_context(gen_page):
    part = gen_page[gen_page.index("<h3>Greedy generation (decode)</h3>"):]
    heads = re.findall(r"<h4>context (\d+) tokens · 16 new tokens</h4>(<svg.*?</svg>)(<table>.*?</table>)",
                       part, flags=re.S)
    assert [int(t) for t, _, _ in heads] == [512, 2048]
    for t, chart, table in heads:
        ET.fromstring(chart)
        assert chart.count("<rect") == 1 + 2  # frame, eager and advisor bars
        assert "torch.compile[reduce-overhead]: failed (BackendCompilerFailed: &lt;script&gt;" in chart
        eager = {"512": 8.0, "2048": 10.0}[t]
        assert f"{eager:.3f}" in table and f"{eager * 0.8:.3f}" in table and f"{1e3 / eager:.1f}" in table
        assert "1.25×" in table and "2.13e-03" not in table and "0.00213" in table
        assert table.count("<tr>") == 4 and table.count("reference") == 2  # header + 3 variants
        assert "<th>error</th>" in table and "BackendCompilerFailed: &lt;script&gt;" in table
    assert "all 16 same" in heads[0][2] and "differ from step 3" in heads[1][2]
    assert "logits within tolerance up to the divergence; tokens differ" in heads[1][2]
    assert "987654" not in gen_page  # the generated tokens are not rendered


def test_bench_table_shows_verdicts_and_failed_compile_rows(gen_page):
    bench = gen_page[gen_page.index("<h2>Bench</h2>"):gen_page.index("<h3>Greedy generation")]
    assert "<th>verdict</th>" not in bench and bench.count("as accurate as eager: vs fp32 0.011") == 2
    assert bench.count('<span class="bad">failed</span>') == 2
    assert bench.count("RuntimeError: &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; (at cache.py:12)") == 2
    assert "<script" not in gen_page and "<title>decode &lt;generate&gt;</title>" in gen_page
    for chart in re.findall(r"<svg\b.*?</svg>", gen_page, flags=re.S):
        ET.fromstring(chart)


def test_generation_only_bench_and_long_errors_are_clipped():
    b = _decode_bench()
    b["rows"] = []
    b["generation"][2]["error"] = "E" * 1000 + EVIL
    page = render_html(analyses=[], bench=b, title="t")
    assert page.count("<svg") == 2 and "<script" not in page
    assert "E" * 300 + "…" in page and f'title="{"E" * 1000}&lt;script&gt;' in page


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


@pytest.mark.parametrize("which,h1,charts", [("page", "llama_hf on H200", 4),
                                             ("gen_page", "decode &lt;generate&gt;", 4)])
def test_page_loads_in_headless_chromium_without_errors(tmp_path, request, which, h1, charts):
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (.ci/install-chromium.sh installs it)")
    page = request.getfixturevalue(which)
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
    assert f"<h1>{h1}</h1>" in dom.stdout and dom.stdout.count("<svg") == charts
    bad = [line for line in (dom.stderr + shot.stderr).splitlines()
           if ("Uncaught" in line or "CONSOLE" in line) and (url in line or "report.html" in line)]
    assert not bad, bad
    pixels = _png_pixels(png.read_bytes())
    assert pixels.shape[:2] == (1600, 1200)
    colors = np.unique(pixels[..., :3].reshape(-1, 3), axis=0)
    inked = (pixels[..., :3] < 200).any(axis=-1).mean()
    assert len(colors) > 8 and inked > 0.02, (len(colors), inked)  # bars, text and charts drawn
