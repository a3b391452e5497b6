"""The `advisor` command line: thin wrappers that parse, call, render.

Every user error (bad model file, bad flags, corrupt recipe) is one line on stderr and
exit code 2, with nothing written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from advisor.errors import AdvisorError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Profiler-driven kernel-fusion advisor and auto-tuner for PyTorch inference.")
# Written to a file or a pipe (a device run's log), rich would fold every table into 80
# columns; wide tables read better unfolded there. A terminal keeps its own width.
stdout = Console(width=None if sys.stdout.isatty() else 160)
stderr = Console(stderr=True)

ModelArg = Annotated[Path, typer.Argument(help="model file defining build_model and make_inputs")]
ShapesOpt = Annotated[str, typer.Option("--shapes", help="sequence lengths, e.g. 128,512,2048")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="cuda or cpu (default: cuda if present)")]
DtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="bf16/fp16/fp32 (default: bf16 on cuda, fp32 on cpu)")]
BatchOpt = Annotated[int, typer.Option("--batch", min=1, help="sequences per forward")]
PhaseOpt = Annotated[str, typer.Option(
    "--phase", help="prefill (shapes = prompt lengths) or decode (shapes = KV-cache context lengths)")]


def _device_dtype(device: str | None, dtype: str | None):
    import torch

    from advisor.loader import parse_device, parse_dtype

    dev = parse_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dev, parse_dtype(dtype or ("bf16" if dev.type == "cuda" else "fp32"))


def _writable(path: Path | None, flag: str, folder: bool = False) -> None:
    """Fail before the work, not after it: `path` (a file, or with `folder` a folder) can
    be created where it is named. Writes stay atomic (write_json_atomic); this only moves
    a bad path's error ahead of a run that may take minutes."""
    import os

    if path is None:
        return
    if path.exists() and path.is_dir() != folder:
        raise AdvisorError(f"{flag} {path}: is {'a file' if folder else 'a folder'}")
    parent = path if folder else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest folder that exists: the rest is created
    if not parent.is_dir():
        raise AdvisorError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AdvisorError(f"{flag} {path}: {parent} is not writable")


def _compile_modes(text: str) -> tuple[str, ...]:
    """--compile's modes, each one torch.compile knows ("none": no compile baseline)."""
    import torch._inductor

    modes = tuple(m for m in text.split(",") if m and m != "none")
    known = list(torch._inductor.list_mode_options())
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise AdvisorError(f"--compile {text}: unknown torch.compile mode(s) {unknown}; "
                           f"known: {', '.join(known)} or none")
    return modes


@app.command()
def analyze(
    model: ModelArg,
    shapes: ShapesOpt = "128",
    batch: BatchOpt = 1,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    iters: Annotated[int, typer.Option(min=1, help="profiled forwards per shape")] = 5,
    top: Annotated[int, typer.Option(min=1, help="ops to list per shape")] = 10,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the analysis JSON here")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="folder for Chrome/Perfetto traces")] = None,
    phase: PhaseOpt = "prefill",
    probe: Annotated[bool, typer.Option(
        "--probe/--no-probe",
        help="time each distinct fusion site fused and unfused on the device")] = True,
    recipe: Annotated[Path | None, typer.Option(
        help="probe each family's kernel in this recipe's config for the length (the saving "
        "of that tuned plan; default: each kernel's default config)")] = None,
) -> None:
    """Where does the time go, and what should be fused? Budget + ranked candidates."""
    from advisor.analyze import analyze as run
    from advisor.analyze import to_json
    from advisor.loader import load_model_file, parse_shapes
    from advisor.profile import load_or_measure
    from advisor.report.console import render_analysis
    from advisor.runtime.recipe import load_recipe, write_json_atomic

    lengths = parse_shapes(shapes)
    mf = load_model_file(model)
    rec = load_recipe(recipe) if recipe else None
    if rec is not None and not probe:
        raise AdvisorError("--recipe sets the configs the site probe runs: it needs --probe")
    if rec is not None and rec.model.get("phase", phase) != phase:
        raise AdvisorError(f"--recipe {recipe} was tuned for --phase {rec.model['phase']}, not {phase}")
    _writable(json_path, "--json")
    _writable(trace, "--trace", folder=True)
    dev, dt = _device_dtype(device, dtype)
    ceilings = load_or_measure(dev)
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
    result = run(mf, lengths, batch, dev, dt, ceilings, iters=iters, trace_dir=trace, phase=phase,
                 probe=probe, recipe=rec)
    render_analysis(result, stdout, top=top)
    if json_path is not None:
        write_json_atomic(json_path, to_json(result))
        stdout.print(f"[dim]wrote {json_path}[/dim]")


@app.command("device")
def device_cmd(
    device: DeviceOpt = None,
    refresh: Annotated[bool, typer.Option(help="measure again instead of using the cache")] = False,
) -> None:
    """Show the measured ceilings of this device (cached per device and versions)."""
    from advisor.profile import load_or_measure
    from advisor.report.console import render_ceilings

    dev, _ = _device_dtype(device, None)
    render_ceilings(load_or_measure(dev, refresh=refresh), stdout)


