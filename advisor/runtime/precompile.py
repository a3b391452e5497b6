"""Compile a recipe's Triton kernels in parallel processes while the first call traces.

A cold first call compiles each kernel of the plan when its site is confirmed: Triton's
code generation (Python, under the GIL), ptxas, and a C launcher built with the host
compiler per kernel signature. On the H100 (session 19, one token, threaded
confirmations) that is 2.55 s of the 7.77 s a cold start takes (warm caches: 5.22 s),
and it waits for dynamo's trace (3.7 s) to end before it can begin.

A recipe can carry the kernels its buckets compiled (`kernels`, recorded by `advisor
record-kernels`: `record` below), each as Triton's own serialised specialisation (the
`specialization_data` its JIT hooks report and `JITFunction.preload` takes: argument
types, divisibility, constexprs, options). `apply` then forks worker processes that
compile them into Triton's on-disk cache and build their launchers, while the parent
traces; the parent's compiles become cache reads (the same cache key: the specialisation
is the key's input).

Data only, as the recipe is: a kernel is named by its function's full name and resolved
among the JIT functions of advisor's own kernel modules; nothing is imported. Triton would
read a specialisation's types and options as given (it evaluates part of a `tensordesc`
type's text, and options name files and ptxas flags), so each one is checked against a
small grammar (runtime/kernel_spec.py `check_spec`, also when the recipe is loaded) and
rebuilt from its checked parts: argument names must be the kernel's, types plain,
constants scalars, options only those a launch sets, with the rest filled in here as a
launch fills them. A
specialisation that fails to check, resolve or compile costs only its worker's time: the
parent compiles it as before. The workers never touch CUDA (forked after CUDA may be
initialised): the device and target they compile for are the parent's, taken before the
fork; they hold no GPU file of the parent's and print nothing into its output.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from advisor.runtime.kernel_spec import SpecError, check_spec

PREFIX = "advisor.kernels."  # only these modules' JIT functions are compiled from a recipe
MAX_WAIT_S = 20.0  # a bucket waits at most this long for its kernels: then it compiles them

def _rebuilt(spec: str, fn: Any, target: Any, index: int) -> str:
    """The specialisation `fn.preload` is given: `spec` checked and rebuilt, with the
    options a launch adds from Triton's settings (as `JITFunction.run` adds them) and this
    worker's target."""
    from triton import knobs

    parts = check_spec(json.loads(spec))
    if list(parts["signature"]) != list(fn.arg_names):
        raise SpecError("signature: not this kernel's arguments")
    options = dict(parts["options"])
    options["debug"] = bool(getattr(fn, "debug", None) or knobs.runtime.debug)
    options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton 3.9
        options["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return json.dumps({**parts, "options": options, "key": f"advisor-precompile-{index}",
                       "target": dict(vars(target))})


def _jit_functions() -> dict[str, Any]:
    """Full name ("module.qualname", Triton's `get_full_name`) -> JIT function, over the
    advisor kernel modules already imported."""
    from triton.runtime.jit import JITFunction

    out = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(PREFIX) or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == name:
                out[f"{name}.{value.fn.__qualname__}"] = value
    return out


def reset_jit_caches() -> None:
    """Forget the advisor kernels compiled in this process (each JIT function's in-memory
    cache), so that the next launch of each passes through Triton's compile again (an
    on-disk cache read when compiled before) and `record` sees it."""
    for fn in _jit_functions().values():
        fn.device_caches.clear()


@contextlib.contextmanager
def record() -> Iterator[list[str]]:
    """The serialised specialisations of the advisor kernels compiled inside the block
    (from any thread), in order, each once; those `check_spec` refuses are not kept.
    Chains to a hook set before."""
    from triton import knobs

    seen: list[str] = []
    lock = threading.Lock()
    before = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs: Any) -> Any:
        fn, spec = kwargs.get("fn"), kwargs.get("compile", {}).get("specialization_data")
        if spec and str(getattr(fn, "module", "")).startswith(PREFIX) and _checks(spec):
            with lock:
                if spec not in seen:
                    seen.append(spec)
        return before(**kwargs) if before else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_post_compile_hook = before


def _checks(spec: str) -> bool:
    """Whether a recipe could carry this specialisation (`check_spec`)."""
    try:
        check_spec(json.loads(spec))
    except (ValueError, TypeError):
        return False
    return True


