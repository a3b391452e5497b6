"""Measured device-time saving of fusion sites on the analysis device.

Launches × launch cost + bytes ÷ copy bandwidth prices what a fusion removes, but not
what its kernel costs: a norm folded into a GEMM's prologue, an epilogue, RoPE inside
attention change the GEMM's or the attention's own time, which that price does not see.
So on CUDA the analyzer times each distinct site (one per `site_signature`: every layer
of a decoder shares one) both ways:

    unfused_ms = the site's captured subgraph            (runtime/rewrite.extract)
    fused_ms   = the same subgraph with the fused op     (emit, direct calls: what apply
                 emitted                                   runs; the registry's default
                                                           config, or a recipe's: analyze
                                                           --recipe prices a tuned plan)

each over enough random input copies to exceed twice the L2 (each spelling its own
copies: one reading the weights the other just read would find them in the L2), in one
CUDA graph per spelling, the graphs replayed in turn (profile/replay.py); saving =
unfused − fused per site, what a CUDA-graph replay of the model gains. Weights a kernel reads as one matrix
are laid out back to back, as apply lays them (runtime/weights.py), so neither side pays
a per-call concatenation.

Warm variant (`warm_*`, CUDA only): in a forward a site's activations were mostly just
written by the op before it and are read back from L2 where they fit, while its weights
come from HBM (each layer reads its own once). The cold probe reads both from HBM, which
may over-price an unfused chain that reads its inputs more than once. So each site is
also timed with its activation inputs (those computed in the forward, not graph inputs)
read once just before it (a sum over each: it pulls them into L2), minus that touch
timed alone. Graph inputs stay cold: weights, the caller's tensors, a KV cache. Which of
the two a forward sees lies between them (the residual stream was written layers of
traffic ago); both are recorded for the report.

Column-block variant (`sliced_*`, CUDA only): a site reading outputs of GEMMs that a merge
(or a norm folded into several projections) turns into column blocks of one result is
timed a second time reading them so (runtime/column_blocks.py), beside the captured
spelling on contiguous inputs (three graphs in turn) so what the blocks cost is one
call's difference: what the site saves in a plan that merges its producers, and what the
merge costs the readers it leaves unfused.

PDL variant (`pdl_*`, CUDA sm_90+): the fused spelling with its kernels launched with
programmatic dependent launch, as a plan with `pdl` runs them, against the captured one
(aten and cuBLAS kernels never launch so). Each copy's kernel then overlaps the previous
one's tail; a one-token GEMV prefetches its weights under it (kernels/_triton.py). A plan
with PDL priced without it under-priced the one-token GEMV families' leave-one-out by
half (session 21: linear_residual 0.022 ms predicted, 0.087 measured). An upper bound:
here each kernel follows a copy of itself, which lets the next one start early, where
in a forward an aten or cuBLAS kernel before it never does. A failed PDL capture on a
device that still works leaves the site without this variant.

Inputs the runtime computes from sizes alone and keeps once per length (graph/shape_only.py:
a `transformers` prefill's causal mask) get their real values, marked when causal, and
the captured spelling's SDPA reads a marked mask as `is_causal` (runtime/causal_sdpa.py),
as both run in a forward; with a random mask both sides timed masked kernels.

Nodes a site shares with other sites (Match.shared: one causal mask read by every
layer's attention) are outputs of both spellings, so both compute them and the site's
saving does not count them once per layer (the candidates do not price them either).

Not probed (left to the launch + bytes price, with the reason kept): merges (their own
probe, profile/merge_probe.py), anything off CUDA (the fused side would run Triton's
interpreter), and a site whose emit or kernel fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from advisor.errors import one_line
from advisor.graph.candidates import Sliced
from advisor.graph.capture import fake, hint
from advisor.graph.cse import storage_bases, view_chain
from advisor.graph.dce import eliminate_dead
from advisor.graph.match import Match
from advisor.graph.shape_only import shape_only_key, shape_only_region, shape_only_value
from advisor.kernels._triton import pdl_supported, programmatic_launch
from advisor.kernels.registry import all_kernels
from advisor.kernels.testing import randn_nonzero
from advisor.profile.merge_probe import MERGE_KERNEL
from advisor.profile.replay import CaptureFailed, copies_past_l2, spellings_ms
from advisor.runtime.causal_sdpa import read_marked_masks
from advisor.runtime.column_blocks import ColumnBlock, as_in_block, blocks_read, column_blocks
from advisor.runtime.direct import use_direct_calls
from advisor.runtime.emit import emit
from advisor.runtime.rewrite import Generators, extract, random_like, site_signature

DEFAULT_CONFIG = ""  # the registry's default config for the site's problem


Pair = tuple[float | None, float | None]  # (unfused, fused) ms of a probe variant


@dataclass(frozen=True)
class SiteTiming:
    unfused_ms: float  # per site
    fused_ms: float
    warm_unfused_ms: float | None = None  # activations read from L2 (module doc); None: not timed
    warm_fused_ms: float | None = None
    # producers' outputs read as column blocks, each the cold unfused_ms plus its difference
    # from the captured spelling timed beside it on contiguous inputs; None: not timed
    sliced_unfused_ms: float | None = None
    sliced_fused_ms: float | None = None
    pdl_unfused_ms: float | None = None  # the captured spelling, timed beside the next one
    pdl_fused_ms: float | None = None    # our kernels launched with PDL; None: not timed

    @property
    def saving_ms(self) -> float:
        return self.unfused_ms - self.fused_ms

    @property
    def warm_saving_ms(self) -> float | None:
        return _saving(self.warm_unfused_ms, self.warm_fused_ms)

    @property
    def sliced_saving_ms(self) -> float | None:
        return _saving(self.sliced_unfused_ms, self.sliced_fused_ms)

    @property
    def pdl_saving_ms(self) -> float | None:
        return _saving(self.pdl_unfused_ms, self.pdl_fused_ms)


def _saving(unfused: float | None, fused: float | None) -> float | None:
    """A variant's saving; None where it was not timed."""
    return None if unfused is None or fused is None else unfused - fused


