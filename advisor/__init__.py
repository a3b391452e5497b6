"""advisor: a profiler-driven kernel-fusion advisor and auto-tuner for PyTorch inference.

Importing this package initialises no CUDA context and patches nothing; the public API
is resolved lazily so `import advisor` stays cheap.

Example::

    import advisor
    recipe = advisor.load_recipe("recipes/llama.json")
    fast = recipe.apply(model)          # or advisor.apply(model, recipe)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "apply", "load_recipe"]


def __getattr__(name: str) -> Any:  # lazy public API (PEP 562)
    if name == "load_recipe":
        from advisor.runtime.recipe import load_recipe

        return load_recipe
    if name == "apply":
        from advisor.runtime.apply import apply

        return apply
    raise AttributeError(f"module 'advisor' has no attribute {name!r}")
