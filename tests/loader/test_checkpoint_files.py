"""What a checkpoint directory holds: sharded safetensors with their index, pytorch .bin files, quantized checkpoints
(refused with a clear error, never loaded as garbage), the dtype a composite config declares at its root."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from ascendserve import LLM, SamplingParams
from ascendserve.loader.model_loader import _resolve_dtype
from ascendserve.models.weights import WeightLoadError
from ascendserve.platforms import get_platform
from tests.models.reference import randomize_

PROMPT = {"prompt_token_ids": [5, 17, 99, 3, 250, 64, 7]}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def save_llama(path, **save_kwargs) -> list[int]:
    """A tiny random Llama saved at `path`; transformers' greedy tokens for PROMPT."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    model.save_pretrained(path, **save_kwargs)
    ids = torch.tensor([PROMPT["prompt_token_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def generate(path) -> list[int]:
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_checkpoint_reads_the_files_its_index_names(tmp_path):
    expected = save_llama(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    assert generate(tmp_path) == expected  # the stale file beside the shards is not read (was an unknown tensor)
    os.remove(tmp_path / shards[-1])
    with pytest.raises(FileNotFoundError, match=rf"lists weight files that are not in .*{shards[-1]}"):
        generate(tmp_path)


@pytest.mark.parametrize("dropped", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_a_missing_piece_of_a_fused_weight_is_named(tmp_path, dropped):
    """q/k/v and gate/up load into one fused parameter each: a checkpoint without one of the pieces used to load with
    that piece's rows left random, and the engine generated garbage without a word."""
    save_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=rf"no tensor for 1 parameters, e.g. \['{dropped}'\]"):
        generate(tmp_path)


def test_pytorch_bin_weights_load(tmp_path):
    expected = save_llama(tmp_path)  # transformers 5 writes safetensors only: made a .bin checkpoint here
    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    os.remove(tmp_path / "model.safetensors")
    assert generate(tmp_path) == expected


@pytest.mark.parametrize("kept", [0.5, 0.001])
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_truncated_weight_file_is_named(tmp_path, kind, kept):
    """An interrupted download or copy leaves a weight file cut short: the error names the file and what to do (it was
    safetensors' bare 'Error while deserializing header' or torch's zip error, with no file name)."""
    save_llama(tmp_path)
    if kind == "bin":
        torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
        os.remove(tmp_path / "model.safetensors")
    file = tmp_path / ("model.safetensors" if kind == "safetensors" else "pytorch_model.bin")
    data = file.read_bytes()
    file.write_bytes(data[:max(8, int(len(data) * kept))])
    with pytest.raises(WeightLoadError, match=rf"cannot read the weight file {file} .*truncated or corrupt"):
        generate(tmp_path)


def test_quantized_checkpoints_are_refused_clearly(tmp_path):
    save_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match=r"quantized \(quantization_config, quant_method='fp8'\).*not supported"):
        generate(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))  # no declaration, but int8 values (a w8a8 layout)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name].to(torch.int8)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=rf"{name}' is torch.int8: quantized checkpoints are not supported"):
        generate(tmp_path)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "foo_bar", "architectures": ["FooForCausalLM"]},
     r"\(model_type 'foo_bar', architectures \['FooForCausalLM'\]\) is not one this engine runs; supported "
     r"architectures: \['LlamaForCausalLM'"),  # was transformers' 'pip install --upgrade transformers'
    ({"architectures": ["FooForCausalLM"]}, r"\(no model_type, .* is not one this engine runs"),
    ({"model_type": "qwen9_next", "architectures": ["Qwen3_5ForCausalLM"]},
     r"is a Qwen3_5ForCausalLM \(model_type 'qwen9_next'\), which the installed transformers .* cannot read: "
     r"pip install -U"),
    # a config transformers reads, of a model this engine does not run: said before the tokenizer loads (it was the
    # tokenizer's 'Couldn't instantiate the backend tokenizer' for a directory with a config alone)
    ({"model_type": "llama", "architectures": ["FooForCausalLM"]},
     r"model architectures \['FooForCausalLM'\] are not supported"),
])
def test_a_model_this_engine_does_not_run_is_named_with_those_it_does(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        generate(tmp_path)


def test_auto_dtype_reads_a_composite_configs_root():
    platform = get_platform("cpu")
    root = SimpleNamespace(dtype="bfloat16")
    text = SimpleNamespace(dtype=None)  # transformers 5 saves a composite model's dtype at the root only
    assert _resolve_dtype("auto", root, text, platform) == platform.default_dtype(torch.bfloat16)
    assert _resolve_dtype("auto", SimpleNamespace(), SimpleNamespace(torch_dtype="float32"), platform) == \
        platform.default_dtype(torch.float32)


def test_generation_config_defaults_in_the_offline_api(tmp_path):
    """vLLM's --generation-config: the checkpoint's generation_config.json gives LLM.generate its defaults (it ran
    with plain SamplingParams() offline); "vllm" turns them off; override_generation_config goes on top."""
    save_llama(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32)
    defaults = llm.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature) == (3, 0.0)
    assert len(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) == 3
    off = LLM(str(tmp_path), skip_tokenizer_init=True, generation_config="vllm", num_gpu_blocks_override=32)
    assert off.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    over = LLM(str(tmp_path), skip_tokenizer_init=True, override_generation_config={"max_new_tokens": 5},
               num_gpu_blocks_override=32)
    assert over.get_default_sampling_params().max_tokens == 5
    with pytest.raises(ValueError, match="generation_config '/nowhere' must be 'auto', 'vllm' or a directory"):
        LLM(str(tmp_path), skip_tokenizer_init=True, generation_config="/nowhere")


def test_hf_overrides_may_be_a_function_of_the_config(tmp_path):
    """vLLM's callable hf_overrides: the config it returns is the one used (an AttributeError before)."""
    expected = save_llama(tmp_path)

    def longer(config):
        config.max_position_embeddings = 96
        return config

    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32,
              hf_overrides=longer)
    assert llm.llm_engine.config.hf_config.max_position_embeddings == 96 and llm.llm_engine.config.max_model_len == 96
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
