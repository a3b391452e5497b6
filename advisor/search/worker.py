"""Worker processes: every candidate plan is built and run away from the parent
(RELIABILITY.md items 7–10).

A worker is a `multiprocessing` **spawn** child: it loads the model file once, builds the
unfused model on the device, and then serves requests over a pipe. The parent never touches
CUDA for trials, so a sticky CUDA error, a segfault, `os._exit` or the OOM killer only ever
takes down a worker: the parent sees the pipe close (or the process gone), FAILs the trial
with `crash` and starts a fresh worker for the next one. A request that stays silent past
its stage timeout (compile, then verify + time: each stage gets its own) is killed and
FAILs with `timeout`.

Protocol (dicts over the pipe)::

    parent -> worker  {"op": "describe" | "trial" | "measure", ...}   or {"op": "stop"}
    worker -> parent  {"kind": "ready", "fingerprint", "environment", "device"}   once, then
                      per request any number of {"kind": "stage", "stage": name} and one
                      {"kind": "result", "ok": bool, ...}; ok=False carries reason/message,
                      fatal=True means the worker exits right after (poisoned CUDA context)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from advisor.errors import AdvisorError, ModelFileError


@dataclass(frozen=True)
class WorkerSpec:
    path: str                  # model file
    device: str                # "cuda", "cuda:1", "cpu"
    dtype: Any                 # torch.dtype (picklable)
    batch: int
    startup_timeout_s: float = 600.0
    phase: str = "prefill"     # "decode": lengths are KV-cache context lengths


def _device_for(device: str, index: int) -> str:
    """Plain "cuda" with several GPUs: worker i takes GPU i mod n (timings stay apart)."""
    if device != "cuda":
        return device
    import torch

    n = torch.cuda.device_count()
    return f"cuda:{index % n}" if n > 1 else device


def _exit_with(parent_pid: int) -> None:
    """A worker whose parent is gone (kill -9) exits too, even in the middle of a hang."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="advisor-parent-watch", daemon=True).start()


def _no_semaphores() -> None:
    """torch.fx's progress bar (tqdm) takes a multiprocessing lock: a named semaphore that a
    killed worker would leak (and the parent's resource tracker warn about). A thread lock
    does the same job inside one process."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def serve(conn: Any, spec: WorkerSpec, index: int, parent_pid: int) -> None:
    """Worker entry point: load once, then answer requests until "stop" or the pipe closes."""
    _exit_with(parent_pid)
    _no_semaphores()
    from advisor.env import environment
    from advisor.runtime.recipe import fingerprint
    from advisor.search.objective import FATAL, HANDLERS, classify, load_context, one_line

    try:
        ctx = load_context(spec.path, _device_for(spec.device, index), spec.dtype, spec.batch,
                           spec.phase)
        ready = {"kind": "ready", "fingerprint": fingerprint(ctx.model), "device": str(ctx.device),
                 "environment": environment(ctx.device)}
    except Exception as exc:
        user = isinstance(exc, AdvisorError)
        conn.send({"kind": "error", "user": user, "message": str(exc) if user else one_line(exc)})
        return
    conn.send(ready)
    stage = lambda name: conn.send({"kind": "stage", "stage": name})
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if req.get("op") == "stop":
            return
        try:
            result = HANDLERS[req["op"]](ctx, req, stage)
        except Exception as exc:
            reason, user = classify(exc), isinstance(exc, AdvisorError)
            result = {"ok": False, "reason": reason, "user": user, "fatal": reason in FATAL,
                      "message": str(exc) if user else one_line(exc)}
        conn.send({"kind": "result", **result})
        if result.get("fatal"):
            os._exit(70)


def failed(reason: str, message: str) -> dict[str, Any]:
    return {"kind": "result", "ok": False, "reason": reason, "message": message}


class Worker:
    """The parent's handle on one worker process; restarts it after a crash or timeout."""

    def __init__(self, spec: WorkerSpec, index: int = 0):
        self.spec, self.index = spec, index
        self.proc: Any = None
        self.conn: Any = None
        self.info: dict[str, Any] = {}
        self.restarts = -1  # the first start is not a restart

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def launch(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, self.spec, self.index, os.getpid()),
                                name=f"advisor-worker-{self.index}")
        self.proc.start()
        child.close()
        self.conn = parent
        self.restarts += 1

    def wait_ready(self) -> dict[str, Any]:
        """Block until the worker loaded the model; a model-file problem is a ModelFileError."""
        if not self.conn.poll(self.spec.startup_timeout_s):
            self.kill()
            raise AdvisorError(f"worker did not load {self.spec.path} within "
                               f"{self.spec.startup_timeout_s:.0f}s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            msg = {"kind": "error", "user": False, "message": self._death()}
        if msg["kind"] != "ready":
            self.kill()
            cls = ModelFileError if msg.get("user") else AdvisorError
            raise cls(msg["message"] if msg.get("user") else f"worker failed to start: {msg['message']}")
        self.info = msg
        return msg

    def request(self, req: dict[str, Any], stage_timeout_s: float,
                deadline: float | None = None) -> dict[str, Any]:
        """Send one request and wait for its result; crash/timeout become failed results."""
        if not self.alive:
            self.kill()
            self.launch()
            self.wait_ready()
        try:
            self.conn.send(req)
        except (BrokenPipeError, OSError):
            return self._lost("crash", "worker pipe closed")

        def limit() -> float:
            t = time.monotonic() + stage_timeout_s
            return t if deadline is None else min(t, deadline)

        until = limit()
        while True:
            wait = until - time.monotonic()
            if wait <= 0:
                return self._lost("timeout", f"no answer within {stage_timeout_s:.0f}s (killed)")
            if not self.conn.poll(min(wait, 0.5)):
                if not self.proc.is_alive():
                    return self._lost("crash", self._death())
                continue
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return self._lost("crash", self._death())
            if msg["kind"] == "stage":
                until = limit()  # each stage (compile, verify+time) gets its own timeout
            elif msg["kind"] == "result":
                if msg.get("fatal"):
                    self.kill()
                return msg

    def _death(self) -> str:
        if self.proc is not None:
            self.proc.join(timeout=5)
            code = self.proc.exitcode
            if code is not None and code < 0:
                return f"worker killed by signal {-code}"
            return f"worker exited with code {code}"
        return "worker is gone"

    def _lost(self, reason: str, message: str) -> dict[str, Any]:
        self.kill()
        return failed(reason, message)

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(timeout=10)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def stop(self) -> None:
        """Ask politely (a worker busy with a trial does not answer: killed after 3 s)."""
        if self.alive:
            try:
                self.conn.send({"op": "stop"})
                self.proc.join(timeout=3)
            except (BrokenPipeError, OSError):
                pass
        self.kill()


class WorkerPool:
    """K workers; each trial leases one for its duration (one trial per worker at a time)."""

    def __init__(self, spec: WorkerSpec, k: int = 1):
        self.workers = [Worker(spec, i) for i in range(k)]
        self._free: queue.Queue[Worker] = queue.Queue()

    def start(self) -> dict[str, Any]:
        """Start every worker (in parallel); returns the first one's ready info."""
        try:
            for w in self.workers:
                w.launch()
            for w in self.workers:
                w.wait_ready()
                self._free.put(w)
        except BaseException:
            self.close()
            raise
        return self.workers[0].info

    @contextmanager
    def lease(self) -> Iterator[Worker]:
        w = self._free.get()
        try:
            yield w
        finally:
            self._free.put(w)

    @property
    def restarts(self) -> int:
        return sum(max(0, w.restarts) for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