class GraphFacts:
    """What the probe asks of a captured graph, each computed once per graph: its
    shape-only region (graph/shape_only.py), its nodes' structural keys in it, and each
    node's storage base (graph/cse.py); and the GEMM outputs merges turn into column
    blocks (runtime/column_blocks.py), from every match probed together."""

    def __init__(self, blocks: dict[fx.Node, ColumnBlock] | None = None) -> None:
        self.blocks = blocks or {}
        self._indices: dict[fx.Graph, int] = {}
        self._regions: dict[fx.Graph, dict[fx.Node, None]] = {}
        self._keys: dict[fx.Graph, dict[fx.Node, Any]] = {}
        self._bases: dict[fx.Graph, dict[fx.Node, fx.Node]] = {}

    def region(self, graph: fx.Graph) -> dict[fx.Node, None]:
        if graph not in self._regions:
            self._regions[graph] = shape_only_region(graph)
        return self._regions[graph]

    def key(self, node: fx.Node) -> Any:
        return shape_only_key(node, self.region(node.graph), self._keys.setdefault(node.graph, {}))

    def bases(self, graph: fx.Graph) -> dict[fx.Node, fx.Node]:
        if graph not in self._bases:
            self._bases[graph] = storage_bases(graph)
        return self._bases[graph]

    def graph_index(self, graph: fx.Graph) -> int:
        """A number per graph, in the order they are first asked for (node names repeat
        across the parts of one capture)."""
        return self._indices.setdefault(graph, len(self._indices))

    def blocks_read(self, inputs: list[fx.Node]) -> dict[int, ColumnBlock]:
        if not inputs or not self.blocks:
            return {}
        return blocks_read(inputs, self.bases(inputs[0].graph), self.blocks)


def probe_key(m: Match, facts: GraphFacts, config: str = DEFAULT_CONFIG) -> tuple:
    """Sites timed alike: the site signature, how the kept inputs it reads are built (a
    model whose layers alternate a causal and a sliding-window mask of one shape has two
    kinds of site; a decoder's per-layer copies of one mask, one), and which inputs are
    merges' column blocks, where, and through which views (runtime/column_blocks.py)."""
    inputs = m.external_inputs()
    region = facts.region(inputs[0].graph) if inputs else {}
    kept = tuple(facts.key(inputs[i]) for i in kept_inputs(inputs, region))
    bases = facts.bases(inputs[0].graph) if inputs else {}
    blocks = tuple((i, b.width, b.start, tuple(str(v.target) for v in view_chain(n, bases[n]) or ()))
                   for i, b in facts.blocks_read(inputs).items() for n in [inputs[i]])
    return (*site_signature(m, config), kept, blocks)


