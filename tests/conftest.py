"""Test setup: Triton runs through its interpreter on the CPU (no GPU in CI).

TRITON_INTERPRET must be set before triton/advisor kernels are imported, hence here.
`@triton.jit` picks interpreter or compiler when a kernel module is imported, so the
kernels are imported here too: a test that turns the interpreter off (the tune tests do,
for their eager workers) must never be the first to import one, or every later test in
the process would get compiled kernels that cannot launch on the CPU.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ADVISOR_EXAMPLE_SIZE", "tiny")

from advisor.kernels.registry import all_kernels  # noqa: E402

all_kernels()


def _in_own_stack_chunk(fn, *args):
    return fn(*args)


# CPython keeps Python frames in 16 KiB chunks, mapped when a call crosses into a new one
# and unmapped as soon as that call returns. A hot loop that straddles a chunk boundary
# (the Triton interpreter's per-program helpers, at whatever depth pytest calls a test)
# then pays an mmap + munmap per call: seen as 1.9 M of each and twice the wall time in one
# test. A frame this large gets a chunk of its own (4 MiB, ~2 MiB of it free): every frame
# above it lives there, so no test's loop meets a boundary.
_in_own_stack_chunk.__code__ = _in_own_stack_chunk.__code__.replace(co_stacksize=1 << 18)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    from _pytest.main import pytest_runtestloop as run_tests

    mine = (pytest_runtestloop, run_tests)
    if any(not (impl.hookwrapper or impl.wrapper) and impl.function not in mine
           for impl in session.config.hook.pytest_runtestloop.get_hookimpls()):
        return None  # another plugin runs the tests (pytest-xdist): its loop, not pytest's
    return _in_own_stack_chunk(run_tests, session)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Each test's own call in a stack chunk of its own too: under pytest-xdist (CI's
    `-n 2`) its workers' loop runs the tests, not `pytest_runtestloop` above."""
    if not (hasattr(pyfuncitem.config, "workerinput") and callable(pyfuncitem.obj)):
        return None  # one process: the loop above already did it
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    _in_own_stack_chunk(lambda: pyfuncitem.obj(**args))
    return True


@pytest.fixture(scope="session")
def decode_steps():
    """One decode step (context 12, batch 2) of each example model, eager and then with
    every fusion applied, from the cache restored in between. test_decode and test_inplace
    check different things about this same step, which costs ~9 s to compile and run."""
    from types import SimpleNamespace

    import torch

    from advisor.loader import build, call, first_tensor, inputs_for, load_model_file
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import ALL_FUSIONS
    from advisor.state import Snapshot

    cpu, steps = torch.device("cpu"), {}
    for path in ("examples/tiny_llama.py", "examples/llama_hf.py"):
        mf = load_model_file(path)
        model = build(mf, cpu, torch.float32)
        x = inputs_for(mf, 12, 2, cpu, phase="decode", dtype=torch.float32)
        snap = Snapshot(x)
        with torch.no_grad():
            ref = first_tensor(call(model, x))
        after_eager = Snapshot(x)  # the cache as the eager step left it
        changed = snap.changed()
        snap.restore()
        restored = not snap.changed()
        fast = apply(model, ALL_FUSIONS, length_of=lambda a, k: 12)
        with torch.no_grad():
            got = first_tensor(call(fast, x))
        steps[path] = SimpleNamespace(ref=ref, got=got, eager_wrote_cache=changed, restored=restored,
                                      after_eager=after_eager, summary=fast.summary())
    return steps


@pytest.fixture(scope="session")
def example_matches():
    """`get(path, tokens)`: the fusion sites of an example model (fp32, batch 1) captured at
    that prompt length, built once per session for every test that reads them."""
    import torch

    from advisor.graph.candidates import matches_of
    from advisor.graph.capture import capture
    from advisor.loader import build, inputs_for, load_model_file

    cpu, seen = torch.device("cpu"), {}

    def get(path: str, tokens: int = 5):
        if (path, tokens) not in seen:
            mf = load_model_file(path)
            seen[path, tokens] = matches_of(capture(build(mf, cpu, torch.float32), inputs_for(mf, tokens, 1, cpu)))
        return seen[path, tokens]
    return get


@pytest.fixture
def cli(monkeypatch, capsys):
    """`advisor ARGS` run in this process from `cwd` (a subprocess pays torch's import,
    ~3 s): its exit code and what it printed, as subprocess.run would give them."""
    import sys
    from types import SimpleNamespace

    from advisor.cli import main

    def run(*args: str, cwd) -> SimpleNamespace:
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["advisor", *args])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return run
