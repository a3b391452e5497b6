"""User-facing errors: one clear line, exit code 2 from the CLI (RELIABILITY.md, ERR)."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`: how a caught failure is recorded in a result."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class AdvisorError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    exit_code = 2


class ModelFileError(AdvisorError):
    """The model file cannot be loaded or its forward raises."""


class RecipeError(AdvisorError):
    """A recipe or plan file is corrupt, of another schema, or unsafe."""


class KernelInputError(AdvisorError, ValueError):
    """A kernel launcher was given tensors it cannot handle (shape, dtype, layout)."""