@dataclass(frozen=True)
class SiteProbe:
    timings: dict[tuple, SiteTiming]   # probe_key -> timing
    skipped: dict[tuple, str]          # probe_key -> why it was not timed
    facts: GraphFacts = field(default_factory=GraphFacts, repr=False)  # for the keys
    configs: Mapping[str, str] = field(default_factory=dict)  # family -> the config probed

    def _key(self, m: Match) -> tuple:
        return probe_key(m, self.facts, self.configs.get(m.family, DEFAULT_CONFIG))

    def saving_ms(self, m: Match) -> float | None:
        t = self.timings.get(self._key(m))
        return None if t is None else t.saving_ms

    def warm_saving_ms(self, m: Match) -> float | None:
        t = self.timings.get(self._key(m))
        return None if t is None else t.warm_saving_ms

    def pdl_saving_ms(self, m: Match) -> float | None:
        t = self.timings.get(self._key(m))
        return None if t is None else t.pdl_saving_ms

    def sliced(self, m: Match) -> Sliced | None:
        """The site's column-block timing (module doc); None where it reads no block or
        that timing failed."""
        t = self.timings.get(self._key(m))
        if t is None or t.sliced_saving_ms is None or t.sliced_unfused_ms is None:
            return None
        inputs = m.external_inputs()
        read = self.facts.blocks_read(inputs)
        part, bases = self.facts.graph_index(m.nodes[0].graph), self.facts.bases(m.nodes[0].graph)
        return Sliced(t.sliced_saving_ms, t.sliced_unfused_ms - t.unfused_ms,
                      tuple(sorted({f for b in read.values() for f in b.by})),
                      tuple(sorted({f"{part}:{bases[inputs[i]].name}" for i in read})))

    def reason(self, m: Match) -> str:
        """Why `m` has no timing ("" when it has one; "not probed" when never seen)."""
        key = self._key(m)
        return "" if key in self.timings else self.skipped.get(key, "not probed")


def skip_reason(m: Match, device: torch.device) -> str | None:
    if device.type != "cuda":
        return "not on CUDA: the fused side would time Triton's interpreter"
    if m.kernel is None:
        return "no kernel"
    if m.kernel == MERGE_KERNEL:
        return "merges are timed by profile/merge_probe.py"
    return None


def _arg_sets(m: Match, inputs: list[Any], copies: int, seed: int,
              kept: dict[int, torch.Tensor] | None = None) -> list[list[Any]]:
    """`copies` independent random input sets for the extracted site; a kernel's weight
    list (operands["weights"]) as adjacent row slices of one (ΣN, K) buffer; `kept`: inputs
    the runtime computes once per length (`kept_inputs`), the same tensor in every set."""
    gen, kept = Generators(seed), kept or {}
    weights = [inputs.index(w) for w in m.operands.get("weights", []) if w in inputs]
    sets = []
    for _ in range(copies):
        args = [kept[i] if i in kept else random_like(n, gen, m.operands.get("slots"), m.operands.get("keys"))
                for i, n in enumerate(inputs)]
        if len(weights) > 1:
            buffer = torch.cat([args[i] for i in weights])  # (ΣN, K)
            start = 0
            for i in weights:
                rows = args[i].shape[0]
                args[i] = buffer[start:start + rows]
                start += rows
        sets.append(args)
    return sets


def activations(inputs: list[fx.Node], args: list[Any], bases: dict[fx.Node, fx.Node]) -> list[int]:
    """Indices of the site's floating-point inputs computed in the forward itself: what the
    warm probe reads into L2 before the site. An input whose storage is a graph input's
    (weights, the caller's tensors, a KV cache even after an in-place write or through a
    view: `bases`, graph/cse.py `storage_bases`) stays cold."""
    return [i for i, (n, a) in enumerate(zip(inputs, args))
            if bases.get(n, n).op != "placeholder" and isinstance(a, torch.Tensor) and a.is_floating_point()]


def _span(t: torch.Tensor) -> torch.Tensor:
    """The memory a view reads, once, as a flat view (a broadcast dim read once, not per
    index: the touch reads what the site reads)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.as_strided((span,), (1,)) if t.numel() else t


def _set_bytes(args: list[Any]) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def kept_inputs(inputs: list[fx.Node], region: dict[fx.Node, None]) -> list[int]:
    """Indices of the site's inputs the runtime computes from sizes alone and keeps once
    per length (`region`: the graph's shape-only region, graph/shape_only.py: transformers'
    causal mask). The probe gives them their real values (`shape_only_value`, marked when
    causal and kept): a random mask in their place would time the masked kernels where the
    runtime's SDPA and ours read it as `causal=True`."""
    return [i for i, n in enumerate(inputs) if n in region and n.op != "get_attr"]


