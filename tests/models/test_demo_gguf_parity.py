"""The embedded demo model (SmolLM2-135M Q4_1 GGUF) against transformers loading the same file."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from ascendserve import LLM, SamplingParams
from ascendserve.loader.demo import get_demo_model_path

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers:", "def fibonacci(n):"]
MAX_NEW = 32


@pytest.fixture(scope="module")
def demo_path():
    return get_demo_model_path()


def test_demo_greedy_matches_transformers(demo_path):
    llm = LLM(None, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    # The Q4_1 layers run from their 4-bit grid (the kernel in decode, the dequantized weight in prefill).
    model = llm.llm_engine.runner.model
    kinds = {type(m).__name__ for name, m in model.named_modules()
             if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
    assert kinds == {"Q4Linear"}

    directory, name = os.path.split(demo_path)
    ref_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    ref_model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never mask EOS
    for ids, out in zip(prompt_ids, ours):
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert "Paris" in ours[0].outputs[0].text


def test_demo_with_int8_activations_stays_close_to_the_fp32_engine(demo_path):
    """--activation-quantization int8 (not bit-exact): teacher-forced on the fp32 engine's greedy tokens,
    the same next token at nearly every position and that token's logprob within a small drift (measured:
    122 of 128 the same, mean drift 0.049, max 0.40)."""
    fp32 = LLM(None, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    tokenizer = fp32.get_tokenizer()
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    reference = fp32.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                              SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True),
                              use_tqdm=False)
    del fp32
    a8 = LLM(None, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512,
             activation_quantization="int8")
    model = a8.llm_engine.runner.model
    layers = [m for name, m in model.named_modules()
              if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert layers and all(type(m).__name__ == "Q4Linear" and m.int8_activations for m in layers)
    requests, targets = [], []
    for ids, out in zip(prompt_ids, reference):
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        for i in range(MAX_NEW):
            requests.append({"prompt_token_ids": ids + tokens[:i]})
            targets.append((tokens[i], logprobs[i][tokens[i]].logprob))
    outs = a8.generate(requests, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    same = sum(o.outputs[0].token_ids[0] == t for o, (t, _) in zip(outs, targets))
    drift = [abs(o.outputs[0].logprobs[0][t].logprob - lp) for o, (t, lp) in zip(outs, targets)
             if t in o.outputs[0].logprobs[0]]
    print(f"int8 activations on the demo: same next token {same}/{len(targets)}, "
          f"logprob drift mean {sum(drift) / len(drift):.4f}, max {max(drift):.4f}")
    assert same >= 0.9 * len(targets) and len(drift) == len(targets)
    assert sum(drift) / len(drift) < 0.1
