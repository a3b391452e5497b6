"""Attention masks whose values are the causal mask: found once, then read as `causal=True`.

Traced, a `transformers` decoder materialises its causal mask at prefill (under dynamo it
never takes the `is_causal` shortcut eager takes): a (B, 1, T, T) additive or bool tensor
built from sizes alone. Whoever reads it pays twice: SDPA leaves its flash kernel for a
masked one, and our attention kernel loads a T x T tile of bias per block instead of
skipping the blocks above the diagonal. graph/shape_only.py computes such a mask once per
length and keeps it; when it keeps one it asks `is_causal_mask` and marks the tensor, so a
reader can drop the mask for `causal=True` at no cost per call. The decision is made on the
values, for exactly the length they were built for: a sliding window, padding or packed
sequences make a mask that is not causal, and it stays a mask.
"""

from __future__ import annotations

from typing import Any

import torch

# An additive bias at or below this hides a key as -inf does: transformers writes -inf,
# finfo(dtype).min or fp16's -65504 (any dtype), and exp(score - 65504 - row max) is 0 in
# fp32 for any score a bf16/fp16 model produces. (Only a row with no visible key differs:
# a finite bias averages v there, -inf gives 0; a causal row always sees key 0.)
MASKED_BIAS = torch.finfo(torch.float16).min

_MARK = "_advisor_causal_mask"


def is_causal_mask(t: Any) -> bool:
    """t (..., T, T), T >= 1: key j visible to query i iff j <= i, in every leading index.
    Bool: True is visible. Floating (additive): 0 is visible, <= MASKED_BIAS is hidden;
    any other value (a real bias, NaN) makes it not causal. One pass over t (a sync).

    >>> is_causal_mask(torch.ones(3, 3, dtype=torch.bool).tril())
    True
    >>> is_causal_mask(torch.zeros(1, 1, 3, 3))  # nothing hidden
    False
    """
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-1] != t.shape[-2] or t.numel() == 0:
        return False
    if t.dtype == torch.bool:
        visible = t
    elif t.dtype.is_floating_point:
        visible = t == 0
        if not bool((visible | (t <= MASKED_BIAS)).all()):
            return False
    else:
        return False
    n = t.shape[-1]
    tril = torch.ones(n, n, dtype=torch.bool, device=t.device).tril()
    return bool((visible == tril).all())


def mark_if_causal(t: torch.Tensor) -> bool:
    """Mark `t` when its values are the causal mask (the mark lives on this tensor object:
    a view of it is not marked). Only for tensors nobody writes (kept shape-only values)."""
    causal = is_causal_mask(t)
    if causal:
        setattr(t, _MARK, True)
    return causal


def marked_causal(mask: Any) -> bool:
    """True when `mask` is a tensor marked by `mark_if_causal`."""
    return isinstance(mask, torch.Tensor) and getattr(mask, _MARK, False) is True


def reads_as_causal(mask: Any, tq: int, tk: int) -> bool:
    """A marked mask that attention over Tq queries and Tk keys may read as `causal=True`:
    Tq == Tk (top-left and bottom-right alignment agree) and the mask is (..., Tq, Tk)
    itself — a marked (1, 1) mask broadcast over T x T > 1 hides nothing and is not causal."""
    return tq == tk and marked_causal(mask) and tuple(mask.shape[-2:]) == (tq, tk)
