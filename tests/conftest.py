"""Test setup: Triton runs through its interpreter on the CPU (no GPU in CI).

TRITON_INTERPRET must be set before triton/advisor kernels are imported, hence here.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ADVISOR_EXAMPLE_SIZE", "tiny")
