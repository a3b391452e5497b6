"""Environment fingerprint: which device and software versions a measurement was made under.

Ceilings caches and recipes carry this dict so that a number measured on another GPU or
under another torch / triton / advisor version is never reused silently (DESIGN.md,
"Measured, not assumed"). Importing this module touches no CUDA: everything device-related
happens inside `environment`.

Example::

    >>> from advisor.env import environment, env_key
    >>> env = environment("cpu")
    >>> sorted(env)[:3]
    ['advisor', 'capability', 'cuda']
    >>> len(env_key(env))
    16
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "env_key"]


def _cpu_model() -> str:
    """The CPU model string (`/proc/cpuinfo` "model name", else platform's guess)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _triton_version() -> str | None:
    """Triton's version from package metadata (no import: importing triton is slow)."""
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def source_revision() -> str | None:
    """The git commit advisor runs from: $ADVISOR_GIT_SHA where set (a copied checkout's
    own .git may be stale), else `git rev-parse HEAD` beside the package, else None.
    Recorded in result files, never in the recipe environment (a commit changes no
    kernel's timing by itself)."""
    sha = os.environ.get("ADVISOR_GIT_SHA")
    if sha:
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=5, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: torch.device | str) -> dict[str, Any]:
    """Fingerprint of `device` and the software stack, as a JSON-friendly dict.

    Keys: device_type ("cuda"/"cpu"/...), device_name (GPU name or CPU model),
    capability ("9.0" on an H100/H200; None off CUDA), torch, cuda (torch.version.cuda or
    None), triton (or None), advisor, python.
    """
    import advisor

    dev = torch.device(device)
    name, capability = _cpu_model(), None
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        capability = f"{major}.{minor}"
    return {
        "device_type": dev.type,
        "device_name": name,
        "capability": capability,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "advisor": advisor.__version__,
        "python": platform.python_version(),
    }


def env_key(env: dict[str, Any]) -> str:
    """A short stable hash (16 hex digits) of an environment dict (key order irrelevant)."""
    blob = json.dumps(env, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
