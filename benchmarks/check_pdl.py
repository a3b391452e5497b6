"""GPU check and timing of programmatic dependent launch (PDL) on a decode-shaped chain.

Four Llama-3-8B decoder layers at one token, built from our kernels only (bf16): norm +
QKV GEMV, decode attention over a half-written static cache (split + combine), o_proj
GEMV + residual (split-K + epilogue), norm + gate/up GEMV, SwiGLU, down_proj GEMV +
residual — 40 kernels where each reads what the one before wrote. The chain is captured
in a CUDA graph twice, without and with `programmatic_launch(True)`; each graph is
replayed with fresh inputs copied in, and every PDL replay must equal the plain replay
bit for bit (the same kernels in the same order: any difference is a read that ran ahead
of its producer). Then both graphs are timed (median of CUDA-event timed replays over
rotating weights: no L2 reuse between replays).

    python benchmarks/check_pdl.py        # writes pdl-check.json under $OUT
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention, gated_act, gemm  # noqa: E402
from advisor.kernels._triton import pdl_supported, programmatic_launch  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

HIDDEN, INTER, HQ, HKV, D = 4096, 14336, 32, 8, 128
LAYERS, CONTEXT, SLOTS = 4, 2048, 4096


def _layer(dev, dtype, gen):
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    qkv_n = (HQ + 2 * HKV) * D
    return {"g1": r(HIDDEN, scale=0.1) + 1, "w_qkv": r(qkv_n, HIDDEN, scale=HIDDEN ** -0.5),
            "w_o": r(HIDDEN, HQ * D, scale=HIDDEN ** -0.5), "g2": r(HIDDEN, scale=0.1) + 1,
            "w_gu": r(2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
            "w_d": r(HIDDEN, INTER, scale=INTER ** -0.5),
            "k": r(1, HKV, SLOTS, D), "v": r(1, HKV, SLOTS, D)}


def _step(h, layers, mask):
    """One token through the layers; h (1, HIDDEN). The cache is read, not written."""
    for p in layers:
        qkv = gemm.launch_gemm_rmsnorm(h, p["g1"], p["w_qkv"], 1e-5)  # (1, 6144)
        q = qkv[:, : HQ * D].view(1, HQ, 1, D)
        a = attention.launch_attention(q, p["k"], p["v"], mask=mask)  # (1, HQ, 1, D)
        h = gemm.launch_gemm_epilogue(a.view(1, HQ * D), p["w_o"], None, h, "none")
        gu = gemm.launch_gemm_rmsnorm(h, p["g2"], p["w_gu"], 1e-5)  # (1, 2·INTER)
        act = gated_act.launch_gated_act(gu[:, :INTER], gu[:, INTER:], "silu")
        h = gemm.launch_gemm_epilogue(act, p["w_d"], None, h, "none")
    return h


def _capture(fn, pdl: bool):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), programmatic_launch(pdl):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), programmatic_launch(pdl):
        out = fn()
    return graph, out


def _time_us(graph, reps=200) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if not pdl_supported(dev):
        print("PDL not supported on this device/Triton: nothing to check")
        sys.exit(1)
    gen = torch.Generator(device=dev).manual_seed(0)
    # Two weight sets (> L2 together: ~1.2 GB each) so consecutive replays stream from HBM.
    sets = [[_layer(dev, dtype, gen) for _ in range(LAYERS)] for _ in range(2)]
    mask = torch.full((1, 1, 1, SLOTS), float("-inf"), device=dev, dtype=dtype)
    mask[..., : CONTEXT + 1] = 0.0
    x = torch.randn(1, HIDDEN, generator=gen, device=dev).to(dtype)
    graphs = {}
    for pdl in (False, True):
        for i, layers in enumerate(sets):
            graphs[(pdl, i)] = _capture(lambda layers=layers: _step(x, layers, mask), pdl)
    # Correctness: fresh x each round; the PDL replay equals the plain one bit for bit.
    x0, mismatches, rounds = x.clone(), 0, 30
    for i in range(rounds):
        x.copy_(x0 * (1 + 0.01 * i))
        results = {}
        for pdl in (False, True):
            graph, out = graphs[(pdl, i % 2)]
            graph.replay()
            results[pdl] = out.clone()
        mismatches += not torch.equal(results[False], results[True])
    torch.cuda.synchronize()
    eager = _step(x, sets[(rounds - 1) % 2], mask)  # no graph, no PDL: the same numbers
    eager_equal = torch.equal(eager, results[False])
    timing = {}
    for pdl in (False, True):
        for _ in range(3):  # warm
            for i in range(2):
                graphs[(pdl, i)][0].replay()
        torch.cuda.synchronize()
        timing["pdl" if pdl else "plain"] = statistics.median(
            _time_us(graphs[(pdl, i)][0], reps=100) for i in (0, 1, 0, 1))
    kernels = 10 * LAYERS
    row = {"layers": LAYERS, "kernels": kernels, "rounds": rounds, "mismatches": mismatches,
           "eager_equals_graph": eager_equal, "plain_us": timing["plain"], "pdl_us": timing["pdl"],
           "saved_us_per_kernel": (timing["plain"] - timing["pdl"]) / kernels}
    print(f"PDL chain ({LAYERS} layers, {kernels} kernels): plain {timing['plain']:.1f} us, "
          f"pdl {timing['pdl']:.1f} us ({row['saved_us_per_kernel']:.2f} us/kernel); "
          f"{mismatches}/{rounds} replays differ; eager == graph: {eager_equal}", flush=True)
    write("pdl-check.json", {**header(dev, dtype=str(dtype), context=CONTEXT, slots=SLOTS), **row})
    sys.exit(1 if mismatches or not eager_equal else 0)


if __name__ == "__main__":
    main()
