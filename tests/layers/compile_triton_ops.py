"""Compile the Triton kernels for NVIDIA GPUs without one: Triton's own compiler and ptxas, as the first launch
on a GPU would, for Qwen3.5's real shapes. Prints one JSON line per kernel variant with its registers, spill bytes and
shared memory (from cuobjdump), or the compile error. Run in a process where TRITON_INTERPRET is unset (the
interpreter replaces the kernels' compiled form): tests/layers/test_triton_ops.py does.

    python tests/layers/compile_triton_ops.py [--archs 80,90]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ascendserve.layers import triton_ops as ops

# The launches' argument types (torch strides and sizes are ints: i32 is their general specialization).
CONV = dict(x_ptr="*{x}", x_row="i32", w_ptr="*{x}", w_row="i32", state_ptr="*{s}", s_slot="i32", s_chan="i32",
            s_col="i32", slot_ptr="*i64", y_ptr="*{x}", channels="i32")
GDN = dict(x_ptr="*{x}", x_row="i32", ba_ptr="*{x}", ba_row="i32", a_log_ptr="*{x}", dt_bias_ptr="*{x}",
           state_ptr="*{s}", s_slot="i32", slot_ptr="*i64", out_ptr="*{x}", scale="fp32", key_dim="i32")
PAGED = dict(q_ptr="*{x}", q_row="i32", k_ptr="*{s}", v_ptr="*{s}", c_block="i32", c_token="i32", table_ptr="*i64",
             table_row="i32", ctx_ptr="*i64", out_ptr="*{x}", o_row="i32", part_ptr="*fp32", split_blocks="i32",
             scale="fp32")
CONV_PREFILL = dict(CONV, cu_ptr="*i64", init_ptr="*i1")
GDN_PREFILL = dict(GDN, cu_ptr="*i64", init_ptr="*i1")
REDUCE = dict(part_ptr="*fp32", out_ptr="*{x}", o_row="i32", splits="i32")
CHUNK_SCRATCH = dict(qkw_ptr="*{p}", u_ptr="*fp32", aqk_ptr="*{p}", g_ptr="*fp32")  # p: the products' operands
CHUNK_PREPARE = dict(x_ptr="*{x}", x_row="i32", ba_ptr="*{x}", ba_row="i32", a_log_ptr="*{x}", dt_bias_ptr="*{x}",
                     cu_ptr="*i64", **CHUNK_SCRATCH, scale="fp32", key_dim="i32")
CHUNK_SCAN = dict(state_ptr="*{s}", s_slot="i32", slot_ptr="*i64", cu_ptr="*i64", init_ptr="*i1", **CHUNK_SCRATCH,
                  out_ptr="*{x}")
# num_warps: a launch option; DOT (None here) follows the activations' dtype, as chunk_gated_delta_rule picks it
CHUNKED = dict(C=ops.DELTA_CHUNK, DOT=None, num_warps=ops.DELTA_WARPS)
# Qwen3.5-0.8B and -27B (shared/reference): Gated DeltaNet heads (key, value) x 128, attention heads (q, kv) x 256.
# Each in the dtypes it meets: (activations, state or cache) of a bf16 model, an fp32 one, and the mixed one (a bf16
# model's fp32 recurrent state; an fp32 model's --kv-cache-dtype bfloat16).
SAME = [("bf16", "bf16"), ("fp32", "fp32")]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VARIANTS = [
    ("conv", ops._conv1d_decode_kernel, CONV, dict(WIDTH=3, SILU=True, BLOCK_C=ops.CONV_BLOCK), SAME),
    ("gdn-0.8b", ops._gated_delta_rule_decode_kernel, GDN,
     dict(HK=16, HV=16, DK=128, DV=128, BK=128, BV=ops.STATE_BLOCK_V), SAME + [("bf16", "fp32")]),
    ("gdn-27b", ops._gated_delta_rule_decode_kernel, GDN,
     dict(HK=16, HV=48, DK=128, DV=128, BK=128, BV=ops.STATE_BLOCK_V), [("bf16", "fp32")]),
    ("conv-prefill", ops._conv1d_prefill_kernel, CONV_PREFILL, dict(SILU=True, BLOCK_C=ops.CONV_BLOCK), SAME),
    ("gdn-prefill", ops._gated_delta_rule_prefill_kernel, GDN_PREFILL,
     dict(HK=16, HV=16, DK=128, DV=128, BK=128, BV=ops.STATE_BLOCK_V), SAME + [("bf16", "fp32")]),
    ("chunk-prepare", ops._chunk_prepare_kernel, CHUNK_PREPARE,
     dict(HK=16, HV=16, DK=128, DV=128, BK=128, BV=ops.STATE_BLOCK_V, **CHUNKED), SAME),
    ("chunk-scan-0.8b", ops._chunk_gated_delta_rule_kernel, CHUNK_SCAN,
     dict(HV=16, DK=128, DV=128, BK=128, BV=ops.STATE_BLOCK_V, **CHUNKED), SAME + [("bf16", "fp32")]),
    ("chunk-scan-27b", ops._chunk_gated_delta_rule_kernel, CHUNK_SCAN,
     dict(HV=48, DK=128, DV=128, BK=128, BV=ops.STATE_BLOCK_V, **CHUNKED), [("bf16", "fp32")]),
    ("paged-0.8b", ops._paged_decode_kernel, PAGED, dict(GROUP=4, BG=16, D=256, BD=256, BLOCK=16, PARTIAL=False),
     SAME + [("fp32", "bf16")]),
    ("paged-27b", ops._paged_decode_kernel, PAGED, dict(GROUP=6, BG=16, D=256, BD=256, BLOCK=16, PARTIAL=False),
     [("bf16", "bf16")]),
    ("paged-split", ops._paged_decode_kernel, PAGED, dict(GROUP=4, BG=16, D=256, BD=256, BLOCK=16, PARTIAL=True),
     [("bf16", "bf16")]),
    ("paged-reduce", ops._paged_decode_reduce_kernel, REDUCE, dict(D=256, BD=256), [("bf16", "bf16")]),
]


def resources(cubin: bytes) -> dict:
    """Registers, spill stores / loads (bytes) and static shared memory of a cubin, from cuobjdump's resource usage."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = {key: int(m.group(1)) for key, pattern in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"),
                                                       ("shared", r"SHARED:(\d+)")) if (m := re.search(pattern, text))}
    return found


