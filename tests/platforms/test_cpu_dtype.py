"""`--dtype auto` on CPU: bf16 / fp16 checkpoints run in bf16 where the CPU has AMX, or AVX512-BF16 on AMD (Zen 4 or
later) (bf16_by_default)."""

import pytest
import torch

from ascendserve.platforms import cpu
from ascendserve.platforms.cpu import CpuPlatform

ZEN3 = {"avx2", "fma"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


AMD, INTEL = "AuthenticAMD", "GenuineIntel"


@pytest.mark.parametrize("flags,vendor,half_runs_in", [
    (ZEN3, AMD, torch.float32),
    (ZEN4, AMD, torch.bfloat16),  # Zen 4 (BENCHMARKS.md run 101) and Zen 5: the same flags
    (ZEN4, INTEL, torch.float32),  # Cooper Lake: AVX512-BF16 without AMX
    (SAPPHIRE_RAPIDS, INTEL, torch.bfloat16),
    (set(), "", torch.float32),
])
def test_half_precision_checkpoints_run_in_bf16_with_amx_or_on_amd_avx512_bf16(monkeypatch, flags, vendor, half_runs_in):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(cpu, "cpu_vendor", lambda: vendor)
    platform = CpuPlatform()
    for checkpoint in (torch.bfloat16, torch.float16):
        assert platform.default_dtype(checkpoint) == half_runs_in
    assert platform.default_dtype(torch.float32) == torch.float32 and platform.default_dtype(None) == torch.float32
    assert cpu.cpu_has_fast_bf16() == bool({"amx_bf16", "avx512_bf16"} & flags)


def test_cpu_flags_reads_this_machine():
    flags = cpu.cpu_flags()
    with open("/proc/cpuinfo") as f:
        line = next(ln for ln in f if ln.startswith("flags"))
    assert flags == set(line.split(":", 1)[1].split())


def test_cpu_vendor_reads_this_machine():
    vendor = cpu.cpu_vendor()
    with open("/proc/cpuinfo") as f:
        text = f.read()
    assert vendor and f"vendor_id\t: {vendor}" in text
