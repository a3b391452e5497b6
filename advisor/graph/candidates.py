"""Fusion candidates: matches grouped by family and priced with measured ceilings.

Predicted saving per forward = launches removed × measured per-launch cost
                             + bytes avoided ÷ measured copy bandwidth.
Launches and bytes come from the matched subgraphs themselves (fake-tensor shapes), not
from per-family constants, so the same formula prices any spelling of a pattern.

Where the saving is kernel efficiency that launches and bytes do not see (a horizontal
merge: small GEMVs below copy bandwidth become one near it; a norm in a GEMM's prologue
changing the GEMM's own time), the caller passes the measured device-time saving per
site (`advisor/profile/merge_probe.py`, `advisor/runtime/site_probe.py`). The candidate
then carries it as `device_saving_ms` (what a CUDA-graph replay gains) and is priced
at max(launch + bytes price, device saving): eager at small sizes is host-bound (the
removed launches' host time is the saving), at large sizes device-bound. A measured
loss is the price itself: a fused kernel slower on the device than what it replaces
(the Triton GEMMs against cuBLAS at 512 tokens: -1.5 ms for the norm->QKV family on an
H100, session 13) is not a saving whatever launches it removes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from advisor.graph.capture import Captured
from advisor.graph.match import Match
from advisor.graph.patterns import find_all
from advisor.graph.shape_only import memoized_region


@dataclass(frozen=True)
class Sliced:
    """A site whose inputs a merge turns into column blocks (runtime/column_blocks.py), for the report:
    its saving reading them so, what its unfused spelling pays for it (sliced − contiguous
    unfused ms), the families producing the blocks and the blocks it reads ("graph part:GEMM
    output": RoPE reads q's and k's, attention v's, attention with RoPE all
    three, so two families' sites are one reader where their blocks meet)."""

    saving_ms: float
    unfused_penalty_ms: float
    by: tuple[str, ...]
    reads: tuple[str, ...]


@dataclass(frozen=True)
class Candidate:
    family: str
    kernel: str | None          # registry id applying it; None = analysis only (no kernel yet)
    sites: tuple[str, ...]      # module paths, one per occurrence
    count: int
    launches_removed: int       # per forward, all sites
    bytes_avoided: int          # per forward, all sites
    predicted_saving_ms: float  # per forward
    device_saving_ms: float | None = None  # per forward, measured; None: not (fully) probed
    probe_note: str = ""        # why device_saving_ms is None (a site's probe skip reason)
    # per site, in `sites` order: each one's measured saving (cold), and the forward's total
    # with activations read from L2 (runtime/site_probe.py; a site without a warm timing
    # counts its cold one; None where no site has one); () / None where not (fully) probed
    site_savings_ms: tuple[float | None, ...] = ()
    device_saving_warm_ms: float | None = None
    # the forward's total with the fused kernels launched with PDL (a plan's `pdl`; a site
    # without that timing counts its cold one; None where no site has one)
    device_saving_pdl_ms: float | None = None
    # per site, in `sites` order: its timing with the inputs a merge turns into column
    # blocks read so (None: it reads none, or was not timed so); () where not probed
    site_sliced: tuple[Sliced | None, ...] = ()

    @property
    def applicable(self) -> bool:
        return self.kernel is not None


@dataclass(frozen=True)
class Costs:
    """The two prices a prediction needs (from `profile.ceilings.Ceilings`)."""

    launch_us: float
    copy_gbps: float


def matches_of(captured: Captured) -> list[Match]:
    """Every site of the captured graphs, less those the runtime computes once per length
    whether fused or not (all their own nodes in the memoised shape-only region,
    graph/shape_only.py `memoized_region`: a RoPE table built from `arange` in forward):
    no forward after the first runs them."""
    out = []
    for part in captured.parts:
        region = memoized_region(part.gm.graph)
        out += [m for m in find_all(part.gm, part.params) if not _computed_once(m, region)]
    return out


def _computed_once(m: Match, region: dict) -> bool:
    own = [n for n in m.nodes if n not in m.shared and n.op == "call_function"]
    return bool(own) and all(n in region for n in own)


def price(launches_removed: int, bytes_avoided: int, costs: Costs) -> float:
    """Predicted ms saved: removed launches at the measured launch cost, avoided bytes at
    the measured copy bandwidth."""
    return launches_removed * costs.launch_us * 1e-3 + bytes_avoided / (costs.copy_gbps * 1e9) * 1e3


def _launches_removed(m: Match) -> int:
    """Eager launches of the site less the fused op's (a split-K sum, a norm's pre-pass:
    the kernel's own count at its default config, `KernelSpec.launches`)."""
    if m.kernel is None and m.family.endswith("_linear"):
        return m.launches() - len([k for k in m.outputs if k.startswith("out")])
    if m.kernel is None:
        return max(0, m.launches() - 1)
    from advisor.search.space import fused_launches  # the registry and emit's call table

    return max(0, m.launches() - fused_launches(m))


def _predicted(priced: float, device: float | None) -> float:
    """The launch + bytes price, the device-measured saving where larger, and a measured
    device loss as it is (module docstring)."""
    if device is None:
        return priced
    return device if device < 0 else max(priced, device)


def candidates(matches: list[Match], costs: Costs,
               measured: Callable[[Match], float | None] | None = None,
               unmeasured: Callable[[Match], str] | None = None,
               warm: Callable[[Match], float | None] | None = None,
               sliced: Callable[[Match], Sliced | None] | None = None,
               pdl: Callable[[Match], float | None] | None = None) -> list[Candidate]:
    """One Candidate per family, ranked by predicted saving (largest first). `measured`:
    a site's measured device-time saving in ms, or None where it was not measured; a
    family is priced by it only when every site of the family was measured. `unmeasured`:
    why a site has no measurement (the first site's reason becomes the probe_note); `warm`:
    a site's saving with its activations in L2, where timed; `sliced`: a site's timing
    reading its merged producers' column blocks, where timed; `pdl`: a site's saving with
    its fused kernels launched with PDL, where timed."""
    by_family: dict[str, list[Match]] = defaultdict(list)
    for m in matches:
        by_family[m.family].append(m)
    out = []
    for family, ms in by_family.items():
        removed = sum(_launches_removed(m) for m in ms)
        avoided = sum(m.bytes_avoided() for m in ms)
        per_site = [measured(m) for m in ms] if measured is not None else [None]
        device = None if None in per_site else sum(per_site)
        warm_total = _variant_total(warm, ms, per_site) if device is not None else None
        pdl_total = _variant_total(pdl, ms, per_site) if device is not None else None
        note = ""
        if device is None and measured is not None and unmeasured is not None:
            note = next((unmeasured(m) for m, t in zip(ms, per_site) if t is None), "")
        priced = price(removed, avoided, costs)
        out.append(Candidate(
            family=family, kernel=ms[0].kernel, sites=tuple(m.module for m in ms),
            count=len(ms), launches_removed=removed, bytes_avoided=avoided,
            predicted_saving_ms=_predicted(priced, device),
            device_saving_ms=device, probe_note=note,
            site_savings_ms=tuple(per_site) if measured is not None else (), device_saving_warm_ms=warm_total,
            device_saving_pdl_ms=pdl_total,
            site_sliced=tuple(sliced(m) for m in ms) if sliced is not None else (),
        ))
    return sorted(out, key=lambda c: (-c.predicted_saving_ms, c.family))


def _variant_total(variant: Callable[[Match], float | None] | None, ms: list[Match],
                   cold: list[float]) -> float | None:
    """A probe variant's family total: each site's variant saving, its cold one where it
    has none; None where no site has one (there is no such figure to give)."""
    each = [variant(m) for m in ms] if variant is not None else []
    if not any(v is not None for v in each):
        return None
    return sum(c if v is None else v for v, c in zip(each, cold))
