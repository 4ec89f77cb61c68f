"""Fixtures shared by the CPU kernel tests."""

import pytest

from ascendserve.layers import cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    """torch.ops.ascendserve_cpu, built (or loaded from the cache) on first use."""
    ops = cpu_kernels.ops()
    assert ops is not None, "the CPU kernels did not build: see the warning above"
    return ops


@pytest.fixture
def force_gemm(monkeypatch):
    """force(onednn): fp32 linears use oneDNN's GEMM (True) or MKL's (False) instead of the probe's pick."""
    from ascendserve.layers import linear

    def force(onednn: bool) -> None:
        monkeypatch.setenv(linear.ONEDNN_ENV_VAR, "1" if onednn else "0")
        linear.onednn_gemm_faster.cache_clear()

    yield force
    linear.onednn_gemm_faster.cache_clear()  # the next caller probes again, with the environment restored
