"""Measured price of horizontal linear merges (qkv_merge, gate_up_merge, linear_merge).

A merge's saving is mostly GEMM efficiency, not launches or bytes: three small GEMVs
(q, k, v at one token) run far below copy bandwidth, one merged GEMV near it. Priced by
launches and the re-read x alone, the analyzer under-predicted the H200's measured
savings 3–4× (session 5: qkv 0.026 predicted vs 0.101 ms measured at 1 token). So the
analyzer times both spellings of each distinct merge shape on the analysis device:

    separate_ms = device time of  x·W_1ᵀ, …, x·W_nᵀ   (n cuBLAS calls, back to back)
    merged_ms   = device time of  x·[W_1; …; W_n]ᵀ    (one call)

x: (M, K) with M = the site's rows; W_i: (N_i, K), the site's dtype; with bias when the
site has one. Each spelling runs over enough distinct weight copies to exceed twice the
L2, in one CUDA graph per spelling, the two replayed in turn (profile/replay.py): the
saving is what a CUDA-graph replay of the model gains, the launch gap and ramp of the
removed kernels included. On the CPU: perf_counter over the same op list (tests; CPU
analyses).

Shapes are probed once (every layer of a decoder shares them); weights are random
tensors of the site's shapes and dtype (values do not move a GEMM's time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from advisor.graph.capture import fake
from advisor.graph.match import Match
from advisor.profile.replay import CaptureFailed, copies_past_l2, spellings_ms

MERGE_KERNEL = "merged_linear"


@dataclass(frozen=True)
class MergeShape:
    m: int                    # rows of x (batch · tokens)
    k: int
    ns: tuple[int, ...]       # each member's output features
    bias: bool
    dtype: torch.dtype


@dataclass(frozen=True)
class MergeTiming:
    separate_ms: float        # the members, one call each
    merged_ms: float          # one call on the concatenated weight

    @property
    def saving_ms(self) -> float:
        return self.separate_ms - self.merged_ms


def merge_shape(m: Match) -> MergeShape | None:
    """The probe shape of a merge site; None for any other site or unknown shapes."""
    if m.kernel != MERGE_KERNEL:
        return None
    x = fake(m.operands.get("x"))
    ws = [fake(w) for w in m.operands.get("weights", [])]
    if x is None or not ws or any(w is None or w.dim() != 2 for w in ws):
        return None
    k = int(ws[0].shape[1])
    if x.shape[-1] != k or x.numel() == 0:
        return None
    bias = any(b is not None for b in m.operands.get("biases", []))
    return MergeShape(x.numel() // k, k, tuple(int(w.shape[0]) for w in ws), bias, ws[0].dtype)


Members = list[tuple[torch.Tensor, torch.Tensor | None]]  # (W (N_i, K), b (N_i,) or None)


def _weights(s: MergeShape, copies: int, device: torch.device) -> list[Members]:
    """copies × members, random, in the site's dtype."""
    def one(n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.randn(n, s.k, device=device, dtype=torch.float32).to(s.dtype) * s.k ** -0.5
        return w, (torch.randn(n, device=device).to(s.dtype) if s.bias else None)
    return [[one(n) for n in s.ns] for _ in range(copies)]


def _concatenated(members: Members) -> Members:
    bias = members[0][1] is not None
    return [(torch.cat([w for w, _ in members]), torch.cat([b for _, b in members]) if bias else None)]


def _linears(x: torch.Tensor, sets: list[Members]) -> Callable[[], None]:
    def run() -> None:
        for members in sets:
            for w, b in members:
                F.linear(x, w, b)
    return run


def time_merge(s: MergeShape, device: torch.device | str) -> MergeTiming:
    """Device ms per site of the separate and the merged spelling (see the module doc)."""
    device = torch.device(device)
    set_bytes = s.k * sum(s.ns) * torch.empty((), dtype=s.dtype).element_size()
    copies = copies_past_l2(set_bytes, device)
    x = torch.randn(s.m, s.k, device=device, dtype=torch.float32).to(s.dtype)  # (M, K)
    with torch.no_grad():
        separate = _weights(s, copies, device)
        merged = [_concatenated(members) for members in separate]
        separate_ms, merged_ms = spellings_ms([_linears(x, separate), _linears(x, merged)], device)
    return MergeTiming(separate_ms / copies, merged_ms / copies)


def probe_merges(matches: Iterable[Match], device: torch.device | str) -> dict[MergeShape, MergeTiming]:
    """Each distinct merge shape among `matches`, timed once on `device`."""
    shapes = dict.fromkeys(s for m in matches if (s := merge_shape(m)) is not None)
    out: dict[MergeShape, MergeTiming] = {}
    for s in shapes:  # a shape that cannot be timed keeps the launch + bytes price
        try:
            out[s] = time_merge(s, device)
        except CaptureFailed:
            break
        except Exception:
            continue
    return out