@app.command()
def bench(
    model: ModelArg,
    shapes: ShapesOpt = "128",
    recipe: Annotated[Path | None, typer.Option(help="recipe or hand-written plan JSON")] = None,
    batch: BatchOpt = 1,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    compile_modes: Annotated[str, typer.Option(
        "--compile", help="torch.compile modes to compare: default,reduce-overhead or none")] = "default",
    json_path: Annotated[Path | None, typer.Option("--json", help="write the results JSON here")] = None,
    phase: PhaseOpt = "prefill",
    truth: Annotated[bool, typer.Option(
        help="also compare eager and fused outputs with a float32 copy of the model")] = True,
    generate: Annotated[int, typer.Option(
        "--generate", min=0, help="with --phase decode: also time N greedy tokens per context length "
        "(per-token latency, tokens/s, tokens and logits vs eager)")] = 0,
    ablate: Annotated[bool, typer.Option(
        help="also time each shape's plan with each fusion left out: measured saving per family")] = False,
    alone: Annotated[bool, typer.Option(
        help="also time each family of each shape's plan alone on the unfused model: the saving "
        "the analyzer predicts, measured")] = False,
    repeats: Annotated[int, typer.Option(
        min=1, help="with --ablate/--alone: apply and time each row this many times, keep the median "
        "(one apply of a plan can differ from another by tens of µs)")] = 1,
) -> None:
    """Eager vs torch.compile vs the recipe, measured in one run, checked against eager."""
    if generate and phase != "decode":
        raise AdvisorError(f"--generate {generate} needs --phase decode (got --phase {phase})")
    from advisor.bench import run_bench, to_json
    from advisor.loader import load_model_file, parse_shapes
    from advisor.report.console import render_generation, render_rows
    from advisor.runtime.plan import ALL_FUSIONS
    from advisor.runtime.recipe import Recipe, load_recipe, write_json_atomic

    lengths = parse_shapes(shapes)
    mf = load_model_file(model)
    rec = load_recipe(recipe) if recipe else Recipe.from_plan(ALL_FUSIONS)
    _writable(json_path, "--json")
    modes = _compile_modes(compile_modes)
    dev, dt = _device_dtype(device, dtype)
    result = run_bench(mf, rec, lengths, batch, dev, dt, modes, phase=phase, truth=truth,
                       generate=generate, ablate=ablate, alone=alone, repeats=repeats)
    render_rows("latency per forward (median)", result.rows, stdout)
    render_generation(result.generation, stdout)
    render_rows("fusions applied", result.applied, stdout)
    if result.ablation:
        render_rows("measured saving per fusion (plan without it − plan)", result.ablation, stdout)
    if result.alone:
        render_rows("measured saving per fusion alone (unfused − unfused with it)", result.alone, stdout)
    if json_path is not None:
        write_json_atomic(json_path, to_json(result))
        stdout.print(f"[dim]wrote {json_path}[/dim]")


TrialsOpt = Annotated[int | None, typer.Option(
    min=1, help="finished trials per bucket study (default 20 without --time-budget)")]
BudgetOpt = Annotated[float | None, typer.Option(
    "--time-budget", min=1, help="wall-clock seconds for the whole search")]
StorageOpt = Annotated[str | None, typer.Option(
    help="Optuna RDB URL, or a journal file (default: <out>.journal)")]
StudyOpt = Annotated[str | None, typer.Option(
    help="study name prefix (default: model, fingerprint, dtype, batch, device)")]


@app.command()
def tune(
    model: ModelArg,
    shapes: ShapesOpt = "128",
    trials: TrialsOpt = None,
    time_budget: BudgetOpt = None,
    out_path: Annotated[Path, typer.Option("--out", help="recipe JSON to write")] = Path("recipe.json"),
    storage: StorageOpt = None,
    study: StudyOpt = None,
    workers: Annotated[int, typer.Option(min=1, help="worker processes running trials")] = 1,
    seed: Annotated[int, typer.Option(help="sampler seed (same seed, same search)")] = 0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    batch: BatchOpt = 1,
    trial_timeout: Annotated[float, typer.Option(min=1, help="seconds per trial stage")] = 300.0,
    rep_ms: Annotated[float, typer.Option(min=1, help="timing budget per measurement, ms")] = 500.0,
    phase: PhaseOpt = "prefill",
    seed_plan: Annotated[list[Path] | None, typer.Option(
        "--seed-plan", help="plan/recipe JSON whose plans every bucket tries first (repeatable)")] = None,
) -> None:
    """Which plan is fastest per shape bucket? Optuna search, verified plans, a recipe."""
    from advisor.errors import ModelFileError
    from advisor.loader import load_model_file, parse_shapes
    from advisor.report.progress import TuneProgress, render_tune_summary
    from advisor.runtime.recipe import load_recipe
    from advisor.search import TuneOptions
    from advisor.search import tune as run

    lengths = parse_shapes(shapes)
    mf = load_model_file(model)  # a bad model file: one line, before any worker starts
    _writable(out_path, "--out")
    if phase == "decode" and mf.make_decode_inputs is None:
        raise ModelFileError(f"{model}: --phase decode needs make_decode_inputs(context_len, batch, device)")
    dev, dt = _device_dtype(device, dtype)
    seeds = tuple(load_recipe(p) for p in seed_plan or ())  # routed per bucket: seeds_for_length
    options = TuneOptions(
        model=str(model), shapes=lengths, out=out_path, dtype=dt, device=str(dev), batch=batch,
        trials=trials if trials is not None or time_budget is not None else 20,
        time_budget_s=time_budget, storage=storage, study=study, workers=workers, seed=seed,
        trial_timeout_s=trial_timeout, warmup_ms=min(100.0, rep_ms / 5), rep_ms=rep_ms, phase=phase,
        seed_plans=seeds)
    with TuneProgress(stdout) as progress:
        result = run(options, progress)
    render_tune_summary(result, stdout)


