"""The KV and state caches on CPU: zeroed, and advised to transparent huge pages before first touch."""

import sys
from pathlib import Path

import pytest
import torch

from ascendserve.platforms.cpu import HUGE_PAGE, advise_huge_pages
from ascendserve.worker.model_runner import allocate_kv_caches, allocate_state_caches

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                               or "[never]" in THP.read_text(), reason="no transparent huge pages here")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_caches_are_zero_and_advised_to_huge_pages():
    spec = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64}
    caches = allocate_kv_caches(spec, 512, 16, torch.float32, torch.device("cpu"))  # 8 MiB a layer
    assert len(caches) == 2 and caches[0].shape == (2, 512, 16, 2, 64)
    for cache in caches:
        assert not cache.any()
        inner = -(-cache.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        assert "hg" in _vm_flags(inner)  # MADV_HUGEPAGE recorded on the mapping
    state = allocate_state_caches({"num_layers": 1, "conv_shape": (64, 3), "ssm_shape": (4, 32, 32),
                                   "ssm_dtype": torch.float32}, 256, torch.float32, torch.device("cpu"))
    assert not state[0][0].any() and not state[0][1].any() and state[0][1].shape == (256, 4, 32, 32)
    assert "hg" in _vm_flags(-(-state[0][1].data_ptr() // HUGE_PAGE) * HUGE_PAGE)


def test_advice_needs_a_whole_huge_page():
    assert not advise_huge_pages(torch.empty(1000))  # under 2 MiB: nothing to advise
    big = torch.empty(3 * HUGE_PAGE // 4)  # 3 huge pages of bytes hold at least two whole ones
    assert advise_huge_pages(big) == (sys.platform.startswith("linux") and THP.exists())  # accepted in any mode
