"""Rewrite an aten graph by a plan: each enabled site is confirmed, then replaced.

A site is confirmed numerically before it is accepted: its subgraph is cut out into a
small graph of its own, fed fresh random non-zero inputs of the site's shapes, and run
once as captured and once with the fused op emitted; outputs must agree within the dtype's
tolerance (NaN-free). Sites with one signature (family, shapes, dtypes, constants) are
confirmed once; a round's new signatures are confirmed at once, in threads
(`confirm_ahead`), so their kernels' first compiles overlap. A site that fails is left
unfused and reported with the reason.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from advisor.errors import one_line
from advisor.graph.canonical import canonicalize
from advisor.graph.capture import fake, hint, module_path
from advisor.graph.cse import eliminate_common_subexpressions
from advisor.graph.dce import eliminate_dead, removable
from advisor.graph.inplace import batch_input_increments
from advisor.graph.match import Match, is_op, launches
from advisor.graph.patterns import find_all
from advisor.graph.patterns.attention import SOFTMAX_OPS
from advisor.graph.shape_only import memoize_shape_only
from advisor.kernels._triton import interpreting
from advisor.kernels.registry import all_kernels
from advisor.kernels.space import refused_configs
from advisor.kernels.testing import max_abs_error, max_violation, randn_nonzero, tolerance
from advisor.runtime.causal_sdpa import read_marked_masks
from advisor.runtime.direct import use_direct_calls
from advisor.runtime.emit import EmitError, emit
from advisor.runtime.outside_graph import move_large_outputs
from advisor.runtime.plan import Plan


@dataclass(frozen=True)
class SiteResult:
    family: str
    module: str
    applied: bool
    reason: str = ""          # why a site was left unfused
    max_error: float = 0.0
    note: str = ""            # applied, but worth saying (a config that ran as the default)


@dataclass(frozen=True)
class Confirmed:
    """A site signature that passed confirmation: its max error, and the configs its
    kernels were given but ran their default in place of (not kept for the shapes
    confirmed, i.e. the trace's example length)."""

    max_error: float
    refused: tuple[str, ...] = ()


@dataclass(frozen=True)
class RewriteReport:
    sites: tuple[SiteResult, ...]
    launches_before: int
    launches_after: int
    merged_weights: tuple[tuple[str, ...], ...] = ()   # parameter FQNs read as one tensor
    in_place_writes: int = 0  # input (KV cache) updates put back in place
    repeats_merged: int = 0  # ops identical to an earlier one, removed (graph/cse.py)
    increments_batched: int = 0  # input counters (p += c) written by one _foreach_add_
    shape_only_memoized: int = 0  # launches computed from sizes alone, once (graph/shape_only.py)
    causal_sdpa: int = 0  # SDPA nodes that read a kept causal mask as is_causal (causal_sdpa.py)
    outputs_outside_graph: int = 0  # large outputs computed after a replay, not cloned (outside_graph.py)
    seconds: float = 0.0  # host time of the whole rewrite (part of a first call's cold start)
    confirm_seconds: float = 0.0  # of which confirming sites (their kernels' first compiles too)
    identity_copies_dropped: int = 0  # clones (eval dropout) and cats of one value (graph/copies.py)
    # modules of softmaxes left in the graph while attention fusion was on: attention (or a
    # router) in a spelling no pattern reads — a user's cue where fusion stopped
    softmax_left: tuple[str, ...] = ()


# Building a site's graphs infers each new node's fake value under the trace's one
# FakeTensorMode, whose state (enter stack, in-kernel flag) is the object's, not the
# thread's: confirmations running at once (`confirm_ahead`) take turns there (and in
# reading fake values) and run their kernels (the compiles) side by side. Without it,
# H100 session 18 run A: sites failed with "fake_mode.in_kernel_invocation must be
# False" or "META device type not an accelerator" and stayed unfused.
_GRAPH_LOCK = threading.Lock()

RANDOM_POSITIONS = 8192  # integer operands are confirmed with random values below this


class Generators:
    """One seeded generator per device, so random inputs are drawn where they live: a
    site's (128256, 4096) lm_head weight drawn on the host and copied over took seconds
    of a first call's confirmations (on the GPU: about a millisecond)."""

    def __init__(self, seed: int):
        self.seed, self._by_device = seed, {}

    def on(self, device: torch.device) -> torch.Generator:
        if device not in self._by_device:
            self._by_device[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._by_device[device]


def random_like(node: fx.Node, gen: torch.Generator | Generators, slots: int | None = None,
                 keys: int | None = None, keeps: bool = False) -> Any:
    """A random non-zero tensor shaped like the node's value (a SymInt input: its hint; a
    bool one: a mask, see below).
    `slots`: the match writes a cache of that many positions, and an integer input is the
    positions it writes: distinct random slots. `keys`: the match attends over that many
    keys, and an integer input is the queries' positions: random in [0, keys], so some keys
    are hidden and some rows see them all. Other integer inputs are positions too (random,
    < RANDOM_POSITIONS). A match whose graph cannot take them (an index out of range) fails
    to confirm and stays unfused. Float inputs are laid out with the node's own strides
    (`_laid_out`): SDPA's efficient kernel reads a mask only through the aligned, padded
    view the model hands it, and a dense copy of a (1, 1, 1, 1) mask is refused."""
    val = node.meta.get("val")
    if isinstance(val, (int, torch.SymInt)):
        return hint(val)
    if node.op == "get_attr":  # a constant (torch.tensor(x) made in forward): as it is
        held = getattr(node.graph.owning_module, str(node.target), None)
        if isinstance(held, torch.Tensor):
            return held.clone()
    t = fake(node)
    if t is None:
        raise EmitError(f"operand {node.name} has no tensor metadata")
    shape = tuple(hint(s) for s in t.shape)
    gen = gen.on(t.device) if isinstance(gen, Generators) else gen
    on = {"generator": gen, "device": gen.device}
    if slots is not None and not t.dtype.is_floating_point and len(shape) == 1 and shape[0] <= slots:
        return torch.randperm(slots, **on)[:shape[0]].to(device=t.device, dtype=t.dtype)
    if keys is not None and t.dtype in (torch.int32, torch.int64):
        return torch.randint(0, keys + 1, shape, **on).to(device=t.device, dtype=t.dtype)
    if t.dtype in (torch.int32, torch.int64):  # positions (rope_table): long contexts' angles
        return torch.randint(0, RANDOM_POSITIONS, shape, **on).to(device=t.device, dtype=t.dtype)
    stride = tuple(hint(s) for s in t.stride())
    if t.dtype.is_complex:  # a complex RoPE table: random (re, im) pairs, viewed as complex
        pairs = _laid_out((*shape, 2), (*(2 * s for s in stride), 1), t.dtype.to_real(), t.device, gen)
        return torch.view_as_complex(pairs)
    if t.dtype == torch.bool:  # a mask dropping about a quarter of the scores, never the first
        # key of a row, so no row is dropped whole (eager's NaN there). `keeps`: True marks
        # the scores kept (where(cond, s, -inf)), else the ones dropped (masked_fill)
        drop = torch.rand(shape, **on).to(t.device) < 0.25
        if drop.dim():
            drop[..., 0] = False
        return ~drop if keeps else drop
    if not t.dtype.is_floating_point:
        raise EmitError(f"operand {node.name} is {t.dtype}; cannot confirm with random values")
    return _laid_out(shape, stride, t.dtype, t.device, gen)


def _laid_out(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
              device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random non-zero values in a tensor of this shape and these strides (a padded row,
    a broadcast (stride 0) dim): a view of a random buffer spanning them."""
    dense = torch.empty(shape, device="meta").stride()
    if stride == dense or 0 in shape:
        return randn_nonzero(shape, dtype, device, gen)
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    return randn_nonzero((span,), dtype, device, gen).as_strided(shape, stride)


def clone_laid_out(value: Any) -> Any:
    """A copy keeping the strides (Tensor.clone() makes a padded or broadcast layout
    dense); non-tensors as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_contiguous():
        return value.clone()
    out = value.new_empty(0)
    return out.set_(value.untyped_storage().clone(), value.storage_offset(), value.size(), value.stride())


def extract(m: Match, keep: tuple[fx.Node, ...] = ()) -> tuple[fx.GraphModule, list[fx.Node], Match]:
    """The match as a standalone graph: placeholders for its external inputs, outputs for
    its outputs (then `keep`, nodes of the match to keep alive); returns the graph, the
    original input nodes and the match remapped."""
    graph, env = fx.Graph(), {}
    inputs = m.external_inputs()
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in sorted(m.nodes, key=_order(m)):
        env[node] = graph.node_copy(node, lambda a: env[a])
    outs = list(m.outputs.values()) + [n for n in keep if n not in m.outputs.values()]
    graph.output(tuple(env[o] for o in outs))
    remap = lambda v: env.get(v, v) if isinstance(v, fx.Node) else (
        [remap(x) for x in v] if isinstance(v, list) else v)
    local = Match(m.family, m.kernel, m.module, tuple(env[n] for n in m.nodes),
                  {k: remap(v) for k, v in m.operands.items()},
                  {k: env[v] for k, v in m.outputs.items()}, tuple(env[n] for n in m.shared))
    return fx.GraphModule(torch.nn.Module(), graph), inputs, local


def _order(m: Match) -> Any:
    graph_pos = {n: i for i, n in enumerate(m.nodes[0].graph.nodes)}
    return graph_pos.__getitem__


def site_signature(m: Match, config: str) -> tuple:
    """Sites alike for confirmation and timing: family, input and output shapes, strides and
    dtypes, constant operands, config (every layer of a decoder shares one). Strides count: a
    weight read as t(W) of a (K, N) parameter runs other loads (no TMA) than an (N, K) one
    of the same shape, and each layout is confirmed and timed as it will run. Outputs count:
    two sites reading alike inputs may compute other things (a projection of some rows only)."""
    def layout(nodes):
        return tuple((tuple(hint(s) for s in t.shape), tuple(hint(s) for s in t.stride()), t.dtype)
                     if (t := fake(n)) is not None else None for n in nodes)
    consts = tuple(sorted((k, v) for k, v in m.operands.items() if isinstance(v, (int, float, str, bool))))
    return (m.family, layout(m.external_inputs()), layout(m.outputs.values()), consts, config)


def confirm(m: Match, config: str, seed: int = 0) -> float:
    """Max abs error of the fused op vs the captured subgraph on random inputs; raises
    EmitError when the fused op is wrong.

    The fused op passes when it agrees with the captured subgraph within the dtype's
    tolerance — or, failing that, when it is at least about as accurate as the subgraph
    it replaces, both measured against the subgraph run in float64. (Eager rounds every
    intermediate to bf16; a kernel that keeps fp32 inside can differ from eager by more
    than the tolerance exactly where eager is the less accurate of the two, e.g. RoPE's
    x·cos + r·sin cancelling.)"""
    # Compilers run under the tracer's fake mode: confirm on real tensors.
    with _GRAPH_LOCK, unset_fake_temporarily(), torch.inference_mode():
        ref_gm, inputs, _ = extract(m)
        fused_gm, _, local = extract(m)
        emit(fused_gm.graph, local, config)
        eliminate_dead(fused_gm.graph)
        use_direct_calls(fused_gm)  # confirm exactly what will run
        # fake values read here too: one reads "meta" as its device while another thread
        # is inside the fake mode (in_kernel_invocation)
        gen = Generators(seed)
        args = [random_like(n, gen, m.operands.get("slots"), m.operands.get("keys"),
                            n is m.operands.get("drop") and bool(m.operands.get("drop_keeps")))
                for n in inputs]
    with unset_fake_temporarily(), torch.inference_mode():
        # Each side on its own copy: a match may write its inputs in place (a KV cache).
        want = ref_gm(*[clone_laid_out(a) for a in args])
        got = fused_gm(*[clone_laid_out(a) for a in args])
        try:
            return _compare(want, got)
        except EmitError as mismatch:
            truth = _in_float64(ref_gm, args)
            if truth is None or not _as_accurate(got, want, truth):
                raise mismatch from None
            return max(max_abs_error(g, w) for g, w in zip(got, want))


def _compare(want: tuple, got: tuple) -> float:
    worst = 0.0
    for w, g in zip(want, got):
        tol = tolerance(w.dtype)
        if max_violation(g, w, tol) > 0:
            raise EmitError(f"numerical mismatch: max |err| {max_abs_error(g, w):.3g} "
                            f"beyond atol {tol.atol} + rtol {tol.rtol}")
        worst = max(worst, max_abs_error(g, w))
    return worst


def _in_float64(gm: fx.GraphModule, args: list[Any]) -> tuple | None:
    """The subgraph's outputs computed in float64 (casts inside it retargeted), or None
    when the subgraph cannot run that way."""
    with _GRAPH_LOCK:  # building only: the float64 run goes side by side
        g64 = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        for node in g64.graph.nodes:
            dtype = node.kwargs.get("dtype")
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                node.kwargs = {**node.kwargs, "dtype": torch.float64}
        g64.recompile()
    up = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    try:
        return tuple(g64(*up))
    except Exception:
        return None


# Both sides accumulate in fp32, each in its own order: a difference of this many fp32
# ulps of the output's scale is summation order, not a wrong kernel. It matters for fp32
# models alone. Measured on an H100 (session 28, benchmarks/fp32_probe.py): our tl.dot
# GEMMs ("ieee": FMAs, no tf32) are 0.4-1.4e-6 from float64 (‖Δ‖/‖ref‖, K = 512) where
# cuBLAS is 1-3e-7, and fp32 sites were refused at 4.6e-5 max |err| against atol 1e-5. In
# bf16/fp16 the floor is far below one rounding of the output and changes nothing.
ORDER_ULPS = 256


def _as_accurate(got: tuple, want: tuple, truth: tuple, slack: float = 2.0) -> bool:
    """Fused error vs float64 truth within `slack` x the captured subgraph's own error,
    plus ORDER_ULPS fp32 ulps of the output's largest magnitude, where the truth and eager
    are finite (and somewhere they are: where they are not, eager's error is inf and any
    output would pass — a review found a wrong kernel accepted so)."""
    ulp = torch.finfo(torch.float32).eps
    for g, w, t in zip(got, want, truth):
        if not t.is_floating_point() or g.shape != t.shape or w.shape != t.shape:
            if max_abs_error(g, t) != 0:
                return False
            continue
        finite = torch.isfinite(t) & torch.isfinite(w.to(t.dtype))  # where eager overflowed or
        if not bool(finite.any()):  # hit NaN, its error would be inf: judged elsewhere only
            return False
        t, g, w = t[finite], g.to(t.dtype)[finite], w.to(t.dtype)[finite]
        err_fused, err_eager = max_abs_error(g, t), max_abs_error(w, t)
        floor = max(1e-6, ORDER_ULPS * ulp * float(t.abs().max()))
        if not err_fused <= slack * err_eager + floor:  # also False for NaN/inf
            return False
    return True


def _count_launches(gm: fx.GraphModule) -> int:
    return sum(launches(n) for n in gm.graph.nodes)


def _site_key(m: Match) -> tuple:
    return (m.family, m.module, tuple(sorted(o.name for o in m.outputs.values())))


def _nodes_read(m: Match) -> set[fx.Node]:
    """Every node the match holds or reads: its subgraph, its inputs and its operands."""
    operands = [a for v in m.operands.values() for a in (v if isinstance(v, (list, tuple)) else [v])]
    return {*m.nodes, *m.external_inputs(), *(a for a in operands if isinstance(a, fx.Node))}


def _remapped(m: Match, new_of: Mapping[fx.Node, fx.Node]) -> Match:
    """`m` with operands an earlier rewrite replaced pointed at their new values (the same
    values: their readers, m's nodes among them, were already rerouted there)."""
    def new(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(new(x) for x in v)
        while isinstance(v, fx.Node) and v in new_of:
            v = new_of[v]
        return v

    return dataclasses.replace(m, operands={k: new(v) for k, v in m.operands.items()})


def _erase_dead(graph: fx.Graph, seeds: list[fx.Node]) -> None:
    """Dead-code elimination from `seeds` outwards: erase each pure node nobody reads, then
    look at what it read. O(dead region), where `eliminate_dead_code` walks the graph."""
    work = list(seeds)
    while work:
        n = work.pop()
        if n._erased or not removable(n):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(inputs)


def rewrite(gm: fx.GraphModule, params: Mapping[str, str], plan: Plan,
            cache: dict[tuple, Confirmed | str] | None = None) -> RewriteReport:
    """Apply `plan` to `gm` in place; returns what happened at every matched site.

    The graph is rewritten in rounds. Each round matches the whole graph once and takes
    the sites in pattern order (deepest first). A site whose operand an earlier rewrite
    replaced reads the new value (the same value); a site holding a node an earlier
    rewrite of the round took waits (and, so the deeper fusion keeps the site, so does
    anything overlapping a waiting one): the next round matches the graph as the rewrites
    left it (e.g. the residual that a fused add+norm now produces). Rounds end when one
    rewrites nothing. Matching is linear in the graph and rounds are few (the
    depth of fusions that enable others), where matching again after every site was
    quadratic in the layers (a 32-layer decoder: 194 sites, 8 s on 2 CPU cores)."""
    start, confirming = time.perf_counter(), 0.0
    cache = {} if cache is None else cache
    all_kernels()  # importing the kernel modules registers their custom ops
    before, params = _count_launches(gm), dict(params)
    canonical = canonicalize(gm, params)  # as analysis matched it: caches in place, copies dropped
    results, merged, tried = [], [], set()
    progress = True
    while progress:
        progress, changed, deferred, new_of = False, set(), set(), {}
        matches = find_all(gm, params)
        t = time.perf_counter()
        confirm_ahead(_round_sites(matches, plan, tried), cache)
        confirming += time.perf_counter() - t
        for m in matches:
            if not _to_try(m, plan, tried):
                continue
            m = _remapped(m, new_of)
            own = set(m.nodes) - set(m.shared)
            if own & changed or own & deferred or any(n._erased for n in _nodes_read(m)):
                deferred |= own  # next round, on the graph as it is then
                continue
            tried.add(_site_key(m))
            config = plan.config_for(m.family)
            key = site_signature(m, config)
            if key not in cache:
                t = time.perf_counter()
                cache[key] = _confirm_or_reason(m, config)
                confirming += time.perf_counter() - t
            confirmed = cache[key]
            if isinstance(confirmed, str):
                results.append(SiteResult(m.family, m.module, False, confirmed))
                continue
            try:
                replaced = emit(gm.graph, m, config)
            except EmitError as exc:
                results.append(SiteResult(m.family, m.module, False, str(exc)))
                continue
            changed |= own | set(replaced)
            new_of.update(replaced)
            _erase_dead(gm.graph, [*m.nodes, *replaced])
            progress = True
            for group in ("weights", "biases"):  # kernels that read several tensors as one
                tensors = m.operands.get(group, ())
                fqns = tuple(params.get(t.name, "") if t is not None else "" for t in tensors)
                if fqns and all(fqns):
                    merged.append(fqns)
            note = ("config not kept at this shape, the default ran: " + "; ".join(confirmed.refused)
                    if confirmed.refused else "")
            results.append(SiteResult(m.family, m.module, True, max_error=confirmed.max_error, note=note))
        eliminate_dead(gm.graph)
    gm.graph.lint()
    # Graph-wide passes, whatever the fusions did (a plan whose families found no site, or
    # none, gets them too: the runtime's baseline, which `bench --alone` measures against):
    # per-layer copies of one value (a decoder's additive mask, position arithmetic) and
    # per-layer counter increments: one op each
    repeats = eliminate_common_subexpressions(gm) + canonical.repeats_merged  # and before matching
    increments = batch_input_increments(gm)
    # the causal mask and other values derived from sizes alone: computed once per length
    memoized = memoize_shape_only(gm)
    # SDPA left to torch that reads a kept causal mask: is_causal instead (flash, no mask)
    causal_sdpa = read_marked_masks(gm) if memoized else 0
    # replayed graphs: the logits' matmul runs after the replay, into memory of its own
    outside = move_large_outputs(gm) if plan.cuda_graph else 0
    use_direct_calls(gm)
    return RewriteReport(tuple(results), before, _count_launches(gm), tuple(merged),
                         canonical.in_place_writes, repeats, increments, memoized, causal_sdpa, outside,
                         time.perf_counter() - start, confirming,
                         canonical.identity_copies_dropped, _softmax_left(gm, plan))


def _softmax_left(gm: fx.GraphModule, plan: Plan) -> tuple[str, ...]:
    """Modules of the softmaxes still in `gm` when the plan fuses attention (sorted, once
    each); () when it does not."""
    if not {"attention", "attention_rope"} & set(plan.fusions):
        return ()
    return tuple(sorted({module_path(n) or "(top)" for n in gm.graph.nodes if is_op(n, *SOFTMAX_OPS)}))


def _to_try(m: Match, plan: Plan, tried: set) -> bool:
    """A site of the plan's families, with a kernel, not tried in an earlier round."""
    return m.kernel is not None and m.family in plan.fusions and _site_key(m) not in tried


def _round_sites(matches: list[Match], plan: Plan, tried: set) -> list[tuple[Match, str]]:
    """The (site, config) pairs a round will confirm, as its loop takes them: a site
    holding a node an earlier site of the round takes waits (the loop's own test, less
    the erased-operand case it finds only while rewriting)."""
    taken, waiting, sites = set(), set(), []
    for m in matches:
        if not _to_try(m, plan, tried):
            continue
        own = set(m.nodes) - set(m.shared)
        if own & taken or own & waiting:
            waiting |= own
            continue
        taken |= own
        sites.append((m, plan.config_for(m.family)))
    return sites


def confirm_workers() -> int:
    """Threads for confirmations: their kernels' first compiles are mostly outside the
    GIL (LLVM, ptxas, the launcher's C build; triton 3.6, 2 CPU cores: 4 compiles 1.30 s
    in turn, 0.73 s at once). One under the interpreter (it patches triton.language while
    it runs) and off CUDA (nothing compiles). ADVISOR_CONFIRM_THREADS sets the count
    (1: one at a time, as before)."""
    if interpreting() or not torch.cuda.is_available():
        return 1
    asked = os.environ.get("ADVISOR_CONFIRM_THREADS", "")
    return max(1, int(asked) if asked.isdigit() else min(8, (os.cpu_count() or 1) // 2))


def confirm_ahead(sites: list[tuple[Match, str]], cache: dict[tuple, Confirmed | str],
                  workers: int | None = None) -> None:
    """Confirm the sites' new signatures at once, into `cache` (what the rewrite loop then
    reads): each in its own thread with a copy of the caller's context (PDL, device), so
    its kernels compile and launch as the loop's would. Only passes are kept: a failure
    here (running out of memory beside the others, say) is the loop's to confirm again,
    alone, and to report."""
    workers = confirm_workers() if workers is None else workers
    if workers < 2:
        return  # the loop confirms in turn
    todo: dict[tuple, tuple[Match, str]] = {}
    for m, config in sites:
        todo.setdefault(site_signature(m, config), (m, config))
    todo = {k: v for k, v in todo.items() if k not in cache}
    if len(todo) < 2:
        return
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def run(m: Match, config: str) -> Confirmed | str:
        if device is not None:
            torch.cuda.set_device(device)
        return _confirm_or_reason(m, config)

    with ThreadPoolExecutor(min(workers, len(todo))) as pool:
        futures = {k: pool.submit(contextvars.copy_context().run, run, m, config)
                   for k, (m, config) in todo.items()}
        cache.update({k: r for k, f in futures.items() if isinstance(r := f.result(), Confirmed)})


def _confirm_or_reason(m: Match, config: str) -> Confirmed | str:
    """What confirmation found, or why the site must stay unfused."""
    with refused_configs() as refused:
        try:
            error = confirm(m, config)
        except EmitError as exc:
            return str(exc)
        except Exception as exc:  # a kernel that fails to compile or run
            return one_line(exc)
    return Confirmed(error, tuple(sorted(set(refused))))
