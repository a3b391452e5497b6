"""Greedy generation from one decode step: the loop `advisor bench --phase decode --generate N` times.

`make_decode_inputs(context_len, ...)` gives one decode step's inputs (a new token per
sequence against a KV cache filled to context_len). Each step then runs the model, takes
the argmax of the last position's logits (B, 1) and builds the next step's inputs with
the model file's `next_decode_inputs(inputs, next_ids)`, or by default (dict inputs):
`input_ids` replaced by the next ids, `cache_position` / `position_ids` advanced by one.
Next ids stay on the device and nothing reads a tensor back inside the loop, so the loop
never waits for the GPU: what is timed is what a serving loop pays, launches included.

Example::

    advance = advancer(mf, inputs)
    gen = greedy(model, inputs, 32, advance)
    gen.tokens                       # (B, 32) int64, on the model's device
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from advisor.errors import ModelFileError
from advisor.kernels._triton import interpreting
from advisor.kernels.argmax import launch_argmax
from advisor.kernels.testing import max_abs_error, max_violation, rel_error, tolerance
from advisor.loader import Inputs, ModelFile, _one_line, call, first_tensor
from advisor.state import objects_in
from advisor.timing import elapsed_ms

Advance = Callable[[Inputs, torch.Tensor], Inputs]
OnStep = Callable[[int], None]
POSITION_KEYS = ("cache_position", "position_ids")  # advanced by one per step by default


def _why_not_default(inputs: Inputs) -> str | None:
    if not isinstance(inputs, Mapping):
        return "inputs are positional (a tuple)"
    if not isinstance(inputs.get("input_ids"), torch.Tensor):
        return "no 'input_ids' tensor among the inputs"
    if inputs.get("attention_mask") is not None:
        return "an attention_mask would have to grow by one position per step"
    return None


def default_next_inputs(inputs: Inputs, next_ids: torch.Tensor) -> Inputs:
    """Dict inputs of the next step: input_ids = next_ids (B, 1); cache_position (T,) and
    position_ids (B, T) + 1 where present. New tensors: the given inputs are not mutated
    (a snapshot restores them), and nothing leaves the device."""
    problem = _why_not_default(inputs)
    if problem is not None or not isinstance(inputs, Mapping):
        raise ModelFileError(f"cannot advance decode inputs by default: {problem}")
    nxt = dict(inputs)
    nxt["input_ids"] = next_ids.to(inputs["input_ids"].dtype)
    for key in POSITION_KEYS:
        if isinstance(nxt.get(key), torch.Tensor):
            nxt[key] = nxt[key] + 1
    return nxt


def advancer(mf: ModelFile, inputs: Inputs) -> Advance:
    """The model file's next_decode_inputs (its failures become ModelFileError), else the
    default — checked against `inputs` now, before any step runs."""
    fn = mf.next_decode_inputs
    if fn is None:
        problem = _why_not_default(inputs)
        if problem is not None:
            raise ModelFileError(f"{mf.path}: cannot advance decode inputs by default ({problem}); "
                                 "define next_decode_inputs(inputs, next_ids) in the model file")
        return default_next_inputs

    def advance(x: Inputs, next_ids: torch.Tensor) -> Inputs:
        try:
            out = fn(x, next_ids)
        except Exception as exc:
            raise ModelFileError(f"{mf.path}: next_decode_inputs failed: {_one_line(exc)}") from None
        if not isinstance(out, (tuple, list, Mapping)):
            raise ModelFileError(f"{mf.path}: next_decode_inputs must return a tuple or dict, "
                                 f"got {type(out).__name__}")
        return dict(out) if isinstance(out, Mapping) else tuple(out)

    return advance


def cache_capacity(inputs: Inputs) -> int | None:
    """Positions a static KV cache among `inputs` holds, where it says so (`max_cache_len`,
    as transformers' static caches and their layers do); None if nothing declares it."""
    found = [o.max_cache_len for o in objects_in(inputs)
             if isinstance(getattr(o, "max_cache_len", None), int) and not isinstance(o, torch.Tensor)]
    return min(found) if found else None


def check_capacity(mf: ModelFile, inputs: Inputs, context_len: int, steps: int) -> None:
    """ModelFileError if the cache cannot hold context_len + steps positions (where its
    capacity is declared): on a GPU, writing past the end is a device-side assert."""
    cap = cache_capacity(inputs)
    if cap is not None and context_len + steps > cap:
        raise ModelFileError(
            f"{mf.path}: the KV cache of make_decode_inputs({context_len}, ...) holds {cap} positions; "
            f"generating {steps} tokens needs {context_len + steps} (make its cache larger, or pass a "
            "smaller --generate)")


@dataclass
class Generation:
    """Greedy tokens (B, N), each step's last-position logits (B, N, V) when kept, and
    the median time of the whole loop (ms) when timed."""

    tokens: torch.Tensor
    logits: torch.Tensor | None = None
    loop_ms: float | None = None


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, (B, V) -> (B, 1), as torch.argmax (first maximum; NaN
    counts as the maximum). On CUDA two small Triton launches (`kernels/argmax.py`): torch
    reduces one long row in a single block (H200: 28 µs over Llama-3's 128256 logits) and
    its chunked form takes three launches (≈ 11 µs per token in a decode profile)."""
    if logits.is_cuda and not interpreting():
        return launch_argmax(logits)
    return logits.argmax(-1, keepdim=True)


def greedy(model: Callable[..., Any], inputs: Inputs, steps: int, advance: Advance, *,
           on_step: OnStep | None = None, keep_logits: bool = False) -> Generation:
    """`steps` greedy decode steps from `inputs`; `on_step(i)` runs before step i (e.g. to
    tell the runtime the context length it routes by)."""
    x, ids, kept = inputs, [], []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        out = first_tensor(call(model, x))
        last = out if out.dim() == 2 else out[:, -1]  # (B, V)
        nxt = greedy_ids(last)  # (B, 1), stays on the device
        ids.append(nxt)
        if keep_logits:
            kept.append(last.clone())  # a CUDA graph's output buffer is rewritten by its next replay
        if i + 1 < steps:
            x = advance(x, nxt)
    return Generation(torch.cat(ids, dim=1), torch.stack(kept, dim=1) if keep_logits else None)


def timed_greedy(model: Callable[..., Any], inputs: Inputs, steps: int, advance: Advance,
                 device: torch.device, restore: Callable[[], None], *, on_step: OnStep | None = None,
                 warmup: Sequence[int] = (0, 1, 2), reps: int = 1) -> Generation:
    """Warm-up, then `reps` timed loops (state restored before each and after the last):
    the first loop's tokens and logits, and the median time of the loops after it (which
    keep no logits; of the first when reps is 1). Warm-up runs the first
    step's inputs once per index in `warmup`, with on_step(i) before it, so every route
    the loop will take (e.g. a recipe bucket reached at step i) compiles before timing.
    No L2 flush: a loop of N steps streams the weights N times, far more than L2."""
    with torch.no_grad():
        for i in warmup:
            if on_step is not None:
                on_step(i)
            call(model, inputs)
        times: list[float] = []
        first: Generation | None = None
        for _ in range(max(1, reps)):
            restore()
            keep = first is None  # logits of the first loop only: the others are for timing
            gen, ms = elapsed_ms(partial(greedy, model, inputs, steps, advance, on_step=on_step,
                                         keep_logits=keep), device)
            first = gen if first is None else first
            times.append(ms)
        restore()
    assert first is not None
    first.loop_ms = statistics.median(times[1:] or times)
    return first


def compare(got: Generation, ref: Generation, dtype: torch.dtype,
            rel_bound: float | None = None) -> dict[str, Any]:
    """Tokens and logits of a generation against eager's. Logits are compared up to and
    including the first step where the tokens diverge (after it, the two models see
    different inputs): exact tokens are the fp32 expectation; in bf16/fp16 a near-tie
    may flip a token, so those are judged on logits: within the whole-model tolerance
    element-wise, or ‖Δ‖/‖eager‖ within `rel_bound` (bench passes
    `advisor.verify.apart_bound` of eager's own one-step error vs fp32)."""
    assert got.logits is not None and ref.logits is not None
    same = (got.tokens == ref.tokens).all(dim=0).cpu()  # (N,)
    bad = (~same).nonzero()
    diverge = int(bad[0, 0]) if len(bad) else None
    upto = same.numel() if diverge is None else diverge + 1
    g, r = got.logits[:, :upto], ref.logits[:, :upto]  # (B, upto, V)
    rel = rel_error(g, r)
    logits_match = max_violation(g, r, tolerance(dtype, model=True)) <= 0 or (
        rel_bound is not None and rel <= rel_bound)
    return {"tokens_match": diverge is None, "first_divergence": diverge, "compared_steps": upto,
            "max_error": max_abs_error(g, r), "rel_error": rel, "logits_match": logits_match,
            "matches_eager": logits_match and (diverge is None or dtype != torch.float32)}
