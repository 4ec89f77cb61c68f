"""A Qwen3.5 checkpoint directory as users have it: the real tokenizer, chat template and generation config."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import Qwen3_5TextConfig

from ascendserve import LLM, SamplingParams
from tests.fixtures.qwen3_5_tokenizer import build_qwen3_5_tokenizer

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    config = Qwen3_5TextConfig(vocab_size=248320, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
                               linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                               max_position_embeddings=1024, tie_word_embeddings=True, rope_parameters=ROPE,
                               architectures=["Qwen3_5ForCausalLM"])
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_5_ckpt")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer_dir = build_qwen3_5_tokenizer()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", path / name)
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512)


def test_stops_on_both_eos_tokens_from_generation_config(llm):
    assert llm.llm_engine.eos_token_ids == {248044, 248046}
    for eos in (248044, 248046):
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100}),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [eos] and (out.finish_reason, out.stop_reason) == ("stop", None)
        assert out.text == ""


def test_think_and_tool_call_tags_survive_detokenization(llm):
    tok = llm.get_tokenizer()
    think, tool_call = tok.convert_tokens_to_ids(["<think>", "<tool_call>"])
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=1, logit_bias={think: 100}),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "<think>"
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=1, logit_bias={tool_call: 100}),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "<tool_call>"


def test_chat_renders_the_official_template(llm):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n")
