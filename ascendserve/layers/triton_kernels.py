"""Whether Gated DeltaNet (decode rows and prefill sequences) and decode attention run as the Triton kernels of
layers/triton_ops.py.

ASCENDSERVE_TRITON_KERNELS=1 turns them on for tensors on a CUDA device; unset or 0, the plain-torch forms run. They
are off by default until a GPU run has measured them (checked for correctness against the torch forms under Triton's
interpreter only: tests/layers/test_triton_ops.py). Under the interpreter (TRITON_INTERPRET=1, set before triton
is first imported) the switch also takes CPU tensors, so the engine's tests can run a whole model through them.

ASCENDSERVE_TRITON_CHUNKED_PREFILL=1 (with the above) runs Gated DeltaNet's prefill recurrence in the chunked form
(triton_ops.chunk_gated_delta_rule: 64 tokens a step in matrix products) instead of token by token. Which is faster
at which prompt lengths is for a GPU run to measure (benchmarks/cuda_bench.py's prefill-lengths stage); until then
token by token stays, as measured first.
"""

import os
import threading

import torch

from ascendserve.config import env_switch
from ascendserve.logger import init_logger

logger = init_logger(__name__)

ENV_VAR = "ASCENDSERVE_TRITON_KERNELS"
CHUNKED_PREFILL_ENV = "ASCENDSERVE_TRITON_CHUNKED_PREFILL"
_lock = threading.Lock()
_state: dict = {}  # "ops": the imported triton_ops module, or None once an import failed; "ignored": device types


def ops_for(t: torch.Tensor):
    """layers.triton_ops when the switch is on and t's device runs Triton (CUDA, or the CPU under the
    interpreter) and triton imports; else None."""
    if env_switch(ENV_VAR) is not True:
        return None
    if t.device.type != "cuda" and not (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        if t.device.type not in _state.setdefault("ignored", set()):  # said once per device type
            _state["ignored"].add(t.device.type)
            logger.info("%s=1 applies to CUDA devices: on %s the layers keep their own kernels", ENV_VAR,
                        t.device.type)
        return None
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                _state["ops"] = _import()
    return _state["ops"]


def chunked_prefill() -> bool:
    """Whether the Triton prefill's delta rule runs chunked (ASCENDSERVE_TRITON_CHUNKED_PREFILL=1), not token by
    token."""
    return env_switch(CHUNKED_PREFILL_ENV) is True


def _import():
    try:
        from ascendserve.layers import triton_ops
    except ImportError as e:
        logger.warning("%s=1 but triton does not import (%s): Gated DeltaNet and decode attention stay on their "
                       "plain-torch ops", ENV_VAR, e)
        return None
    logger.info("Triton kernels on: Gated DeltaNet conv + recurrent update (decode and prefill), paged decode "
                "attention")
    return triton_ops
