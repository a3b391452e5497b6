"""Predicted vs measured savings per fusion family: the numbers behind issue 7's ±25% (pure).

Two measurements come from `advisor bench` (advisor/ablation.py):

- alone (`--alone`): the family by itself on the unfused model, under CUDA graphs as the
  plan, without PDL. It is what the analyzer predicts, so the prediction is compared as it
  stands: the site probes' measured device saving (`device_saving_ms`), else launches at a
  small kernel's device time + bytes at copy bandwidth (`graph_priced`). The probes' warm
  variant (activations in L2, `device_saving_warm_ms`) is shown beside it.
- leave-one-out (`--ablate`): the plan without the family. Its sites go back to shallower
  families, so the prediction is the family's margin over them (`marginal_prediction`),
  site by site where the bench names the sites. In a plan with PDL the families are
  priced by the probes' PDL variant (`device_saving_pdl_ms`) where the analysis has it:
  a family total, split over its sites as their cold savings are, and column-block
  deltas stay the cold ones (approximations; the warm column keeps no PDL figures).

Both account for merges' column blocks (runtime/column_blocks.py): where the plan merges
the GEMMs a site reads, the site is priced at its timing reading their blocks, and a merge's
price is net of what its blocks cost their readers (`readers_penalty`): the H100's
gated_act saved 0.074 ms alone and 0.249 ms inside the plan at 512 tokens, the gate/up
merge −0.051 alone and +0.095 inside it.

Each comparison is an `Accuracy` row; `error` = (predicted − measured) / |measured|. The
measurement's own noise is the larger of the spread of its baseline's timings (the
unfused model before and after the alone rows; the plan before and after the
leave-one-outs, and the recipe's own row: another apply of the same plan in the same
process) and the spread of the row's own timings (`bench --repeats`). That last one matters: on an
H100 (session 21, 512 tokens) the plan's two timings agreed within 6 µs while the recipe's
row differed from them by 52 µs, and the leave-one-outs of that run all read ~50 µs low.
A miss within the noise (`within_noise`) cannot be told from a wrong model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from advisor.report.html_common import _num
from advisor.runtime.plan import CUDA_GRAPH, PDL

TOLERANCE = 0.25  # issue 7: predicted savings within ±25% of measured
ALONE, LEAVE_ONE_OUT = "alone", "leave-one-out"


def ablation_at(bench: dict | None, length: int) -> dict[str, dict]:
    """removed family -> its ablation row at this length (empty without --ablate)."""
    return {str(r.get("removed")): r for r in (bench or {}).get("ablation", []) or []
            if r.get("shape") == length}


def alone_at(bench: dict | None, length: int) -> dict[str, dict]:
    """family -> its row timed alone on the unfused model at this length (empty without --alone)."""
    return {str(r.get("family")): r for r in (bench or {}).get("alone", []) or [] if r.get("shape") == length}


def plan_families(ablated: dict[str, dict], cands: dict[str, dict]) -> set[str]:
    """The families of the plan a leave-one-out bench ablated that hold sites in it (a
    family that applied none, `same_graph`, merges nothing and fuses no reader; the
    plan's flags, CUDA graphs and PDL, are not candidates)."""
    return {f for f, r in ablated.items()
            if f in cands and not r.get("same_graph") and r.get("sites_in_plan") != 0}


SMALL_KERNEL_BYTES = 1 << 20  # kernels moving less than this cost their fixed time alone


def small_kernel_us(shape: dict) -> float | None:
    """Mean device time (µs) of one small kernel (< 1 MiB moved) in this shape's profile:
    what a removed launch saves inside a CUDA graph — the kernel's launch gap, ramp and
    tail on the GPU (H200, 1 token: 1.60 µs over 278 kernels), more than the empty-kernel
    graph launch the ceilings measure (0.94 µs). None without a profile."""
    ops = (shape.get("budget") or {}).get("ops") or []
    small = [(o["device_ms"], o["kernels"]) for o in ops
             if o.get("kernels") and (o.get("bytes") or 0) < SMALL_KERNEL_BYTES * o["kernels"]]
    n = sum(k for _, k in small)
    return sum(ms for ms, _ in small) * 1e3 / n if n else None


def graph_priced(c: dict, ceilings: dict | None, kernel_us: float | None = None) -> float | None:
    """The candidate's predicted saving under CUDA graphs: its measured device-time saving
    where the analyzer timed it (`device_saving_ms`: profile/merge_probe.py for merges,
    runtime/site_probe.py for the other families on CUDA); else
    each removed launch at `kernel_us` (a small kernel's measured device time,
    `small_kernel_us`) where known, else at the graph launch cost, plus bytes ÷ copy
    bandwidth (None without ceilings)."""
    if (device := _num(c.get("device_saving_ms"))) is not None:
        return device
    g, bw = _num((ceilings or {}).get("graph_launch_us")), _num((ceilings or {}).get("copy_gbps"))
    g = kernel_us if kernel_us is not None else g
    launches, nbytes = _num(c.get("launches_removed")), _num(c.get("bytes_avoided"))
    if None in (g, bw, launches, nbytes) or not bw:
        return None
    return launches * g * 1e-3 + nbytes / (bw * 1e9) * 1e3


def _site_price(c: dict, p: float, module: str) -> float:
    """A family's price at one of its sites: the site's own measured saving, scaled as the
    family's price is to its measured total (1 when the price is that total; a re-priced
    family keeps the sites' proportions), where the analysis has it; else the mean. A
    module named by several sites (a function's sites are named after it: RoPE's
    `apply_rotary_pos_emb` in every layer) gets their mean."""
    sites, each, total = c.get("sites") or [], c.get("site_savings_ms") or [], _num(c.get("device_saving_ms"))
    at = [e for s, e in zip(sites, each) if s == module]
    # a total near 0, or of the other sign than the price, gives no proportions to scale
    if at and len(each) == len(sites) and None not in each and total and p / total > 0 and abs(total) > 1e-6:
        return sum(at) / len(at) * p / total
    return p / c["count"]


def _block_delta(c: dict, module: str, merged: set[str]) -> float:
    """What a site of `c` named `module` saves more (or less) where a family of `merged`
    turns the GEMM outputs it reads into column blocks: its block timing's saving minus its
    own (mean over the sites of that name; 0 where it reads no block or the plan merges
    none of them)."""
    sites, each, blocks = c.get("sites") or [], c.get("site_savings_ms") or [], c.get("site_sliced") or []
    if len(blocks) != len(sites) or len(each) != len(sites):
        return 0.0
    at = [b["saving_ms"] - e if b and e is not None and set(b["by"]) & merged else 0.0
          for s, e, b in zip(sites, each, blocks) if s == module]
    return sum(at) / len(at) if at else 0.0


def _block_readers(cands: dict[str, dict], producer: str, first: set[str]) -> list[tuple[str, int, dict]]:
    """(family, site index, block timing) of the sites reading `producer`'s blocks, each
    block input counted once: sites of the families in `first` (the plan's: they hold the
    readers) before others, then the narrowest reader (RoPE's q, k and attention's v
    before attention with RoPE's q, k, v)."""
    readers = [(f, i, b) for f, c in cands.items() for i, b in enumerate(c.get("site_sliced") or [])
               if b and producer in b["by"]]
    readers.sort(key=lambda r: (r[0] not in first, len(r[2]["reads"]), r[0], r[1]))
    chosen, covered = [], set()
    for f, i, b in readers:
        if not set(b["reads"]) & covered:
            covered |= set(b["reads"])
            chosen.append((f, i, b))
    return chosen


def readers_penalty(cands: dict[str, dict], producer: str, plan: set[str], still_merged: set[str]) -> float:
    """What `producer`'s column blocks cost the sites reading them (ms, per forward): each
    reader's extra time on blocks, fused where its family is in `plan`, else unfused;
    readers whose blocks a family of `still_merged` produces anyway are left out."""
    total = 0.0
    for f, i, b in _block_readers(cands, producer, plan):
        if set(b["by"]) & still_merged:
            continue
        if f not in plan:
            total += b["unfused_penalty_ms"]
            continue
        each = cands[f].get("site_savings_ms") or []
        own = each[i] if i < len(each) else None
        if own is not None:  # fused on blocks − fused = unfused penalty − the saving's change
            total += b["unfused_penalty_ms"] - (b["saving_ms"] - own)
    return total


def marginal_prediction(row: dict, cands: dict[str, dict],
                        price: Callable[[dict], float | None], plan: set[str] | None = None) -> float | None:
    """What leaving the row's family out should cost: its price at the sites it held in
    the plan, minus, for each family that took sites back without it, that family's price
    at those sites (advisor/ablation.py). Site by site where the row names the modules
    (`held_sites`, `taken_sites`) and the analysis has each site's saving (a deep family's
    sites differ: QKV projections and the lm_head); else the price per site times the
    counts. `plan`: the plan's families; a site reading GEMM outputs that the plan without
    the row's family still merges is priced at its column-block timing (`_block_delta`).
    None where the row lacks the site counts (benches before session 14) or a price is
    missing."""
    c, held = cands.get(str(row.get("removed"))), row.get("sites_in_plan")
    if c is None or held is None or "taken_over" not in row:
        return None
    named = "held_sites" in row and "taken_sites" in row
    taken = row["taken_sites"] if named else row["taken_over"]
    terms = [(row["removed"], row["held_sites"] if named else held, 1.0),
             *((g, x, -1.0) for g, x in taken.items())]
    merged = (plan or set()) - {row["removed"]}
    total = 0.0
    for fam, sites, sign in terms:
        cg = cands.get(fam)
        p = price(cg) if cg else None
        if p is None or not cg.get("count"):
            return None
        total += sign * (sum(_site_price(cg, p, m) + _block_delta(cg, m, merged) for m in sites)
                         if named else p * sites / cg["count"])
    return total


def price(c: dict, ceilings: dict | None, kernel_us: float | None, graphs: bool,
          warm: bool = False, pdl: bool = False) -> float | None:
    """A family's predicted saving: eager-priced without CUDA graphs; under them re-priced
    for them (`graph_priced`), with `pdl` (the plan launches our kernels so; graphs only)
    the probes' PDL variant where the analysis has it, or with `warm` the probes' warm
    variant (None where the analysis has none, and without graphs)."""
    if warm:  # the probes' warm variant prices a CUDA-graph replay only
        return _num(c.get("device_saving_warm_ms")) if graphs else None
    if not graphs:
        return _num(c.get("predicted_saving_ms"))
    if pdl and (with_pdl := _num(c.get("device_saving_pdl_ms"))) is not None:
        return with_pdl
    return graph_priced(c, ceilings, kernel_us)


def alone_prediction(row: dict, c: dict, ceilings: dict | None, kernel_us: float | None,
                     warm: bool = False, cands: dict[str, dict] | None = None) -> float | None:
    """The prediction an alone row measures: the family's price (`price`, under CUDA
    graphs when the row ran under them) at the sites it applied (`applied_sites`, where
    the row names them: a refused site saves nothing), else at all of them; a merge net of
    what its blocks cost the (unfused) sites reading them, given the analysis's `cands`."""
    fam = str(row.get("family"))
    p = price(c, ceilings, kernel_us, bool(row.get(CUDA_GRAPH)), warm)
    if p is None:
        return p
    # a merge alone: the unfused model reads its blocks (at the share of its sites applied)
    penalty = readers_penalty(cands, fam, {fam}, set()) if cands is not None else 0.0
    if "applied_sites" not in row:
        return p - penalty
    share = len(row["applied_sites"]) / c["count"] if c.get("count") else 1.0
    return sum(_site_price(c, p, m) for m in row["applied_sites"]) - penalty * share


def leave_one_out_prediction(row: dict, cands: dict[str, dict], ceilings: dict | None,
                             kernel_us: float | None, graphs: bool, warm: bool = False,
                             plan: set[str] | None = None, pdl: bool = False) -> float | None:
    """The prediction a leave-one-out row measures: the family's margin over the families
    that took its sites back where the row allows (else its own price), priced for CUDA
    graphs when the plan used them, and for PDL when it launched with it (`pdl`). `warm`:
    the removed family's warm price (None without one), the others' warm price where
    they have one. `plan`: the plan's families, for merges' column blocks (module doc)."""
    fam = str(row.get("removed"))
    own = cands[fam]
    if warm and price(own, ceilings, kernel_us, graphs, warm=True) is None:
        return None

    def priced(x: dict) -> float | None:  # the warm column: warm against cold, no PDL figures
        if warm:
            w = price(x, ceilings, kernel_us, graphs, warm=True)
            return w if w is not None else price(x, ceilings, kernel_us, graphs)
        return price(x, ceilings, kernel_us, graphs, pdl=pdl)
    margin = marginal_prediction(row, cands, priced, plan)
    if margin is None:
        margin = priced(own)
    if margin is None or not plan:
        return margin
    return margin - readers_penalty(cands, fam, plan, plan - {fam})


@dataclass(frozen=True)
class Accuracy:
    shape: int
    family: str
    source: str                  # ALONE | LEAVE_ONE_OUT
    predicted_ms: float | None
    warm_ms: float | None        # the same with the probes' warm variant
    measured_ms: float | None
    noise_ms: float | None       # larger spread of the baseline's timings and the row's own
    sites: int | None

    def within_noise(self) -> bool | None:
        """The miss is no larger than the measurement's noise (None without both)."""
        if self.predicted_ms is None or self.measured_ms is None or self.noise_ms is None:
            return None
        return abs(self.predicted_ms - self.measured_ms) <= self.noise_ms

    @property
    def error(self) -> float | None:
        if self.predicted_ms is None or not self.measured_ms:
            return None
        return (self.predicted_ms - self.measured_ms) / abs(self.measured_ms)

    def within(self, tolerance: float = TOLERANCE) -> bool | None:
        return None if self.error is None else abs(self.error) <= tolerance


def _noise(baseline: list | None, row: list | None) -> float | None:
    """The larger spread of the baseline's timings and the row's own (repeats)."""
    spreads = [s for s in (_spread(baseline), _spread(row)) if s is not None]
    return max(spreads) if spreads else None


def _spread(runs: list | None) -> float | None:
    runs = [r for r in runs or [] if _num(r) is not None]
    return max(runs) - min(runs) if len(runs) > 1 else None


def accuracy(analysis: dict, bench: dict | None) -> list[Accuracy]:
    """Every family measured alone or left out at an analysed length, against its prediction.
    Rows of families that held no site (left out: not timed; alone: none found) and of the
    plan flags are left out."""
    out: list[Accuracy] = []
    for s in analysis.get("shapes", []):
        length, ceilings = s.get("seq_len"), analysis.get("ceilings")
        cands = {str(c.get("family")): c for c in s.get("candidates", [])}
        kernel_us = small_kernel_us(s)
        for fam, row in alone_at(bench, length).items():
            if fam in cands and row.get("sites") != 0:  # a family that found no site alone
                args = (row, cands[fam], ceilings, kernel_us)
                out.append(Accuracy(length, fam, ALONE, alone_prediction(*args, cands=cands),
                                    alone_prediction(*args, warm=True, cands=cands),
                                    _num(row.get("measured_saving_ms")),
                                    _noise(row.get("unfused_ms_runs"), row.get("with_ms_runs")),
                                    row.get("sites")))
        ablated = ablation_at(bench, length)
        graphs, pdl = CUDA_GRAPH in ablated, PDL in ablated  # the plan's flags are rows too
        plan = plan_families(ablated, cands)
        for fam, row in ablated.items():
            if fam in cands and not row.get("same_graph"):
                args = (row, cands, ceilings, kernel_us, graphs)
                out.append(Accuracy(length, fam, LEAVE_ONE_OUT,
                                    leave_one_out_prediction(*args, plan=plan, pdl=pdl),
                                    leave_one_out_prediction(*args, warm=True, plan=plan, pdl=pdl),
                                    _num(row.get("measured_saving_ms")),
                                    _noise([*(row.get("plan_ms_runs") or []), row.get("recipe_ms")],
                                           row.get("without_ms_runs")),
                                    row.get("sites_in_plan")))
    return out