def target_name() -> str | None:
    """This process's compile target ("cuda:90"), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"cuda:{major * 10 + minor}"


def manifest(specs_by_bucket: Mapping[int, Iterable[str]]) -> dict[str, Any]:
    """The recipe's `kernels` field: each specialisation once, with the buckets whose
    first call compiled it (the first bucket's first)."""
    import triton

    entries: dict[str, list[int]] = {}
    for bound in sorted(specs_by_bucket):
        for spec in specs_by_bucket[bound]:
            buckets = entries.setdefault(spec, [])
            if bound not in buckets:  # a bucket recorded at two lengths lists it twice
                buckets.append(bound)
    return {"triton": triton.__version__, "target": target_name(),
            "entries": [{"buckets": b, "spec": s} for s, b in entries.items()]}


def unusable(kernels: Mapping[str, Any] | None) -> str | None:
    """Why a recipe's `kernels` cannot be precompiled here (None: they can)."""
    if not kernels or not kernels.get("entries"):
        return "the recipe lists no kernels"
    if os.environ.get("ADVISOR_PRECOMPILE", "1") == "0":
        return "ADVISOR_PRECOMPILE=0"
    if not hasattr(os, "fork"):
        return "no fork on this platform"
    from advisor.kernels._triton import interpreting

    if interpreting():
        return "Triton's interpreter compiles nothing"
    import triton

    if kernels.get("triton") != triton.__version__:
        return f"recorded under triton {kernels.get('triton')}, this is {triton.__version__}"
    here = target_name()
    if kernels.get("target") != here:
        return f"recorded for {kernels.get('target')}, this device is {here}"
    return None


@dataclass
class Precompile:
    """Worker processes compiling a recipe's kernels; `wait(bucket)` until that bucket's
    are done (or the workers have exited, or MAX_WAIT_S from the start)."""

    buckets: list[list[int]]  # per entry, the buckets that use it
    started: float = field(default_factory=time.perf_counter)
    done: dict[int, tuple[str, float]] = field(default_factory=dict)  # entry -> (status, s)
    closed: bool = False
    waited_s: dict[int, float] = field(default_factory=dict)  # bucket -> its wait
    leader: int | None = None  # the first worker's pid: its process group holds them all
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def _read(self, rfd: int, pids: list[int]) -> None:
        """Collect the workers' "index status seconds" lines until all have exited."""
        try:
            with os.fdopen(rfd, "r", encoding="utf-8", errors="replace") as pipe:
                for line in pipe:
                    with contextlib.suppress(ValueError, TypeError):
                        i, status, seconds = json.loads(line)
                        with self._cond:
                            self.done[int(i)] = (str(status), float(seconds))
                            self._cond.notify_all()
        finally:
            with self._cond:  # EOF: every worker has exited (before the reap: `stop` is a no-op)
                self.closed = True
                self._cond.notify_all()
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def stop(self) -> None:
        """Kill the workers still running (a wait that timed out; this process's exit)."""
        if self.leader is not None and not self.closed:
            with contextlib.suppress(OSError):
                os.killpg(self.leader, signal.SIGKILL)

    def pending(self, bucket: int) -> list[int]:
        return [i for i, b in enumerate(self.buckets) if bucket in b and i not in self.done]

    def wait(self, bucket: int) -> None:
        """Until this bucket's entries are reported, or MAX_WAIT_S after the start: then
        the workers are stopped (a hung compile) and this process compiles what is left."""
        start = time.perf_counter()
        with self._cond:
            finished = self._cond.wait_for(lambda: self.closed or not self.pending(bucket),
                                           timeout=max(0.0, self.started + MAX_WAIT_S - start))
        if not finished:
            self.stop()
        self.waited_s[bucket] = self.waited_s.get(bucket, 0.0) + time.perf_counter() - start

    def counts(self, bucket: int) -> dict[str, int]:
        """This bucket's entries: compiled, failed, not reported."""
        mine = [i for i, b in enumerate(self.buckets) if bucket in b]
        ok = sum(1 for i in mine if self.done.get(i, ("",))[0] == "ok")
        failed = sum(1 for i in mine if i in self.done) - ok
        return {"compiled": ok, "failed": failed, "missing": len(mine) - ok - failed}

    def failures(self) -> list[str]:
        return sorted({s for s, _ in self.done.values() if s != "ok"})


def _worker_count(entries: int) -> int:
    text = os.environ.get("ADVISOR_PRECOMPILE_WORKERS", "")
    try:
        n = int(text) if text else 0
    except ValueError:
        n = 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(entries, n if n > 0 else min(16, cpus - 2)))


def start(kernels: Mapping[str, Any], workers: int | None = None) -> Precompile | None:
    """Fork workers compiling `kernels` (a recipe's field); None where `unusable` says
    why not, or when anything fails before the fork (an optimisation: apply goes on)."""
    if unusable(kernels):
        return None
    try:
        return _start(kernels, workers)
    except Exception:  # noqa: BLE001 - no fds, no kernels module: compile in the parent
        return None