@app.command("record-kernels")
def record_kernels_cmd(
    model: ModelArg,
    recipe: Annotated[Path, typer.Option(help="recipe JSON (advisor tune --out)")],
    out: Annotated[Path | None, typer.Option("--out", help="recipe to write (default: --recipe)")] = None,
    shapes: Annotated[str | None, typer.Option(
        "--shapes", help="lengths to run (default: each bucket's bound and the length below it)")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
) -> None:
    """Add the Triton kernels each bucket compiles to a recipe, so that `apply` compiles
    them in parallel processes while its first call traces (a shorter cold start)."""
    from advisor.errors import RecipeError
    from advisor.loader import build, load_model_file, parse_shapes
    from advisor.runtime.recipe import load_recipe, save_recipe
    from advisor.runtime.record import bounds, record_model_file

    rec = load_recipe(recipe)
    mf = load_model_file(model)
    _writable(out or recipe, "--out")
    dev, dt = _device_dtype(device, dtype or rec.model.get("dtype"))
    if dev.type != "cuda":
        raise RecipeError("record-kernels needs a CUDA device: kernels are compiled for it")
    lengths = parse_shapes(shapes) if shapes else bounds(rec)
    if not lengths:
        raise RecipeError(f"{recipe}: a plan for every length has no bound to run: pass --shapes")
    done = record_model_file(mf, build(mf, dev, dt), rec, lengths, batch=int(rec.model.get("batch", 1)),
                             device=dev, dtype=dt, phase=str(rec.model.get("phase", "prefill")))
    entries = (done.kernels or {}).get("entries", [])
    save_recipe(done, out or recipe)
    stdout.print(f"{len(entries)} kernels recorded for buckets "
                 f"{sorted({b for e in entries for b in e['buckets']})}; wrote {out or recipe}")


@app.command()
def report(
    analysis: Annotated[list[Path], typer.Option(
        "--analysis", help="analysis JSON (advisor analyze --json)")],
    out: Annotated[Path, typer.Option("--out", help="HTML file to write")] = Path("advisor-report.html"),
    bench_json: Annotated[Path | None, typer.Option(
        "--bench", help="bench JSON (advisor bench --json)")] = None,
    recipe: Annotated[Path | None, typer.Option(help="recipe JSON (advisor tune --out)")] = None,
    journal: Annotated[str | None, typer.Option(help="tune study storage: journal path or RDB URL")] = None,
    title: Annotated[str, typer.Option(help="page title")] = "advisor report",
) -> None:
    """A self-contained HTML report from the JSON that analyze / bench / tune wrote; with a
    bench run --alone or --ablate, the predicted vs measured savings on the console too."""
    from advisor.report.accuracy import accuracy
    from advisor.report.console import render_accuracy
    from advisor.report.history import load_history
    from advisor.report.html import render_html, write_html
    from advisor.report.inputs import read_analysis, read_bench
    from advisor.runtime.recipe import load_recipe

    _writable(out, "--out")
    rec = load_recipe(recipe).to_json() if recipe else None
    analyses = [read_analysis(p) for p in analysis]
    bench = read_bench(bench_json) if bench_json else None
    page = render_html(analyses=analyses, bench=bench, recipe=rec,
                       history=load_history(journal) if journal else None, title=title)
    write_html(out, page)
    render_accuracy([r for a in analyses for r in accuracy(a, bench)], stdout)
    stdout.print(f"wrote {out}")


def main() -> None:
    """Console entry point: AdvisorError -> one line on stderr, exit code 2."""
    try:
        # Outside standalone mode click returns (not raises) an interrupt's or an Exit's
        # code: Ctrl-C comes back as 130
        code = app(standalone_mode=False)
    except AdvisorError as exc:
        stderr.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        stderr.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors and the like
        if isinstance(exc, _usage_errors()):
            exc.show()
            sys.exit(2)
        raise
    if isinstance(code, int) and code:
        if code == 130:
            stderr.print("aborted")
        sys.exit(code)


def _usage_errors() -> tuple[type[BaseException], ...]:
    """Click's usage-error base, and the copy of it newer typer releases bundle (what their
    parser raises: not a subclass of click's)."""
    import importlib

    found = []
    for module in ("click.exceptions", "typer._click.exceptions"):
        try:
            found.append(importlib.import_module(module).ClickException)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


if __name__ == "__main__":
    main()
