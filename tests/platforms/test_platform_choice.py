"""Which platform `device auto` picks, and what it says when an installed accelerator stack gives no device."""
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from ascendserve.platforms import get_platform


@pytest.fixture
def torch_npu_package(tmp_path, monkeypatch):
    """A `torch_npu` on sys.path whose import runs the given body (the real one is never installed here)."""
    def install(body: str):
        (tmp_path / "torch_npu").mkdir()
        (tmp_path / "torch_npu" / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
    yield install
    sys.modules.pop("torch_npu", None)  # the fake, imported or half-imported, leaves with the test


def test_a_cpu_machine_picks_the_cpu_without_a_word(caplog):
    with caplog.at_level(logging.WARNING):
        assert get_platform("auto").name == "cpu"
    assert "running on the CPU" not in caplog.text  # no torch_npu and a CPU torch: nothing is wrong


def test_torch_npu_that_does_not_import_is_said(torch_npu_package, caplog):
    torch_npu_package("raise ImportError('libascendcl.so: cannot open shared object file')")
    with caplog.at_level(logging.WARNING):
        assert get_platform(None).name == "cpu"
    assert ("torch_npu is installed but does not import (ImportError: libascendcl.so: cannot open shared object "
            "file); is CANN's set_env.sh sourced?: running on the CPU") in caplog.text
    with pytest.raises(ValueError, match="device 'npu' was requested but is not available in this process: "
                                         "torch_npu is installed but does not import"):
        get_platform("npu")


def test_torch_npu_without_a_device_is_said(torch_npu_package, monkeypatch, caplog):
    torch_npu_package("")
    monkeypatch.setattr(torch, "npu", SimpleNamespace(is_available=lambda: False), raising=False)
    with caplog.at_level(logging.WARNING):
        assert get_platform("auto").name == "cpu"
    assert "torch_npu is installed but sees no NPU (check npu-smi info" in caplog.text


def test_a_cuda_build_without_a_gpu_is_said(monkeypatch, caplog):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with caplog.at_level(logging.WARNING):
        assert get_platform("auto").name == "cpu"
    assert "is a CUDA build but sees no GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES=)" in caplog.text


def test_an_absent_device_names_why():
    with pytest.raises(ValueError, match="not available in this process: torch_npu is not installed"):
        get_platform("npu")
