"""GGUF loader: parity with transformers on the demo file, every quant type, and llama.cpp's q/k permutation."""

import copy
import logging
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ascendserve.loader.demo import get_demo_model_path
from ascendserve.loader.gguf_file import GGUFFile
from ascendserve.loader.gguf_loader import (TOKENIZER_CACHE_ENV_VAR, UnsupportedGGUFError, is_gguf, iter_gguf_weights,
                                            load_gguf_config, load_gguf_tokenizer, tokenizer_cache_dir)

Q = gguf.GGMLQuantizationType
PROMPT = "What is the capital of France?"


# ---------------------------------------------------------------------------------------------------
# (a) the real demo file against transformers' own GGUF support
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_path() -> str:
    return get_demo_model_path()


@pytest.fixture(scope="module")
def demo_config(demo_path):
    return load_gguf_config(demo_path)


@pytest.fixture(scope="module")
def hf_reference(demo_path, demo_config):
    """transformers' own parse of the demo file: its config dict and dequantized state dict.

    `from_pretrained(gguf_file=...)` refuses to run without `accelerate` (not a dependency here); for
    llama it runs `load_gguf_checkpoint(..., model_to_load=model)`, which we call directly. The model
    only supplies parameter names, so it is built on the meta device (no init, no memory).
    """
    with torch.device("meta"):
        # A copy: from_config(dtype=...) writes the dtype into the config it is given.
        model = AutoModelForCausalLM.from_config(copy.deepcopy(demo_config), dtype=torch.float32)
    parsed = load_gguf_checkpoint(demo_path, return_tensors=True, model_to_load=model)
    return parsed["config"], parsed["tensors"]


def test_demo_weights_match_transformers(demo_path, hf_reference):
    _, expected = hf_reference
    seen = set()
    for name, tensor in iter_gguf_weights(demo_path):
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        # abs-max, not assert_close/allclose: those take ~15 s over 135M parameters on 2 cores.
        assert (tensor - expected[name].float()).abs().max().item() <= 1e-6, name
        seen.add(name)
    # The demo ties lm_head to the embedding, so the file (and our output) holds no lm_head.weight.
    assert seen == set(expected) - {"lm_head.weight"}
    assert "model.layers.29.self_attn.q_proj.weight" in seen


def test_demo_config_matches_transformers(demo_config, hf_reference):
    expected, _ = hf_reference  # transformers' GGUF config fields, before building a config class
    config = demo_config
    assert isinstance(config, LlamaConfig)
    assert config.architectures == ["LlamaForCausalLM"]
    assert expected["model_type"] == config.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(config, key) == expected[key], key
    assert config.head_dim == expected["hidden_size"] // expected["num_attention_heads"] == 64
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": expected["rope_theta"]}
    assert expected["rope_theta"] == 100000.0
    assert config.tie_word_embeddings is True and config.attention_bias is False
    assert config.dtype == torch.float16


# transformers 5.24's `AutoTokenizer.from_pretrained(dir, gguf_file=...)` encoding of PROMPT on the
# demo file (hard-coded: building that tokenizer a second time costs ~7 s of GGUF parsing).
PROMPT_IDS = [1780, 314, 260, 3575, 282, 4649, 47]


def test_demo_tokenizer_matches_transformers(demo_path):
    tokenizer = load_gguf_tokenizer(demo_path)
    assert tokenizer(PROMPT).input_ids == PROMPT_IDS
    assert tokenizer.decode(PROMPT_IDS) == PROMPT
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    assert f"<|im_start|>user\n{PROMPT}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_is_gguf(demo_path, tmp_path):
    assert is_gguf(demo_path)
    (tmp_path / "fake.gguf").write_bytes(b"nope")
    assert not is_gguf(tmp_path / "fake.gguf")
    assert not is_gguf(tmp_path / "missing.gguf")
    assert not is_gguf(tmp_path)
    with pytest.raises(UnsupportedGGUFError, match="not a GGUF file"):
        load_gguf_config(str(tmp_path / "fake.gguf"))


