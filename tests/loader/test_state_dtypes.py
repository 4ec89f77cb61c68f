"""How a hybrid model's state dtypes are settled from --mamba-cache-dtype / --mamba-ssm-cache-dtype (vLLM's rules)."""

import types

import pytest
import torch

from ascendserve.config import EngineArgs
from ascendserve.loader.model_loader import _resolve_state_dtypes
from ascendserve.platforms import get_platform

HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def text_config(**extra):
    return types.SimpleNamespace(layer_types=HYBRID, **extra)


@pytest.mark.parametrize("cache, ssm, declared, expected", [
    ("auto", "auto", None, (None, torch.float32)),  # nothing said: fp32 recurrent state, the model's conv state
    ("auto", "auto", "float32", (None, torch.float32)),  # Qwen3.5's config.json
    ("auto", "auto", "bfloat16", (None, torch.bfloat16)),
    ("auto", "bfloat16", "float32", (None, torch.bfloat16)),
    ("bfloat16", "auto", "float32", (torch.float32, torch.bfloat16)),  # both, but the CPU keeps an fp32 conv state
    ("bfloat16", "float32", "float32", (torch.float32, torch.float32)),  # the ssm flag wins for the recurrent state
    ("float32", "auto", "bfloat16", (torch.float32, torch.float32)),
])
def test_state_dtypes_on_cpu(cache, ssm, declared, expected, caplog):
    args = EngineArgs(mamba_cache_dtype=cache, mamba_ssm_cache_dtype=ssm)
    extra = {} if declared is None else {"mamba_ssm_dtype": declared}
    with caplog.at_level("WARNING", logger="ascendserve"):
        assert _resolve_state_dtypes(args, text_config(**extra), get_platform("cpu")) == expected
    overridden = expected[1] != getattr(torch, declared or "float32")
    assert ("not the checkpoint's" in caplog.text) == overridden


def test_other_devices_take_the_asked_conv_dtype():
    cuda_like = types.SimpleNamespace(name="cuda")
    args = EngineArgs(mamba_cache_dtype="bfloat16")
    assert _resolve_state_dtypes(args, text_config(), cuda_like) == (torch.bfloat16, torch.bfloat16)


def test_models_without_recurrent_layers_have_no_state_dtypes():
    args = EngineArgs(mamba_ssm_cache_dtype="bfloat16")
    assert _resolve_state_dtypes(args, types.SimpleNamespace(layer_types=None), get_platform("cpu")) == (None, None)


def test_bad_value_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype must be one of \['auto', 'float32', 'bfloat16', "
                                         r"'float16'\], got 'fp8'"):
        EngineArgs.from_kwargs(mamba_ssm_cache_dtype="fp8")
