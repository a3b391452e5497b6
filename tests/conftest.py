"""Test setup: Triton runs through its interpreter on the CPU (no GPU in CI).

TRITON_INTERPRET must be set before triton/advisor kernels are imported, hence here.
`@triton.jit` picks interpreter or compiler when a kernel module is imported, so the
kernels are imported here too: a test that turns the interpreter off (the tune tests do,
for their eager workers) must never be the first to import one, or every later test in
the process would get compiled kernels that cannot launch on the CPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ADVISOR_EXAMPLE_SIZE", "tiny")

from advisor.kernels.registry import all_kernels  # noqa: E402

all_kernels()
