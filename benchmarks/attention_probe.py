"""Prefill attention vs SDPA on the H200: which tile config of our kernel is fastest, and is
every one of them right?

At Llama-3-8B shapes (32 q / 8 kv heads, head dim 128, bf16, batch 1):
  check   every config against `attention.reference` (fp32) at 512 / 2048 / 8192 tokens
          causal and at one non-causal Tq != Tk shape with partial blocks (1000 x 1500);
          bf16 tolerance of advisor.kernels.testing; a config that fails to compile or to
          match is reported and the run goes on.
  time    SDPA (best backend, enable_gqa) on rotated q, k; ours on the same rotated q, k with
          the default config and with each listed config (exactly that config: `keep` is
          reported, not applied); ours_rope: the whole launch with RoPE (from 512 tokens k
          rotated once by a rope launch, q on load; the default config); ours_rope_qk:
          q and k rotated by one rope_qk launch, then the kernel (the form before) against
          sdpa_rope: RoPE then SDPA as `attention.unfused` spells it, eager and
          torch.compile'd (issue 6: ours + RoPE >= SDPA + RoPE); and what a traced model
          runs, the causal mask materialised (`masked_rows`). TFLOP/s = attention.flops (causal pairs · 4 · Hq · D) / time.
Device time from CUDA-graph replays (triton.testing.do_bench_cudagraph, median), as the
probe's earlier runs. One summary line per config; JSON attention_probe.json under $OUT.

    python benchmarks/attention_probe.py [--tokens 512,2048,8192] [--configs 128x128w8s2,...]
        [--no-check] [--rep 100]

A config is BLOCK_MxBLOCK_NwWARPSsSTAGES (e.g. 128x64w8s3, the old default); `--configs
none` times only SDPA and the default.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention, rope  # noqa: E402
from advisor.kernels._triton import resources  # noqa: E402
from advisor.kernels.masks import mark_if_causal  # noqa: E402
from advisor.kernels.space import encode  # noqa: E402
from advisor.kernels.testing import max_abs_error, max_violation, rel_error, tolerance  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

# BLOCK_M x BLOCK_N, warps, stages. 128x128w8s3 is the Triton tutorial's Hopper tile (224 KB
# of shared memory by our estimate); 128x64w8s3 was the default before BLOCK_N 128.
CONFIGS = ("128x128w8s2", "128x128w8s3", "128x64w8s3", "128x64w8s2", "64x128w4s3",
           "64x128w4s2", "64x64w4s3")
CHECK_NONCAUSAL = (1000, 1500)  # (Tq, Tk)
ROPE_CHECK_MAX = 2048  # the fp32 reference's scores at 8192 tokens are 8.6 GB
DEVICE = torch.device("cuda")
HEADS = {"batch": 1, "hq": 32, "hkv": 8, "d": 128}  # Llama-3-8B


def parse(name: str) -> dict[str, int]:
    """`128x64w8s3` (pointer loads) or `128x64w8s3t` (k, v by TMA descriptor)."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(t?)", name)
    if not m:
        raise SystemExit(f"bad config {name!r}: want BLOCK_MxBLOCK_NwWARPSsSTAGES[t], e.g. 128x64w8s3t")
    bm, bn, w, s = (int(g) for g in m.groups()[:4])
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "SPLITS": 1,
            "TMA": int(m.group(5) == "t")}


def inputs(tq: int, tk: int, causal: bool):
    """Rotated bf16 q (1, 32, Tq, 128), k (1, 8, Tk, 128) (rope_qk, as the kernel gets them
    from 512 queries), v as HF's transposed view; and the unrotated q, k and tables."""
    dims = {**HEADS, "tq": tq, "tk": tk, "causal": int(causal), "rope": 1}
    q, k, v, cos, sin, _, _, scale, _, _ = attention.make_inputs(
        dims, torch.bfloat16, DEVICE, torch.Generator().manual_seed(tq * 7 + tk))
    if tq == tk:
        qr, kr = rope.launch_rope_qk(q, k, cos, sin)
    else:
        qr = rope.reference(q, q[:, :1], cos[..., tk - tq:, :], sin[..., tk - tq:, :], False)[0]
        kr = rope.reference(k, k[:, :1], cos, sin, False)[0]
    return qr, kr, v, scale, (q, k, cos, sin)