def compile_one(kernel, types: dict, constexprs: dict, x: str, s: str, arch: int) -> dict:
    constexprs = dict(constexprs)
    if "DOT" in constexprs:
        constexprs["DOT"] = ops.delta_dot(DTYPES[x])
    options = dict(ops.LAUNCH_OPTIONS)  # as the launches ask
    if "num_warps" in constexprs:  # a launch option too
        options["num_warps"] = constexprs.pop("num_warps")
    p = "fp32" if x == "fp32" else "bf16"  # the chunked delta rule's scratch, as chunk_gated_delta_rule allocates it
    signature = {name: t.format(x=x, s=s, p=p) for name, t in types.items()} | {name: "constexpr" for name in constexprs}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    return resources(compiled.asm["cubin"]) | {"num_warps": compiled.metadata.num_warps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", default="80,90", help="compute capabilities (80: A100, 90: H100 / H200)")
    ns = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1: the kernels are interpreted here; run without it")
    for arch in (int(a) for a in ns.archs.split(",")):
        for name, kernel, types, constexprs, dtypes in VARIANTS:
            for x, s in dtypes:
                row = {"kernel": name, "arch": arch, "dtypes": f"{x}/{s}"}
                try:
                    row |= compile_one(kernel, types, constexprs, x, s, arch)
                except Exception as e:  # reported per variant; the caller decides
                    row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
