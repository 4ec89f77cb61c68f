"""A tiny random Llama checkpoint and its transformers references, shared by tests/cuda and tests/worker."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.models.reference import hf_greedy, make_prompts, randomize_

VOCAB = 512
LLAMA_NEW = 12  # long enough that the preemption test's requests outgrow their 78 blocks


def build_llama(path) -> tuple[str, list[list[int]], list]:
    """A tiny random Llama saved at `path`, its prompts (three with a shared prefix) and transformers' references."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    model.save_pretrained(path)
    prompts = make_prompts(VOCAB, [1, 7, 16, 17, 64, 100, 255, 300], seed=2)
    prompts += make_prompts(VOCAB, [40, 90, 130], seed=3, shared_prefix=35)
    return str(path), prompts, [hf_greedy(model, p, LLAMA_NEW) for p in prompts]