def runner(q, k, v, scale, causal, cfg):
    """A no-argument call of our kernel with exactly `cfg` (the launcher's checks, then
    `_run` without `keep`)."""
    _, tables, m4, pos = attention._prepare(q, k, v, None, None, None, causal, scale, False, None)
    def fn():
        return attention._run(q, k, v, tables, m4, causal, scale, False, cfg)[0]
    return fn


def check(fn, want: torch.Tensor) -> dict:
    torch.full(want.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)  # freed: poison
    out = fn()
    torch.cuda.synchronize()
    excess = max_violation(out, want, tolerance(torch.bfloat16))
    return {"ok": excess <= 0, "max_excess": excess, "max_abs_error": max_abs_error(out, want),
            "rel_error": rel_error(out.float(), want)}


def time_it(fn, flops: int, rep: int) -> dict:
    ms = float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return {"us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12}


def guarded(what, fn, *args):
    """fn(*args) or {"error": ...}: one config that does not compile must not end the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (out_of_resources, compile errors, mismatches)
        print(f"  {what}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


COMPILED_UNFUSED = torch.compile(attention.unfused, dynamic=False)


def compiled(q, k, v, scale, causal, cfg):
    """Launch once (compiling); the kernel's registers, spills and shared bytes."""
    return resources(attention._run(q, k, v, None, None, causal, scale, False, cfg)[1])


def config_entry(name, cfg, q, k, v, scale, causal, want, flops, rep, do_time) -> dict:
    prob = attention.problem(q, k, v, causal=causal)
    entry = {"config": encode(cfg), "kept": attention.SPACE.keep(cfg, prob),
             "smem_estimate": attention._smem(cfg, prob)}
    res = guarded(f"{name} compile", compiled, q, k, v, scale, causal, cfg)
    if isinstance(res, dict):
        return entry | res
    if res is not None:
        entry.update(regs=res.n_regs, spills=res.n_spills, shared=res.shared_bytes)
    fn = runner(q, k, v, scale, causal, cfg)
    if want is not None:
        entry["check"] = guarded(f"{name} check", check, fn, want)
    if do_time:
        entry.update(guarded(f"{name} time", time_it, fn, flops, rep))
    return entry


def shape_row(tq, tk, causal, configs, rep, do_check, do_time) -> dict:
    q, k, v, scale, raw = inputs(tq, tk, causal)
    default = attention.SPACE.default(attention.problem(q, k, v, causal=causal))
    flops = attention.flops(q, k, causal=causal)
    row = {"tq": tq, "tk": tk, "causal": causal, "flops": flops,
           "default_config": encode(default), "configs": {}}
    want = attention.reference(q.float(), k.float(), v.float(), causal=causal, scale=scale) \
        if do_check else None
    for name, cfg in [("default", default)] + [(n, parse(n)) for n in configs]:
        row["configs"][name] = config_entry(name, cfg, q, k, v, scale, causal, want, flops, rep,
                                            do_time)
    if do_time:
        q0, k0, cos, sin = raw
        row["sdpa"] = time_it(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=True), flops, rep)
        ours_rope = lambda: attention.launch_attention(q0, k0, v, cos, sin, None, causal, scale)  # noqa: E731
        row["ours_rope"] = guarded("ours_rope", time_it, ours_rope, flops, rep)
        if tq <= ROPE_CHECK_MAX:  # whatever --no-check says: the launch with RoPE is checked
            exact = attention.reference(q0.float(), k0.float(), v.float(), cos.float(), sin.float(),
                                        causal=causal, scale=scale)
            row["ours_rope"]["check"] = guarded("ours_rope check", check, ours_rope, exact)
            del exact
        # the form before session 18 at >= 512 tokens, in the same run: q and k rotated by
        # one rope_qk launch, then the kernel on plain q, k (TMA for k, v from 2048)
        row["ours_rope_qk"] = guarded("ours_rope_qk", time_it, lambda: attention.launch_attention(
            *rope.launch_rope_qk(q0, k0, cos, sin), v, None, None, None, causal, scale), flops, rep)
        for name, fn in (("sdpa_rope", attention.unfused), ("compiled_rope", COMPILED_UNFUSED)):
            row[name] = guarded(name, time_it, lambda fn=fn: fn(
                q0, k0, v, cos, sin, None, causal, scale, False), flops, rep)
        if causal and tq == tk:
            row.update(masked_rows(q, k, v, scale, flops, rep))
    del want
    torch.cuda.empty_cache()
    return row