# ---------------------------------------------------------------------------------------------------
# (b) every supported quantization type
# ---------------------------------------------------------------------------------------------------

# gguf-py can quantize these; the K-quants it can only dequantize (see _random_k_blocks).
QUANTIZABLE = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05, Q.Q5_0: 0.3, Q.Q5_1: 0.3,
               Q.Q4_0: 0.6, Q.Q4_1: 0.6}
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of the float16 super-block scales (d, dmin) in each 256-value K-quant block (ggml-common.h).
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose float16 scales are small and finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(1e-3, 1e-1, size=data.shape[:2]).astype(np.float16)
        data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(rows, -1)


def _write_minimal(path, tensors: list[tuple[str, np.ndarray, Q]], arch: str = "qwen2",
                   feed_forward: bool = True) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(512)
    if feed_forward:
        writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_context_length(128)
    for name, data, qtype in tensors:
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", list(QUANTIZABLE) + K_QUANTS, ids=lambda t: t.name)
def test_quant_types_dequantize(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 3, 512  # non-square, so a transposed read cannot pass
    original = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype in K_QUANTS:
        data = _random_k_blocks(qtype, rows, cols, rng)
    else:
        data = quants.quantize(original, qtype)
    _write_minimal(tmp_path / "q.gguf", [("blk.0.ffn_up.weight", data, qtype),
                                         ("blk.0.attn_norm.weight", original[0], Q.F32)])
    weights = dict(iter_gguf_weights(str(tmp_path / "q.gguf")))
    up = weights["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == torch.float32 and up.shape == (rows, cols)
    np.testing.assert_array_equal(up.numpy(), quants.dequantize(data, qtype).reshape(rows, cols))
    assert torch.isfinite(up).all()
    if qtype in QUANTIZABLE:
        np.testing.assert_allclose(up.numpy(), original, atol=QUANTIZABLE[qtype], rtol=0)
    np.testing.assert_array_equal(weights["model.layers.0.input_layernorm.weight"].numpy(), original[0])


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    data = np.zeros((2, 256 // block_size * type_size), dtype=np.uint8)
    _write_minimal(tmp_path / "iq.gguf", [("blk.0.ffn_up.weight", data, Q.IQ4_NL)])
    with pytest.raises(UnsupportedGGUFError, match=r"'blk\.0\.ffn_up\.weight' has type IQ4_NL"):
        list(iter_gguf_weights(str(tmp_path / "iq.gguf")))


def test_unknown_tensor_name_and_architecture(tmp_path):
    _write_minimal(tmp_path / "x.gguf", [("blk.0.mystery.weight", np.ones(4, np.float32), Q.F32)])
    with pytest.raises(UnsupportedGGUFError, match="mystery"):
        list(iter_gguf_weights(str(tmp_path / "x.gguf")))
    _write_minimal(tmp_path / "g.gguf", [], arch="gemma")
    with pytest.raises(UnsupportedGGUFError, match="'gemma' is not supported"):
        load_gguf_config(str(tmp_path / "g.gguf"))


def test_a_gguf_without_a_tokenizer_says_what_to_pass(tmp_path):
    _write_minimal(tmp_path / "t.gguf", [])
    with pytest.raises(UnsupportedGGUFError, match="holds no tokenizer .* pass the original model's tokenizer with "
                                                   "--tokenizer"):
        load_gguf_tokenizer(str(tmp_path / "t.gguf"))


def test_missing_shape_metadata_is_named(tmp_path):
    """A GGUF without a shape key the model needs: an error naming the key (it was a bare TypeError about None)."""
    _write_minimal(tmp_path / "m.gguf", [], feed_forward=False)
    with pytest.raises(UnsupportedGGUFError, match="no 'qwen2.feed_forward_length'"):
        load_gguf_config(str(tmp_path / "m.gguf"))


# ---------------------------------------------------------------------------------------------------
# (c) round trip of tiny random HF models through a GGUF written the way llama.cpp's converter does
# ---------------------------------------------------------------------------------------------------

_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_CONFIGS = {
    "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
}


def _llama_cpp_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_HF_TO_GGUF['.'.join(module)]}.{kind}"


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # Verbatim from llama.cpp convert_hf_to_gguf.py LlamaModel.permute.
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tiny_model(arch: str, tie: bool):
    config = _CONFIGS[arch](vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tie,
                            head_dim=32 if arch == "qwen3" else 16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases start at constants; make every tensor distinctive
        for p in model.parameters():
            p.normal_()
    return model


def _write_like_llama_cpp(model, arch: str, path, rope_freqs: np.ndarray | None = None) -> None:
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        data = tensor.numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        writer.add_tensor(_llama_cpp_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_round_trip_tiny_model(tmp_path, arch, tie):
    model = _tiny_model(arch, tie)
    path = tmp_path / f"{arch}.gguf"
    _write_like_llama_cpp(model, arch, path)

    weights = dict(iter_gguf_weights(str(path)))
    expected = model.state_dict()
    if tie:
        expected.pop("lm_head.weight")
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, atol=0, rtol=0, msg=name)

    config = load_gguf_config(str(path))
    assert type(config) is type(model.config)
    assert config.architectures == [type(model).__name__]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert config.dtype == torch.float32


def _llama3_freq_divisors(theta: float, dim: int, factor: float) -> np.ndarray:
    # Verbatim logic of llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors.
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def test_llama3_rope_freqs_become_hf_rope_parameters(tmp_path):
    model = _tiny_model("llama", tie=True)
    model.config.max_position_embeddings = 131072
    divisors = _llama3_freq_divisors(50000.0, model.config.head_dim, factor=32.0)
    _write_like_llama_cpp(model, "llama", tmp_path / "l3.gguf", rope_freqs=divisors)

    config = load_gguf_config(str(tmp_path / "l3.gguf"))
    assert config.rope_parameters == {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    # HF's llama3 inverse frequencies must equal llama.cpp's base frequencies / divisors.
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (50000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    torch.testing.assert_close(inv_freq.float(), base / torch.from_numpy(divisors), rtol=1e-5, atol=0)
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(str(tmp_path / "l3.gguf")))

    _write_like_llama_cpp(model, "llama", tmp_path / "odd.gguf", rope_freqs=divisors[::-1].copy())
    with pytest.raises(UnsupportedGGUFError, match="rope_freqs"):
        load_gguf_config(str(tmp_path / "odd.gguf"))


# ---------------------------------------------------------------------------------------------------
# tokenizer from a synthesized GGUF (byte-level BPE, as llama.cpp writes for gpt2-style vocabularies)
# ---------------------------------------------------------------------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _write_tokenizer_gguf(path) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["hi", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tokenizer_from_synthesized_gguf(tmp_path, monkeypatch):
    _write_tokenizer_gguf(tmp_path / "tok.gguf")
    tokenizer = load_gguf_tokenizer(str(tmp_path / "tok.gguf"))
    assert tokenizer("hi").input_ids == [256]  # the merge "h i" -> token 256
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.chat_template == CHAT_TEMPLATE

    # A transformers version that drops the template: it is read from the metadata instead.
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained.__func__

    def without_template(cls, *args, **kwargs):
        tok = original(cls, *args, **kwargs)
        tok.chat_template = None
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(without_template))
    tokenizer = load_gguf_tokenizer(str(tmp_path / "tok.gguf"))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>hi<|im_end|>"


# ---------------------------------------------------------------------------------------------------
# (e) the tokenizer cached on disk, the header read in one pass
# ---------------------------------------------------------------------------------------------------

def _encodings(tokenizer) -> list:
    texts = ["hi", "hi <|im_start|>hi<|im_end|>", " h i\n\t", ""]
    return [tokenizer(t).input_ids for t in texts] + [tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                      len(tokenizer), tokenizer.chat_template]


def test_tokenizer_is_built_once_and_read_back_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKENIZER_CACHE_ENV_VAR, str(tmp_path / "cache"))
    path = str(tmp_path / "tok.gguf")
    _write_tokenizer_gguf(path)
    built = load_gguf_tokenizer(path)
    cached_dir = tokenizer_cache_dir(path)
    assert cached_dir.startswith(str(tmp_path / "cache")) and (tmp_path / "cache").exists()

    from transformers import AutoTokenizer
    original, sources = AutoTokenizer.from_pretrained.__func__, []

    def recording(cls, source, *args, **kwargs):
        sources.append((source, kwargs.get("gguf_file")))
        return original(cls, source, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(recording))
    again = load_gguf_tokenizer(path)
    assert sources == [(cached_dir, None)]  # not converted from the GGUF a second time
    assert _encodings(again) == _encodings(built)
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>hi<|im_end|>"
    # A rewritten file is another key; with the cache off (0) every load converts and nothing is written.
    _write_tokenizer_gguf(path)
    assert tokenizer_cache_dir(path) != cached_dir
    monkeypatch.setenv(TOKENIZER_CACHE_ENV_VAR, "0")
    sources.clear()
    assert tokenizer_cache_dir(path) is None and _encodings(load_gguf_tokenizer(path)) == _encodings(built)
    assert sources == [(str(tmp_path), "tok.gguf")]


def test_a_damaged_cached_tokenizer_is_converted_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(TOKENIZER_CACHE_ENV_VAR, str(tmp_path / "cache"))
    path = str(tmp_path / "tok.gguf")
    _write_tokenizer_gguf(path)
    built = load_gguf_tokenizer(path)
    with open(os.path.join(tokenizer_cache_dir(path), "tokenizer.json"), "w") as f:
        f.write("{not json")
    with caplog.at_level(logging.WARNING):
        again = load_gguf_tokenizer(path)
    assert "unreadable" in caplog.text and _encodings(again) == _encodings(built)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the entry was saved anew
        assert _encodings(load_gguf_tokenizer(path)) == _encodings(built) and "unreadable" not in caplog.text


def test_demo_tokenizer_read_back_from_the_cache_encodes_the_same(demo_path, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKENIZER_CACHE_ENV_VAR, str(tmp_path))
    built = load_gguf_tokenizer(demo_path)
    cached = load_gguf_tokenizer(demo_path)
    texts = [PROMPT, "Ünïcödé — 日本語 🙂  spaces\n\nand tabs\t", "<|im_start|>user\nhi<|im_end|>"]
    assert [cached(t).input_ids for t in texts] == [built(t).input_ids for t in texts]
    assert cached(PROMPT).input_ids == PROMPT_IDS
    assert (cached.bos_token_id, cached.eos_token_id, len(cached)) == (built.bos_token_id, built.eos_token_id,
                                                                      len(built))
    messages = [{"role": "user", "content": PROMPT}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        built.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_header_reader_gives_what_gguf_reader_gives(tmp_path):
    """gguf_file.GGUFFile against gguf's own reader: every metadata value and every tensor's type, shape and bytes."""
    path = tmp_path / "all.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("test.text", "héllo\nwörld")
    writer.add_array("test.strings", ["a", "", "日本", "<|im_end|>"])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_bool("test.flag", True)
    writer.add_float32("test.f32", 0.125)
    writer.add_uint64("test.u64", 2**40)
    writer.add_int32("test.i32", -7)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    for qtype in (Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.BF16):
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (4, 256 // block_size * type_size), dtype=np.uint8)
        writer.add_tensor(qtype.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected and ours.get("test.strings") == ["a", "", "日本", "<|im_end|>"]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_truncated_or_unknown_version_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    _write_minimal(path, [("token_embd.weight", np.ones((4, 32), np.float32), Q.F32)])
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 64])
    with pytest.raises(UnsupportedGGUFError, match="token_embd.weight.*runs past the end"):
        load_gguf_config(str(tmp_path / "cut.gguf"))
    (tmp_path / "header.gguf").write_bytes(data[:40])
    with pytest.raises(UnsupportedGGUFError, match="unreadable GGUF header|runs past the end"):
        load_gguf_config(str(tmp_path / "header.gguf"))
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(UnsupportedGGUFError, match="GGUF version 9"):
        load_gguf_config(str(tmp_path / "v9.gguf"))
