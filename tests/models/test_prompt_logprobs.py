"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) against transformers' logits over the prompt, for Llama and
Qwen3.5, through whole-prompt batches, chunked prefill, async scheduling, the prefix cache and preemption."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ascendserve import LLM, SamplingParams
from ascendserve.engine.sampling_params import RequestOutputKind
from tests.models import qwen3_5_tiny
from tests.models.llama_tiny import LLAMA_NEW, build_llama
from tests.models.reference import check_outputs, make_prompts

TOP = 3


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model(request, tmp_path_factory):
    """(name, checkpoint path, prompts, greedy references, transformers' log-softmax rows of each prompt)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        path, prompts, refs = build_llama(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        max_new = LLAMA_NEW
    else:
        hf = qwen3_5_tiny.build("dense")
        hf.save_pretrained(path)
        prompts = make_prompts(qwen3_5_tiny.VOCAB, qwen3_5_tiny.LENGTHS, seed=2)
        refs = [qwen3_5_tiny.hf_greedy(hf, p, qwen3_5_tiny.MAX_NEW) for p in prompts]
        max_new = qwen3_5_tiny.MAX_NEW
    with torch.no_grad():
        rows = [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]
    return request.param, str(path), prompts, refs, rows, max_new


def _params(max_new: int, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": max_new, "logprobs": 0, "ignore_eos": True,
                             "prompt_logprobs": TOP, **overrides})


def _check(prompt_logprobs, prompt: list[int], rows: torch.Tensor, top: int = TOP, tol: float = 1e-3) -> None:
    """vLLM's layout: entry 0 None; entry i holds prompt token i (its logprob given tokens 0..i-1, and its rank) and
    the `top` best tokens there (ranks 1..top), each logprob transformers' to `tol`."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[i], rows[i - 1], prompt[i]
        assert token in entry and len(entry) in (top, top + 1), (i, len(entry))
        ours = entry[token]
        assert math.isclose(ours.logprob, row[token].item(), abs_tol=tol), (i, ours, row[token])
        assert int((row > row[token] + tol).sum()) < ours.rank <= int((row >= row[token] - tol).sum()), (i, ours)
        best = row.topk(top).values.tolist()
        others = {t: lp for t, lp in entry.items() if t != token}
        assert sorted(lp.rank for lp in others.values()) == sorted(set(range(1, top + 1)) - {ours.rank}) or \
            sorted(lp.rank for lp in others.values()) == list(range(1, top + 1))[:len(others)]
        for t, lp in others.items():
            assert math.isclose(lp.logprob, row[t].item(), abs_tol=tol), (i, t, lp)
            assert math.isclose(lp.logprob, best[lp.rank - 1], abs_tol=tol), (i, t, lp, best)


def _llm(path, **engine_args) -> LLM:
    return LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=256, **engine_args)


def _run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("budget,async_scheduling", [(2048, False), (48, False), (48, True)])
def test_prompt_logprobs_match_transformers(model, budget, async_scheduling):
    """Every prompt position's logprobs in a batch of mixed lengths (1 token: just [None]), whole or in chunks of 48
    (chunks end inside prompts and between requests); the generated tokens are still transformers' greedy ones, and a
    request without prompt_logprobs in the same batch gets none."""
    _, path, prompts, refs, rows, max_new = model
    llm = _llm(path, max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    params = [_params(max_new, prompt_logprobs=None if i == 2 else TOP) for i in range(len(prompts))]
    outputs = _run(llm, prompts, params)
    check_outputs(outputs, refs)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        if i == 2:
            assert out.prompt_logprobs is None
        else:
            _check(out.prompt_logprobs, prompt, rows[i])


def test_prompt_logprobs_skip_the_prefix_cache(model):
    """A prompt whose blocks are all cached is computed again when prompt logprobs are asked for (the cached
    positions have no logits); a request without them still takes the hit."""
    name, path, prompts, refs, rows, max_new = model
    if name != "llama":
        pytest.skip("the hybrid model has no prefix caching")
    llm = _llm(path, enable_prefix_caching=True)
    _run(llm, prompts, _params(max_new, prompt_logprobs=None))
    again = _run(llm, prompts, _params(max_new))
    check_outputs(again, refs)
    assert all(out.num_cached_tokens == 0 for out in again)
    for out, prompt, row in zip(again, prompts, rows):
        _check(out.prompt_logprobs, prompt, row)
    assert max(out.num_cached_tokens for out in _run(llm, prompts, _params(max_new, prompt_logprobs=None))) >= 288


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_through_preemption(model, async_scheduling):
    """Requests preempted in their prefill or decode and recomputed keep one whole, correct set of prompt logprobs."""
    name, path, prompts, refs, rows, max_new = model
    lengths = [len(p) for p in prompts]
    order = [lengths.index(n) for n in (300, 7, 1, 255 if name == "llama" else 130, 64)]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=78, block_size=4,
              max_model_len=312, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    outputs = _run(llm, [prompts[i] for i in order], _params(max_new))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check_outputs(outputs, [refs[i] for i in order])
    for out, i in zip(outputs, order):
        _check(out.prompt_logprobs, prompts[i], rows[i])


def test_prompt_logprobs_once_per_request(model):
    """n=2 sampled children share one set of prompt logprobs; a DELTA stream carries it in one output only; -1 gives
    the whole vocabulary; 0 only the prompt token itself."""
    _, path, prompts, _, rows, max_new = model
    llm = _llm(path, max_logprobs=-1)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompts[4]},
                       _params(max_new, temperature=1.0, n=2, seed=7, output_kind=RequestOutputKind.DELTA))
    carried = []
    while engine.has_unfinished_requests():
        carried += [out.prompt_logprobs for out in engine.step() if out.prompt_logprobs is not None]
    assert len(carried) == 1
    _check(carried[0], prompts[4], rows[4])
    whole, none = _run(llm, [prompts[3]] * 2, [_params(max_new, prompt_logprobs=-1), _params(max_new, prompt_logprobs=0)])
    vocab = rows[3].shape[1]
    assert all(len(entry) == vocab for entry in whole.prompt_logprobs[1:])
    _check(whole.prompt_logprobs, prompts[3], rows[3], top=vocab)
    assert [list(entry) for entry in none.prompt_logprobs[1:]] == [[t] for t in prompts[3][1:]]
    _check(none.prompt_logprobs, prompts[3], rows[3], top=0)


def test_prompt_logprobs_limits(model):
    _, path, prompts, _, _, max_new = model
    llm = _llm(path, max_logprobs=5)
    with pytest.raises(ValueError, match=r"prompt_logprobs: requested 6 logprobs per token, but at most 5"):
        _run(llm, prompts[:1], _params(max_new, prompt_logprobs=6))
    with pytest.raises(ValueError, match=r"prompt_logprobs must be non-negative or -1"):
        _params(max_new, prompt_logprobs=-2)
    assert not llm.llm_engine.has_unfinished_requests()
