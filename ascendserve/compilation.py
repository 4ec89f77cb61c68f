"""torch.compile of the model's elementwise chains (norms, gated activations, rotary), off with --enforce-eager.

What is compiled: the forward of every module of a class `compiled_module_classes()` lists, each with
`dynamic=True` (one graph whatever the number of tokens) and `fullgraph=True`. All instances of a
class share one compiled graph: parameters are graph inputs, not constants. What is not: linears
(the weight-streaming GEMMs, already single library calls), paged attention and the Gated DeltaNet
kernels (their metadata is Python data, and they update the caches in place).

Why these: at decode sizes each of them is a chain of 5-10 tiny ops whose cost is dispatch, not
arithmetic (an RMSNorm over [8, 576] is ~7 ops of a few microseconds each); inductor fuses each
chain into one C++ loop. On CPU inductor needs a C++ compiler; without one the model runs eagerly
and one line says so.
"""

import shutil

import torch

from ascendserve.config import env_switch
from ascendserve.logger import init_logger

logger = init_logger(__name__)

RECOMPILE_LIMIT = 64
ENV_VAR = "ASCENDSERVE_COMPILE"  # "1": compile even where the platform's default is eager; "0": never


def compiled_module_classes() -> tuple[type, ...]:
    """The module classes whose forward is compiled."""
    from ascendserve.layers.activation import GatedActivation
    from ascendserve.layers.mrope import MRotaryEmbedding
    from ascendserve.layers.norm import GemmaRMSNorm, RMSNorm
    from ascendserve.layers.rotary import RotaryEmbedding
    from ascendserve.models.qwen3_5 import RMSNormGated
    return (RMSNorm, GemmaRMSNorm, RMSNormGated, GatedActivation, RotaryEmbedding, MRotaryEmbedding)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether compile_model_ wrapped this module's forward (an instance attribute over the class's)."""
    return "forward" in vars(module)


def compile_model_(model: torch.nn.Module, platform) -> int:
    """Compile the forwards of `model`'s elementwise modules in place; returns how many were wrapped.

    Runs only where `platform.compile_by_default` (or ASCENDSERVE_COMPILE=1) and, on CPU, where a
    C++ compiler exists; --enforce-eager skips this function altogether.
    """
    wanted = env_switch(ENV_VAR)
    if wanted is False or (wanted is None and not platform.compile_by_default):
        return 0
    if platform.device_type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        logger.warning("no C++ compiler found (c++, g++, clang++): torch.compile cannot build CPU kernels, "
                       "so the model runs eagerly (install g++, or pass --enforce-eager to silence this)")
        return 0
    classes = compiled_module_classes()
    # One compiled entry per variant of a forward's code object, shared by every instance of the class
    # (and by a subclass that inherits it: GemmaRMSNorm's is RMSNorm's): 2-D and 3-D inputs, with and
    # without a residual, one token (specialized) or many, across the models of a process (the test
    # suite's). Dynamo's default of 8 is then too few, and fullgraph=True makes that an error.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    count = 0
    for module in model.modules():
        if isinstance(module, classes):
            module.forward = torch.compile(module.forward, dynamic=True, fullgraph=True)
            count += 1
    logger.info("torch.compile: %d norm / activation / rotary modules (compiled on first use; "
                "--enforce-eager turns this off)", count)
    return count
