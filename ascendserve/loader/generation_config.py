"""Default sampling parameters from a checkpoint's generation_config.json (vLLM's --generation-config)."""

import json
import os

from ascendserve.logger import init_logger

logger = init_logger(__name__)

# generation_config.json keys and the SamplingParams fields they set
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling_params(model_path: str, generation_config: str = "auto",
                            overrides: dict | None = None) -> dict | None:
    """The SamplingParams fields a request without them gets: from `generation_config` ("auto": the checkpoint's
    generation_config.json; "vllm": none; else a directory holding one), then `overrides` (vLLM's
    --override-generation-config, same key names) on top; None when there are none."""
    source = model_path if generation_config == "auto" else None if generation_config == "vllm" else generation_config
    path = os.path.join(source, "generation_config.json") if source and os.path.isdir(source) else None
    if generation_config not in ("auto", "vllm") and path is None:
        raise ValueError(f"generation_config {generation_config!r} must be 'auto', 'vllm' or a directory holding a "
                         f"generation_config.json")
    config = {}
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    config.update(overrides or {})
    defaults = {ours: config[theirs] for theirs, ours in _KEYS.items() if config.get(theirs) is not None}
    if defaults:
        logger.info("Default sampling parameters have been overridden by the model's generation config: %s",
                    defaults)
    return defaults or None
