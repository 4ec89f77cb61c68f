"""Architecture name (config.architectures[0]) -> model class."""

import importlib

# name -> (module under ascendserve.models, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForCausalLM"),  # text path
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),  # text path
}


def supported_architectures() -> list[str]:
    """Every architecture name the engine can run."""
    return sorted(_MODELS)


def supported_architecture(architectures: list[str] | None) -> str:
    """The first supported name in `architectures`; ValueError naming them if none."""
    for arch in architectures or []:
        if arch in _MODELS:
            return arch
    raise ValueError(f"model architectures {architectures} are not supported; "
                     f"supported: {supported_architectures()}")


def get_model_class(architectures: list[str] | None):
    """The class for the first supported name in `architectures`; ValueError naming them if none."""
    module, cls = _MODELS[supported_architecture(architectures)]
    return getattr(importlib.import_module(f"ascendserve.models.{module}"), cls)
