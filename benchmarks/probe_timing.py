"""Does the site probe's timing method move a site's saving? One model length, chosen
families, every distinct site timed by the probe (runtime/site_probe.py) several ways:

    interleaved   the probe as it is: spellings' graphs replayed in turn after a warm-up
    sequential    the same graphs, warm-up, then each one's replays to the end in a row
    cold-start    sequential without the warm-up (the probe before session 22)
    reversed      interleaved, the fused spelling first in each round
    recipe-config interleaved, the fused kernel with the recipe's config for its family
                  (the probe emits the registry default; a plan runs the tuned one)

Session 23 (H100, 1 token): the interleaved probe priced linear_residual's sites at
4.5 / 11.5 µs where session 21's sequential one gave 3.4 / 3.8, and the model measures
3.5 µs a site (bench --alone). Which method (or config) moves it says what the probe
measures that a forward does not.

    python benchmarks/probe_timing.py --tokens 1 --recipe recipes/llama_hf-h100.json \
        --families linear_residual,add_rms_norm_swiglu --json probe-timing.json  # under $OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.graph.candidates import matches_of  # noqa: E402
from advisor.graph.capture import capture  # noqa: E402
from advisor.loader import inputs_for  # noqa: E402
from advisor.profile import replay  # noqa: E402
from advisor.runtime import site_probe  # noqa: E402
from advisor.runtime.column_blocks import column_blocks  # noqa: E402
from advisor.runtime.recipe import load_recipe  # noqa: E402
from benchmarks.common import header, model_on, write  # noqa: E402


def sequential_ms(runs: Sequence[Callable[[], None]], device: torch.device, warm: bool = True) -> list[float]:
    """Each spelling's graph replayed REPS times in a row, one spelling after the other
    (after the shared warm-up when `warm`)."""
    graphs = [replay._captured(run, device) for run in runs]
    if warm:
        replay._warm_up(graphs)
    out = []
    for graph in graphs:
        pairs = [replay._timed_round([graph])[0] for _ in range(replay.REPS)]
        torch.cuda.synchronize(device)
        out.append(statistics.median(s.elapsed_time(e) for s, e in pairs))
    return out


def reversed_ms(runs: Sequence[Callable[[], None]], device: torch.device) -> list[float]:
    return replay.graphs_ms(list(runs)[::-1], device)[::-1]


METHODS: dict[str, Callable[..., list[float]] | None] = {
    "interleaved": None,
    "sequential": sequential_ms,
    "cold-start": lambda runs, device: sequential_ms(runs, device, warm=False),
    "reversed": reversed_ms,
    "recipe-config": None,
}


@contextmanager
def patched(method: str, configs: dict[str, str]):
    """The probe with `method`'s timing (and, for recipe-config, the recipe's configs)."""
    timing, emit = site_probe.spellings_ms, site_probe.emit
    if METHODS[method] is not None:
        site_probe.spellings_ms = METHODS[method]
    if method == "recipe-config":
        site_probe.emit = lambda graph, m, config: emit(graph, m, configs.get(m.family, config))
    try:
        yield
    finally:
        site_probe.spellings_ms, site_probe.emit = timing, emit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="examples/llama_hf.py")
    p.add_argument("--recipe", required=True, help="its bucket for --tokens gives the configs")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--families", default="linear_residual,add_rms_norm_swiglu,add_rms_norm_linear")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json", default="probe-timing.json", help="file name under $OUT")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test (interleaved, recipe-config)")
    a = p.parse_args()
    mf, model, dev, dtype = model_on(a.model, a.device)
    recipe = load_recipe(a.recipe)
    bucket = recipe.bucket_for(a.tokens)
    if bucket is None:
        p.error(f"{a.recipe} runs unfused at {a.tokens} tokens: no configs to probe")
    configs = dict(bucket.plan.configs)
    families = a.families.split(",")
    with torch.no_grad():
        found = matches_of(capture(model, inputs_for(mf, a.tokens, 1, dev, dtype=dtype)))
    matches = [m for m in found if m.family in families]
    facts = site_probe.GraphFacts(column_blocks(found))  # keyed as probe_sites keys them
    sites: dict[tuple, Any] = {}
    for m in matches:  # one per distinct site, as probe_sites times them
        sites.setdefault(site_probe.probe_key(m, facts), m)
    out: dict[str, Any] = {**header(dev, tokens=a.tokens, recipe=a.recipe, families=a.families,
                                    configs=configs, reps=replay.REPS, warmup_ms=replay.WARMUP_MS),
                           "model": a.model, "dtype": str(dtype), "results": []}
    # every method once per site, then again in reverse order: a drift over the run
    # shows as a difference between a method's two passes
    order = a.methods.split(",")
    for rnd, methods in enumerate((order, order[::-1])):
        for m in sites.values():
            for method in methods:
                try:
                    with patched(method, configs):
                        t = site_probe.time_site(m, dev, facts=facts)
                    r = {"unfused_us": t.unfused_ms * 1e3, "fused_us": t.fused_ms * 1e3,
                         "saving_us": t.saving_ms * 1e3,
                         "pdl_saving_us": None if t.pdl_saving_ms is None else t.pdl_saving_ms * 1e3}
                except Exception as exc:  # noqa: BLE001 (one site's failure must not end the run)
                    r = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                row = {"pass": rnd, "family": m.family, "module": m.module, "method": method, **r}
                out["results"].append(row)
                print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                write(a.json, out)


if __name__ == "__main__":
    main()