def _start(kernels: Mapping[str, Any], workers: int | None) -> Precompile | None:
    import torch
    import triton.compiler.compiler  # noqa: F401 - imported before the fork: no import lock
    import triton.runtime.build  # noqa: F401 - another thread could hold across it
    from triton.backends.compiler import GPUTarget

    from advisor.kernels.registry import all_kernels

    all_kernels()  # every kernel module imported (the rewrite would import them later)
    entries = kernels["entries"]
    device = torch.cuda.current_device()
    backend, arch = str(kernels["target"]).split(":")
    target = GPUTarget(backend, int(arch), 32)
    n = min(workers, len(entries)) if workers else _worker_count(len(entries))
    # entries go to workers in turn, in the recipe's order (the first bucket's first)
    chunks = [[(i, entries[i]["spec"]) for i in range(w, len(entries), n)] for w in range(n)]
    handle = Precompile([list(e["buckets"]) for e in entries])
    rfd, wfd = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # a child must not write out the parent's buffer
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    try:
        with warnings.catch_warnings():  # "multi-threaded, fork() may deadlock": the child
            warnings.simplefilter("ignore", DeprecationWarning)  # runs only Triton's compiler
            pid = os.fork()
    except OSError:
        os.close(rfd)
        os.close(wfd)
        return None
    if pid == 0:  # the leader: forks the other workers (off the parent's thread), never returns
        os.close(rfd)
        _leader(chunks, device, target, wfd, parent)
    os.close(wfd)
    handle.leader = pid
    atexit.register(handle.stop)
    threading.Thread(target=handle._read, args=(rfd, [pid]), name="advisor-precompile",
                     daemon=True).start()
    return handle


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux; the flag is not inherited by a
    fork, so each worker sets it), and exit now if the parent already has."""
    import gc

    gc.disable()  # no finaliser of the parent's objects (CUDA tensors) runs here
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _detach(wfd: int) -> None:
    """In the leader, before it forks the others: its own process group (the parent can
    stop them all), killed with the parent, output to /dev/null, none of the parent's GPU
    files held (a dead parent's device memory is not kept alive by its workers)."""
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                fd = int(name)
                if fd > 2 and fd != wfd and os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                    os.close(fd)


def _leader(chunks: list[list[tuple[int, str]]], device: int, target: Any, wfd: int,
            parent: int) -> None:
    """The first worker: detaches, does Triton's per-process setup once (its cache key
    hashes libtriton; the driver's utilities), forks one worker per other chunk (a fork
    copies this process's page tables: ~10–50 ms each for a process holding torch and a
    model, paid here rather than on the parent's first call), compiles the first chunk,
    reaps the others, exits."""
    pids = []
    try:
        _die_with(parent)
        _detach(wfd)
        _setup(device, target)
        me = os.getpid()
        for chunk in chunks[1:]:
            pid = os.fork()
            if pid == 0:
                _child(chunk, me, target, wfd)
            pids.append(pid)
    except BaseException:  # noqa: BLE001 - fewer workers: the parent compiles what is missing
        pass
    try:
        _compile(chunks[0], target, wfd)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    except BaseException:  # noqa: BLE001 - never return into the parent's code
        pass
    finally:
        os._exit(0)


def _setup(device: int, target: Any) -> None:
    """Triton's state for compiling here: no hooks, a driver that answers with the
    parent's device and target (CUDA is never called), its cache key computed."""
    from triton import knobs
    from triton.runtime.cache import triton_key
    from triton.runtime.driver import driver

    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    active = driver.active
    active.get_current_device = lambda: device
    active.get_current_target = lambda: target
    triton_key()


def _child(chunk: list[tuple[int, str]], leader: int, target: Any, wfd: int) -> None:
    """A forked worker: `_compile`, then exit (never return into the parent's code)."""
    try:
        _die_with(leader)
        _compile(chunk, target, wfd)
    except BaseException:  # noqa: BLE001
        pass
    finally:
        os._exit(0)


def _compile(chunk: list[tuple[int, str]], target: Any, wfd: int) -> None:
    """Compile each specialisation into the on-disk cache and build its launcher (triton
    3.6 builds one per signature; 3.9's is generic), writing one line per entry to `wfd`."""
    from triton.runtime.driver import driver

    functions = _jit_functions()
    for i, spec in chunk:
        t0 = time.perf_counter()
        try:
            fn = functions.get(str(json.loads(spec).get("name")))
            if fn is None:
                raise LookupError("not an advisor kernel")
            kernel = fn.preload(_rebuilt(spec, fn, target, i))
            driver.active.launcher_cls(kernel.src, kernel.metadata)
            status = "ok"
        except Exception as exc:  # the parent compiles it as before
            status = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        os.write(wfd, (json.dumps([i, status, round(time.perf_counter() - t0, 3)]) + "\n").encode())
