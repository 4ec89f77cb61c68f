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
    """force(gemm): fp32 linears use that GEMM ("panel", "onednn" or "mkl") instead of the probe's pick."""
    from ascendserve.layers import linear

    def force(gemm: str) -> None:
        monkeypatch.setenv(linear.FP32_GEMM_ENV_VAR, gemm)

    return force
