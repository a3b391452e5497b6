"""A/B of `runtime/outside_graph.py` in one process: a recipe's prefill forward with the
logits matmul computed after the CUDA-graph replay (the default) against the same recipe
with it captured and its output cloned out (MIN_BYTES set past any output), at each length.

Checks on the GPU, per length: both variants' logits are bit-equal (the same cuBLAS call
on the same inputs, inside or outside the graph); a result the caller holds survives the
next replay; the cut variant reports one output outside the graph. Times are medians of
`advisor.timing.median_ms` (do_bench, L2 flushed), A and B alternated over two rounds.

    python benchmarks/check_outside_graph.py --recipe recipes/llama_hf-h200.json \
        --tokens 128,512,2048 --json outside-graph.json   # written under $OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.loader import build, call, inputs_for, load_model_file  # noqa: E402
from advisor.runtime import outside_graph  # noqa: E402
from advisor.runtime.apply import apply  # noqa: E402
from advisor.runtime.recipe import load_recipe  # noqa: E402
from advisor.timing import median_ms  # noqa: E402
from benchmarks.common import header, write  # noqa: E402


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


def _other_tokens(v: Any) -> Any:
    """Integer inputs (token ids) rolled by one: another input of the same shapes."""
    if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() >= 1:
        return v.roll(1, -1)
    return v


def _outside(model: Any) -> dict[str, Any]:
    """Outputs the rewrites cut, and per live graph how many its capture kept."""
    rows = [r for r in model.summary() if r["family"] == "(all)"]
    return {"cut": sum(r.get("outputs_outside_graph", 0) for r in rows),
            "kept_per_graph": [n for r in rows for n in (r.get("outside_per_graph") or [])]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="examples/llama_hf.py")
    p.add_argument("--recipe", required=True)
    p.add_argument("--tokens", default="128,512,2048")
    p.add_argument("--json", default="outside-graph.json", help="file name under $OUT")
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    mf = load_model_file(a.model)
    model = build(mf, dev, dtype)
    recipe = load_recipe(a.recipe)
    cut, kept = apply(model, recipe), apply(model, recipe)
    rows = []
    for t in (int(s) for s in a.tokens.split(",")):
        x = inputs_for(mf, t, 1, dev, dtype=dtype)
        y = tree_map(_other_tokens, x)
        with torch.no_grad():
            first = _logits(call(cut, x)).clone()  # trace + capture at this length
            saved = outside_graph.MIN_BYTES
            outside_graph.MIN_BYTES = 1 << 62  # `kept` traces with nothing cut
            try:
                ref = _logits(call(kept, x))
            finally:
                outside_graph.MIN_BYTES = saved
            held = _logits(call(cut, x))
            snapshot = held.clone()
            call(cut, y)  # another replay while the caller holds `held`
            survived = bool(torch.equal(held, snapshot))
            equal = bool(torch.equal(first, ref)) and bool(torch.equal(held, ref))
            times: dict[str, list[float]] = {"cut": [], "kept": []}
            for _ in range(2):
                for name, m in (("cut", cut), ("kept", kept)):
                    times[name].append(median_ms(lambda m=m, x=x: call(m, x), dev))
        row = {"tokens": t, "cut_ms": statistics.mean(times["cut"]),
               "kept_ms": statistics.mean(times["kept"]), "runs_ms": times,
               "logits_bit_equal": equal, "held_output_survives_replay": survived,
               "outputs_outside_graph": {"cut": _outside(cut), "kept": _outside(kept)},
               "logits_mb": first.numel() * first.element_size() / 2**20}
        row["saved_ms"] = row["kept_ms"] - row["cut_ms"]
        rows.append(row)
        print(f"{t:5d} tokens: cut {row['cut_ms']:.3f} ms, kept {row['kept_ms']:.3f} ms "
              f"(saved {row['saved_ms'] * 1e3:.1f} µs, logits {row['logits_mb']:.0f} MiB); "
              f"bit-equal {equal}, held output survives {survived}", flush=True)
    write(a.json, {**header(dev, tokens=a.tokens, recipe=a.recipe), "model": a.model,
                   "dtype": str(dtype), "results": rows})


if __name__ == "__main__":
    main()
