"""rope_table on the GPU: its tables against transformers' eager spelling (bf16 and fp32,
positions up to 8191, Llama-3's inv_freq), and the time of one decode step's tables: the
fused launch against the eager ops, CUDA-graph timing.

    python benchmarks/check_rope_table.py      # writes rope-table-check.json under $OUT
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels.rope_table import launch_rope_table, reference  # noqa: E402
from benchmarks.common import header, write  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    inv = (1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)).to(dev)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for tokens, start in ((1, 8191), (1, 2048), (2048, 0)):
            pos = (start + torch.arange(tokens, device=dev))[None, :, None]
            got = launch_rope_table(pos, inv, 1.0, 1.0, True, dtype)
            want = reference(pos, inv, 1.0, 1.0, True, dtype)
            err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
            args = (pos, inv, 1.0, 1.0, True, dtype)
            fused_us = triton.testing.do_bench_cudagraph(partial(launch_rope_table, *args)) * 1e3
            eager_us = triton.testing.do_bench_cudagraph(partial(reference, *args)) * 1e3
            row = {"dtype": str(dtype), "tokens": tokens, "start": start, "max_abs_error": err,
                   "equal": err == 0.0, "fused_us": fused_us, "eager_us": eager_us}
            rows.append(row)
            print(row, flush=True)
    payload = header(dev, dtype="bfloat16,float32", timing="do_bench_cudagraph median")
    payload["rows"] = rows
    print("wrote", write("rope-table-check.json", payload))


if __name__ == "__main__":
    main()