def spellings(m: Match, region: dict[fx.Node, None], config: str = DEFAULT_CONFIG
              ) -> tuple[fx.GraphModule, fx.GraphModule, list[fx.Node], list[int]]:
    """The site as captured and with the fused op (its kernel in `config`), as the runtime
    would run them (SDPA reading a kept mask takes `is_causal` where it is marked causal:
    runtime/causal_sdpa.py); its input nodes and the kept ones (`kept_inputs`)."""
    all_kernels()  # importing the kernel modules registers their custom ops
    # Nodes other sites read too (one mask, every layer) are outputs of both spellings:
    # computed on both sides, so not priced into this site's saving (Match.shared).
    ref_gm, inputs, _ = extract(m, keep=m.shared)
    fused_gm, _, local = extract(m, keep=m.shared)
    emit(fused_gm.graph, local, config)
    eliminate_dead(fused_gm.graph)  # the captured SDPA, dead beside our attention, too
    kept = kept_inputs(inputs, region)
    names = {ref_gm.graph.find_nodes(op="placeholder")[i].name for i in kept}
    read_marked_masks(ref_gm, lambda n: isinstance(n, fx.Node) and n.op == "placeholder" and n.name in names)
    use_direct_calls(fused_gm)
    return ref_gm, fused_gm, inputs, kept


def time_site(m: Match, device: torch.device | str, seed: int = 0,
              facts: GraphFacts | None = None, config: str = DEFAULT_CONFIG) -> SiteTiming:
    """Device ms per site of the captured subgraph and of the fused op, cold and (CUDA)
    warm, reading merges' column blocks where it does, and with PDL where the device has
    it (module doc); a variant that fails leaves the cold timing standing. A kept input
    whose value cannot be computed fails the site (no random mask in its place)."""
    device = torch.device(device)
    facts = facts or GraphFacts()
    graph = m.nodes[0].graph
    region = facts.region(graph)
    ref_gm, fused_gm, inputs, kept_at = spellings(m, region, config)
    with unset_fake_temporarily(), torch.inference_mode():
        kept = {i: shape_only_value(inputs[i], region) for i in kept_at}
        first = _arg_sets(m, inputs, 1, seed, kept)
        # one kept tensor serves every copy: it neither counts toward the copies past the
        # L2 nor is warmed (a causal reader skips it; it is kept across forwards)
        own = [a for i, a in enumerate(first[0]) if i not in kept]
        copies = copies_past_l2(_set_bytes(own), device)
        # Each graph timed in one call reads its own copies: replayed in turn, a spelling
        # reading the same weights as the one before it hits what that one left in the L2
        # (session 23, H100: a 117 MB down_proj GEMV 6.7 µs faster after cuBLAS read it).
        sets = [first + _arg_sets(m, inputs, copies - 1, seed + 1, kept)]

        def own_sets(k: int) -> list[list[Any]]:
            while len(sets) <= k:
                sets.append(_arg_sets(m, inputs, copies, seed + 10 * len(sets), kept))
            return sets[k]
        acts = [i for i in activations(inputs, first[0], facts.bases(graph)) if i not in kept]

        def over(gm: torch.fx.GraphModule | None, runs: list[list[Any]], touch: bool = False,
                 pdl: bool = False):
            reads = [[_span(args[i]) for i in acts] if touch else [] for args in runs]

            def run() -> None:
                with programmatic_launch(pdl):  # read at each launch: kept by the capture
                    for args, touched in zip(runs, reads):
                        for t in touched:
                            t.sum()  # read once: in L2 for the site (module doc)
                        if gm is not None:
                            gm(*args)
            return run
        per_site = lambda *ms: tuple(t / copies for t in ms)  # noqa: E731
        unfused, fused = per_site(*spellings_ms([over(ref_gm, own_sets(0)), over(fused_gm, own_sets(1))],
                                                device))
        if device.type != "cuda":
            return SiteTiming(unfused, fused)

        def warm_ms() -> Pair:
            if not acts:
                return None, None
            touched = [over(None, own_sets(2), True), over(ref_gm, own_sets(0), True),
                       over(fused_gm, own_sets(1), True)]
            touch, ref_ms, fused_ms = spellings_ms(touched, device)
            return per_site(ref_ms - touch, fused_ms - touch)

        def sliced_ms() -> Pair:
            blocks = facts.blocks_read(inputs)
            if not blocks:
                return None, None
            ref_runs, fused_runs = (_in_blocks(inputs, own_sets(k), blocks, facts.bases(graph), seed + 2 + k)
                                    for k in (1, 2))
            # beside the captured spelling on contiguous inputs, so what the blocks cost it
            # is one call's difference; re-based on the cold timing
            ref_ms, ref_blocks, fused_blocks = per_site(*spellings_ms(
                [over(ref_gm, own_sets(0)), over(ref_gm, ref_runs), over(fused_gm, fused_runs)], device))
            return unfused + ref_blocks - ref_ms, unfused + fused_blocks - ref_ms

        def pdl_ms() -> Pair:
            if not pdl_supported(device):
                return None, None
            try:
                return per_site(*spellings_ms([over(ref_gm, own_sets(0)),
                                               over(fused_gm, own_sets(1), pdl=True)], device))
            except CaptureFailed:  # PDL launches in a graph: driver- and Triton-dependent
                if not _usable(device):
                    raise
                return None, None
        return SiteTiming(unfused, fused, *_or_untimed(warm_ms), *_or_untimed(sliced_ms),
                          *_or_untimed(pdl_ms))


