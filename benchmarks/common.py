"""What every benchmark records next to its numbers: GPU, versions, git sha, conditions."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch


def git_sha() -> str:
    from advisor.env import source_revision

    return source_revision() or "unknown"


def header(device: torch.device, **conditions: Any) -> dict[str, Any]:
    from advisor.env import environment

    return {"environment": environment(device), "git_sha": git_sha(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "conditions": conditions}


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or "out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write(name: str, payload: dict[str, Any]) -> Path:
    path = out_dir() / name
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def model_on(path: str, device: str) -> tuple[Any, torch.nn.Module, torch.device, torch.dtype]:
    """A benchmark's model file built on `device`: bf16 on CUDA, fp32 elsewhere (a smoke
    test). Returns (model file, model, device, dtype)."""
    from advisor.loader import build, load_model_file

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    mf = load_model_file(path)
    return mf, build(mf, dev, dtype), dev, dtype
