"""The greedy-selection argmax kernels (advisor/kernels/argmax.py) against torch.argmax,
through Triton's interpreter: ties across and within chunks, NaN, ±inf, odd widths,
strided rows, every float dtype."""

import pytest
import torch

from advisor.errors import KernelInputError
from advisor.kernels.argmax import BLOCK, launch_argmax, reference


@pytest.mark.parametrize("vocab", [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK - 5, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_matches_torch_ties_nan_and_inf(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g).to(dtype)
    top = x.max() + 1
    last = vocab - 1
    x[1, 0], x[1, last] = top, top  # tie across chunks: the first wins
    x[2, last // 2], x[2, last] = top, top
    x[3, last] = float("nan")  # NaN beats everything, the first NaN wins
    x[3, last // 3] = float("nan")
    x[4] = float("-inf")  # all -inf: index 0
    x[5, last] = float("inf")
    assert torch.equal(launch_argmax(x), reference(x))


def test_argmax_strided_rows_and_nan_beats_inf():
    x = torch.randn(3, 5, 2 * BLOCK + 3)
    x[0, -1, 4] = float("inf")
    x[0, -1, 9] = float("nan")
    last = x[:, -1]  # (B, V) rows 5·V apart
    assert torch.equal(launch_argmax(last), reference(last))
    assert launch_argmax(last)[0, 0].item() == 9
    col = torch.randn(2 * BLOCK, 2).t()  # V not unit-stride: copied
    assert torch.equal(launch_argmax(col), reference(col))


def test_argmax_rejects_bad_input():
    with pytest.raises(KernelInputError):
        launch_argmax(torch.zeros(3))
    with pytest.raises(KernelInputError):
        launch_argmax(torch.zeros(2, 3, dtype=torch.int64))
    assert launch_argmax(torch.zeros(0, 5)).shape == (0, 1)
