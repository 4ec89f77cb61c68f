"""Helpers shared by the parity tests: tiny random HF checkpoints and transformers' greedy reference."""

import math
from dataclasses import dataclass

import torch


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Fill EVERY parameter (norm weights, biases included) with random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=gen) * std
            if name.endswith("norm.weight") and "layernorm" in name or name.endswith(".norm.weight"):
                values = 1.0 + values  # plain RMSNorm weights around 1, still all different
            param.copy_(values.to(param.dtype))


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths; the first `shared_prefix` tokens equal in all."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab_size, (shared_prefix,), generator=gen).tolist()
    prompts = []
    for n in lengths:
        rest = torch.randint(0, vocab_size, (max(n - len(prefix), 0),), generator=gen).tolist()
        prompts.append((prefix + rest)[:n])
    return prompts


@dataclass
class Reference:
    """Greedy continuation and per-step log-softmax from transformers."""

    tokens: list[int]
    logprobs: list[float]  # of each generated token
    top2_gap: list[float]  # logit gap between the best two at each step


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> Reference:
    """transformers' own forward pass, one prompt at a time (no padding), greedy."""
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never mask EOS
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs, gaps = [], []
    for step, logits in enumerate(out.logits):
        row = logits[0].float()
        logprobs.append(torch.log_softmax(row, -1)[tokens[step]].item())
        top = torch.topk(row, 2).values
        gaps.append((top[0] - top[1]).item())
    return Reference(tokens, logprobs, gaps)


def assert_matches(ref: Reference, token_ids: list[int], logprobs, tol: float = 1e-3) -> None:
    """Token-for-token equality (a divergence only at a true tie) and logprobs within `tol`."""
    assert len(token_ids) == len(ref.tokens), (len(token_ids), len(ref.tokens))
    for i, (ours, theirs) in enumerate(zip(token_ids, ref.tokens)):
        if ours != theirs:
            assert ref.top2_gap[i] < tol, f"step {i}: got {ours}, reference {theirs} (gap {ref.top2_gap[i]})"
            return  # after a true tie the continuations legitimately differ
        if logprobs is not None:
            got = logprobs[i][ours].logprob
            assert math.isclose(got, ref.logprobs[i], abs_tol=tol), (i, got, ref.logprobs[i])


def check_outputs(outputs, refs) -> None:
    """Every request ran to its length limit and matches its transformers reference."""
    for out, ref in zip(outputs, refs):
        completion = out.outputs[0]
        assert completion.finish_reason == "length"
        assert_matches(ref, completion.token_ids, completion.logprobs)


# Requests arriving between steps while others decode: step -> the prompts added before it. Later requests reuse the
# state slots and blocks earlier ones freed when the engine has few.
ARRIVALS = {0: [3, 0], 2: [5], 4: [1, 4], 9: [2]}


def generate_with_arrivals(engine, prompts: list[list[int]], params, arrivals: dict = ARRIVALS) -> list:
    """Step `engine` (an LLMEngine) until every prompt added per `arrivals` finished; their outputs in prompt order."""
    outputs, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]
