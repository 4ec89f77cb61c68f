"""Greedy sampling's argmax op (csrc/argmax_cpu.cpp) against torch.argmax: the same index for every row,
ties (the first maximum), NaN (the first NaN), infinities, and lengths around the 16-lane steps."""

import pytest
import torch

from ascendserve.worker.sampler import argmax_rows


def _check(kernels, logits: torch.Tensor) -> None:
    got = kernels.argmax_rows(logits)
    assert got.dtype == torch.int64 and got.shape == logits.shape[:1]
    assert torch.equal(got, logits.argmax(dim=-1)), (got, logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 1000, 248320])
def test_random_rows(kernels, vocab):
    g = torch.Generator().manual_seed(vocab)
    _check(kernels, torch.randn(5, vocab, generator=g) * 4)


@pytest.mark.parametrize("vocab", [7, 40, 129])
def test_ties_give_the_first_maximum(kernels, vocab):
    g = torch.Generator().manual_seed(1)
    # Few distinct values: the maximum repeats across lanes and within a lane.
    logits = torch.randint(-3, 3, (64, vocab), generator=g).float()
    logits[0] = 0.0
    logits[1] = -0.0
    logits[2, ::2] = -0.0  # -0.0 and 0.0 compare equal: the first of either
    _check(kernels, logits)


@pytest.mark.parametrize("vocab", [5, 16, 37, 100])
def test_nan_and_infinities(kernels, vocab):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, vocab, generator=g)
    logits[0, vocab // 2] = float("nan")
    logits[1, -1] = float("nan")
    logits[1, 0] = float("inf")
    logits[2] = float("-inf")
    logits[3, vocab // 3] = float("inf")
    logits[3, -1] = float("inf")
    logits[4, 0] = float("nan")
    logits[5] = float("nan")
    logits[6, 3:] = float("-inf")
    _check(kernels, logits)


def test_no_rows(kernels):
    _check(kernels, torch.empty(0, 10))


def test_rejects_what_it_cannot_read(kernels):
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.argmax_rows(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.argmax_rows(torch.randn(8, 4).t())


def test_sampler_helper_falls_back_to_torch():
    # A strided view or another dtype takes torch's argmax; the result is the same either way.
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    for x in (logits, logits[:, ::2], logits.double(), logits.bfloat16()):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
