"""Positions past max_position_embeddings: rope scaling (the Qwen3.5 model card's YaRN recipe through a nested
--hf-overrides) and VLLM_ALLOW_LONG_MAX_MODEL_LEN, against transformers on tiny random checkpoints."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from ascendserve import LLM
from ascendserve.layers.rotary import position_limit
from ascendserve.loader.model_loader import ALLOW_LONG_ENV, apply_hf_overrides
from tests.models.qwen3_5_tiny import ROPE, TEXT, VISION, VOCAB, greedy_params, randomize_
from tests.models.reference import check_outputs, hf_greedy, make_prompts

NATIVE = 128  # the checkpoints' max_position_embeddings
YARN = {**ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": NATIVE}


def test_position_limit_follows_vllms_rule():
    assert position_limit(LlamaConfig(max_position_embeddings=NATIVE)) == NATIVE
    yarn = LlamaConfig(max_position_embeddings=NATIVE, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                        "factor": 4.0,
                                                                        "original_max_position_embeddings": 64})
    assert position_limit(yarn) == 256  # the original length times the factor
    linear = LlamaConfig(max_position_embeddings=NATIVE, rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                                          "factor": 2.0})
    assert position_limit(linear) == 256
    llama3 = LlamaConfig(max_position_embeddings=NATIVE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    assert position_limit(llama3) == NATIVE  # already extended in max_position_embeddings
    shorter = LlamaConfig(max_position_embeddings=NATIVE)
    shorter.max_sequence_length = 100
    assert position_limit(shorter) == 100  # the smallest length field


def test_hf_overrides_merge_nested_configs_and_rope_dicts():
    config = Qwen3_5Config(text_config={**TEXT, "intermediate_size": 128, "max_position_embeddings": NATIVE},
                           vision_config=VISION)
    apply_hf_overrides(config, {"text_config": {"rope_parameters": YARN}, "tie_word_embeddings": False})
    text = config.get_text_config()
    assert text.rope_parameters["rope_type"] == "yarn" and text.num_hidden_layers == TEXT["num_hidden_layers"]
    assert not config.tie_word_embeddings
    # the rope_scaling spelling, without rope_theta: merged into the rope dict (was a TypeError inside transformers)
    llama = LlamaConfig(max_position_embeddings=NATIVE)
    apply_hf_overrides(llama, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert llama.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def qwen_vl_yarn(tmp_path_factory):
    """A composite Qwen3.5 checkpoint saved with its native rope, and transformers' references with YaRN on."""
    config = Qwen3_5Config(text_config={**TEXT, "intermediate_size": 128, "max_position_embeddings": NATIVE,
                                        "rope_parameters": YARN}, vision_config=VISION, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32).eval()
    randomize_(model, seed=1)
    path = tmp_path_factory.mktemp("qwen_vl_yarn")
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:  # as released: the native rope; YaRN is the user's override
        saved = json.load(f)
    saved["text_config"]["rope_parameters"] = ROPE
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f)
    prompts = make_prompts(VOCAB, [40, 200, 330], seed=5)
    return str(path), prompts, [hf_greedy(model, p, 8) for p in prompts]


def test_qwen3_5_yarn_through_nested_hf_overrides(qwen_vl_yarn):
    """The model card's recipe, --hf-overrides '{"text_config": {"rope_parameters": {... yarn ...}}}': the default
    max_model_len becomes factor x original (512) and prompts past the native 128 positions match transformers."""
    path, prompts, refs = qwen_vl_yarn
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=128,
              hf_overrides={"text_config": {"rope_parameters": YARN}})
    assert llm.llm_engine.config.max_model_len == 4 * NATIVE
    check_outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False), refs)
    with pytest.raises(ValueError, match=r"max_model_len \(600\) is larger than the model's maximum length \(512"):
        LLM(path, skip_tokenizer_init=True, max_model_len=600, hf_overrides={"text_config": {"rope_parameters": YARN}})


def test_allow_long_max_model_len_runs_past_the_native_positions(tmp_path, monkeypatch):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a max_model_len past max_position_embeddings: the rotary tables cover it
    (a position past them was an error inside the rope kernel); outputs as transformers', which computes any
    position."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    model.save_pretrained(tmp_path)
    prompts = make_prompts(VOCAB, [60, 100], seed=4)
    refs = [hf_greedy(model, p, 8) for p in prompts]
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=160, num_gpu_blocks_override=64)
    check_outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False), refs)