def _usable(device: torch.device) -> bool:
    """The device still runs work after a failed capture (then only that variant failed)."""
    try:
        torch.cuda.synchronize(device)
        return bool(torch.ones(1, device=device).add_(1).item() == 2)
    except Exception:  # noqa: BLE001
        return False


def _or_untimed(variant: Callable[[], Pair]) -> Pair:
    """A variant's (unfused, fused) timing; (None, None) where it fails: the cold timing
    stands without it. A failed capture is raised (the device may be unusable: probe_sites
    stops probing)."""
    try:
        return variant()
    except CaptureFailed:
        raise
    except Exception:  # noqa: BLE001
        return None, None


def _in_blocks(inputs: list[fx.Node], sets: list[list[Any]], blocks: dict[int, ColumnBlock],
               bases: dict[fx.Node, fx.Node], seed: int) -> list[list[Any]]:
    """`sets` with the inputs in `blocks` read from column blocks: per set, one random
    (M, width) buffer per merged result (q and k of one QKV merge share one)."""
    gen, out = Generators(seed), []
    for args in sets:
        args, buffers = list(args), {}
        for i, b in blocks.items():
            if b.group not in buffers:
                rows = hint(fake(bases[inputs[i]]).shape[0])
                buffers[b.group] = randn_nonzero((rows, b.width), args[i].dtype, args[i].device,
                                                 gen.on(args[i].device))
            args[i] = as_in_block(inputs[i], bases[inputs[i]], b, buffers[b.group])
        out.append(args)
    return out


def probe_sites(matches: Iterable[Match], device: torch.device | str,
                configs: Mapping[str, str] | None = None) -> SiteProbe:
    """Each distinct site among `matches`, timed once on `device` (or skipped, with why);
    `configs`: family -> kernel config its fused spelling runs (a tuned plan's, to price
    that plan; the registry default for the others)."""
    configs = dict(configs or {})
    device = torch.device(device)
    timings: dict[tuple, SiteTiming] = {}
    skipped: dict[tuple, str] = {}
    matches = list(matches)
    facts = GraphFacts(column_blocks(matches))
    stopped = ""
    for m in matches:
        config = configs.get(m.family, DEFAULT_CONFIG)
        key = probe_key(m, facts, config)
        if key in timings or key in skipped:
            continue
        reason = f"probing stopped after a failed capture: {stopped}" if stopped else skip_reason(m, device)
        if reason is not None:
            skipped[key] = reason
            continue
        try:
            timings[key] = time_site(m, device, facts=facts, config=config)
        except CaptureFailed as exc:  # later captures may fail for this one's sake
            stopped = skipped[key] = f"CaptureFailed: {exc}"[:200]
        except Exception as exc:  # emit refused, a kernel failed to compile or to capture
            skipped[key] = one_line(exc)[:200]
    return SiteProbe(timings, skipped, facts, configs)