def masked_rows(q, k, v, scale, flops, rep) -> dict:
    """What a traced `transformers` prefill runs: the causal mask materialised as an additive
    (1, 1, T, T) bf16 tensor, k/v repeated to every q head (transformers' repeat_kv when a
    mask is given): SDPA (its masked backend) and our kernel reading the mask; and our kernel
    on the same mask marked causal (kernels/masks.py: the mask is dropped for causal=True)."""
    t, group = q.shape[2], q.shape[1] // k.shape[1]
    keep = torch.ones(t, t, dtype=torch.bool, device=DEVICE).tril()
    mask = torch.zeros(1, 1, t, t, dtype=q.dtype, device=DEVICE).masked_fill(
        ~keep, torch.finfo(q.dtype).min)
    kr, vr = (x.repeat_interleave(group, dim=1) for x in (k, v))
    rows = {"sdpa_masked": guarded("sdpa_masked", time_it, lambda: F.scaled_dot_product_attention(
        q, kr, vr, attn_mask=mask, scale=scale), flops, rep)}
    rows["ours_masked"] = guarded("ours_masked", time_it, lambda: attention.launch_attention(
        q, k, v, mask=mask, scale=scale), flops, rep)
    marked = mask.clone()
    mark_if_causal(marked)
    rows["ours_marked"] = guarded("ours_marked", time_it, lambda: attention.launch_attention(
        q, k, v, mask=marked, scale=scale), flops, rep)
    return rows


def summary(rows: list[dict], names: list[str]) -> None:
    """One line per config: check verdict over every checked shape, µs and TFLOP/s per
    timed length, and the time over SDPA's."""
    timed = [r for r in rows if "sdpa" in r]
    print("tokens:", " ".join(f"{r['tq']:>22d}" for r in timed))
    print(f"{'sdpa':>12s} {'':5s}", " ".join(
        f"{r['sdpa']['us']:9.1f}us {r['sdpa']['tflops']:4.0f}TF/s    " for r in timed))
    for name in names:
        entries = [r["configs"].get(name, {}) for r in rows]
        checks = [e.get("check", {}) for e in entries if "check" in e]
        verdict = ("ERR" if any("error" in e for e in entries) else
                   "ok" if checks and all(c.get("ok") for c in checks) else
                   "FAIL" if checks else "-")
        cells = []
        for r in timed:
            e = r["configs"].get(name, {})
            cells.append(f"{e['us']:9.1f}us {e['tflops']:4.0f}TF/s x{e['us'] / r['sdpa']['us']:4.2f}"
                         if "us" in e else f"{'n/a':>25s}")
        print(f"{name:>12s} {verdict:5s}", " ".join(cells), flush=True)
    for r in timed:
        us = {k: r[k]["us"] for k in ("ours_rope", "ours_rope_qk", "sdpa_rope", "compiled_rope", "sdpa_masked",
                                      "ours_masked", "ours_marked")
              if isinstance(r.get(k), dict) and "us" in r[k]}
        ok = r.get("ours_rope", {}).get("check", {}).get("ok", "unchecked")
        print(f"with RoPE, {r['tq']} tokens (default {r['default_config']}; ours ok: {ok}): "
              + ", ".join(f"{k} {v:.1f}us" for k, v in us.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma list of BLOCK_MxBLOCK_NwWARPSsSTAGES[t] (t: TMA), or 'none'")
    ap.add_argument("--no-check", action="store_true", help="time only")
    ap.add_argument("--rep", type=int, default=100, help="ms of replays per timing")
    args = ap.parse_args()
    names = [] if args.configs == "none" else [c for c in args.configs.split(",") if c]
    for n in names:
        parse(n)  # fail on a typo before anything compiles
    t0, rows = time.time(), []
    for t in (int(x) for x in args.tokens.split(",")):
        rows.append(shape_row(t, t, True, names, args.rep, not args.no_check, True))
        print(f"{t} tokens causal done ({time.time() - t0:.0f} s)", flush=True)
    if not args.no_check:
        tq, tk = CHECK_NONCAUSAL
        rows.append(shape_row(tq, tk, False, names, args.rep, True, False))
        print(f"{tq}x{tk} non-causal check done ({time.time() - t0:.0f} s)", flush=True)
    summary(rows, ["default"] + names)
    payload = header(DEVICE, dtype="bfloat16", heads="32 q / 8 kv, d 128, batch 1",
                     timing="do_bench_cudagraph median", rep_ms=args.rep,
                     check="reference fp32, bf16 tolerance", wall_s=round(time.time() - t0, 1))
    payload["rows"] = rows
    print("wrote", write("attention_probe.json", payload))


if __name__ == "__main__":
    main()
