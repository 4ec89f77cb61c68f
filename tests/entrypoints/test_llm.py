"""The offline LLM API on the real demo model: shapes, argument errors, stops, seeds, n, logprobs, chat."""

import math
import os

import pytest

from ascendserve import LLM, SamplingParams
from ascendserve.engine.llm_engine import PromptTooLongError

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=128 << 20, max_model_len=1024, max_num_batched_tokens=512)


def pool_is_idle(llm):
    free, cached, in_use = llm.llm_engine.kv_cache_manager.pool.counts()
    return in_use == 0 and free + cached == llm.llm_engine.kv_cache_manager.num_blocks


def test_unknown_engine_argument_lists_valid_ones():
    with pytest.raises(TypeError, match="max_num_seqs"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize("kwargs, field", [({"dtype": "int8"}, "dtype"), ({"max_num_seqs": 0}, "max_num_seqs"),
                                           ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                                           ({"block_size": -1}, "block_size"),
                                           ({"max_logprobs": -2}, "max_logprobs"),
                                           ({"max_num_seqs": 8, "max_num_batched_tokens": 4},
                                            r"max_num_batched_tokens \(4\) must be at least max_num_seqs \(8\)")])
def test_bad_engine_argument_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(**kwargs)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": tok.encode(text)}, "1, 2, 3,"],
                        GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].prompt == text and outs[0].prompt_token_ids == tok.encode(text)
    assert outs[0].finished and outs[0].outputs[0].finish_reason in ("stop", "length")
    single = llm.generate(text, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].text == outs[0].outputs[0].text
    assert pool_is_idle(llm)


def test_params_per_prompt(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=3, ignore_eos=True),
                                     SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_bad_prompts_raise_clear_errors(llm):
    with pytest.raises(PromptTooLongError, match="max_model_len is 1024"):
        llm.generate({"prompt_token_ids": [1] * 1024}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 49152\)"):
        llm.generate({"prompt_token_ids": [10**6]}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and pool_is_idle(llm)


def test_bad_arguments_name_what_is_wrong_and_leave_nothing_queued(llm):
    from ascendserve.engine.sampling_params import RequestOutputKind

    cases = [(lambda: llm.generate({"text": "hi"}), TypeError, "needs 'prompt'"),
             (lambda: llm.generate("Hi", {"max_tokens": 3}), TypeError, "sampling_params must be a SamplingParams"),
             (lambda: llm.generate(["Hi"], [{"max_tokens": 3}]), TypeError, "the list holds"),
             (lambda: llm.generate({"prompt_token_ids": [1.5, 2]}), ValueError, "integer token ids"),
             (lambda: llm.generate({"prompt_token_ids": "abc"}), ValueError, "integer token ids"),
             (lambda: llm.generate(None), TypeError, "prompts must be"),
             (lambda: llm.chat("hello"), TypeError, "messages must be a list"),
             (lambda: SamplingParams(structured_outputs="json"), TypeError, "structured_outputs must be")]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert pool_is_idle(llm) and not llm.llm_engine.has_unfinished_requests()
    # DELTA outputs would leave only each request's last step: the offline API returns whole outputs, as vLLM
    whole = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    delta = SamplingParams(temperature=0, max_tokens=24, output_kind=RequestOutputKind.DELTA)
    assert llm.generate("The capital of France is", delta, use_tqdm=False)[0].outputs[0].token_ids == whole.token_ids
    assert delta.output_kind == RequestOutputKind.DELTA  # the caller's params untouched


def test_interrupt_while_adding_leaves_nothing_queued(llm, monkeypatch):
    engine, added = llm.llm_engine, []
    add = engine.add_request

    def add_then_interrupt(request_id, prompt, params):
        if len(added) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the third prompt is added
        added.append(request_id)
        add(request_id, prompt, params)

    monkeypatch.setattr(engine, "add_request", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two", "three"], GREEDY, use_tqdm=False)
    assert len(added) == 2 and not engine.has_unfinished_requests() and pool_is_idle(llm)


def test_stop_strings_cut_text(llm):
    base = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    # a stop string made of the middle of the greedy text, spanning whatever token boundaries it has
    stop = base.text[5:9]
    assert stop.strip(), base.text
    cut = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == base.text[:base.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                                   include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    assert pool_is_idle(llm)


def test_stop_string_completed_by_the_last_allowed_token(llm):
    """A stop string that the max_tokens-th token completes ends the request as "stop" with that string (vLLM's);
    it used to be reported as "length" with no stop_reason, though the text was cut."""
    prompt = "Count: one, two, three,"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    shorter = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    stop = base.text[len(shorter.text) - 1:].strip()  # ends in the 4th token's text and starts before it
    assert stop and base.text.endswith(stop) and not shorter.text.endswith(stop), (base.text, shorter.text)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == base.text[:base.text.rindex(stop)] and len(out.token_ids) == 4


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_reset_prefix_cache(llm):
    prompt = {"prompt": "A long enough prompt to fill a block or two of sixteen tokens each, " * 3}
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens >= 32
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_bad_words_are_never_generated(llm):
    """vLLM's bad_words: a one-token word is never sampled, a longer one never completed (its first tokens may
    appear alone); greedy output changes where it used to hold them, and the caller's params are left as given."""
    prompt = "The capital of France is Paris. The capital of Germany is"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()

    def words_of(tokens: list[int]) -> list[list[int]]:
        params = SamplingParams(bad_words=[tokenizer.decode(tokens)])
        params.update_from_tokenizer(tokenizer)
        return params.bad_words_token_ids

    # words whose tokenization (alone or after a space: vLLM's two forms) is what the greedy output holds
    ids = base.token_ids
    pair = next(tokenizer.decode(ids[i:i + 2]) for i in range(len(ids) - 1)
                if tokenizer.decode(ids[i:i + 2]).strip() and ids[i:i + 2] in words_of(ids[i:i + 2]))
    single = next(tokenizer.decode([t]) for t in ids if tokenizer.decode([t]).strip() and [t] in words_of([t]))
    for bad in ([pair], [single], [pair, single]):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=bad)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert params.bad_words_token_ids is None  # computed on the engine's copy
        check = params.clone()
        check.update_from_tokenizer(tokenizer)
        assert check.bad_words_token_ids and out.token_ids != base.token_ids
        assert not any(_contains(out.token_ids, word) for word in check.bad_words_token_ids), (bad, out.text)
    assert pool_is_idle(llm)


def test_stop_token_ids(llm):
    base = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    target = base.token_ids[4]
    out = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=12,
                                                                  stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(target) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)


def test_seed_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(["Hello there", "Tell me a story", "Why is the sky blue?"], [others, params, others],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate("Tell me a story", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16,
                                                                 seed=99, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(llm):
    kv = llm.llm_engine.kv_cache_manager
    hits_before = kv.num_hits
    prompt = "Write one sentence about the ocean. " * 8  # several full blocks
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    n_prompt = len(out.prompt_token_ids)
    full_blocks = (n_prompt - 1) // 16
    assert kv.num_hits - hits_before >= 2 * full_blocks * 16  # samples 2 and 3 reuse sample 1's blocks
    assert pool_is_idle(llm)


def test_logprobs_shape(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token].rank == 1  # greedy: the sampled token is the best
        assert sorted(e.rank for e in entry.values())[:3] == [1, 2, 3]
        assert all(isinstance(e.decoded_token, str) for e in entry.values())
        total += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)
    # max_logprobs (vLLM's default 20) holds the offline API as the server's --max-logprobs holds a request
    for too_many in (21, -1):
        whole = r"-1 \(the whole vocabulary: 49152\)"
        with pytest.raises(ValueError, match=rf"logprobs: requested (21|{whole}) .* at most 20 .*max_logprobs"):
            llm.generate("x", SamplingParams(max_tokens=2, logprobs=too_many), use_tqdm=False)
    assert pool_is_idle(llm)


def test_detokenize_false_leaves_token_texts_out(llm):
    """vLLM's detokenize=False: no text, and the logprobs (sampled and prompt) carry no decoded tokens; they used to."""
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                                 prompt_logprobs=1, detokenize=False),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 3
    entries = [e for step in out.outputs[0].logprobs for e in step.values()]
    entries += [e for step in out.prompt_logprobs[1:] for e in step.values()]
    assert entries and all(e.decoded_token is None for e in entries)


def test_chat_uses_the_checkpoint_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    two = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is 2+2?"}]],
                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(two) == 2
    # OpenAI content parts, as the server reads them (a TypeError from the template before)
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
                     SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert parts[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat([{"role": "assistant", "content": "The"}], continue_final_message=True, use_tqdm=False)
    cont = llm.chat([{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour"}],
                    SamplingParams(temperature=0, max_tokens=4), continue_final_message=True,
                    add_generation_prompt=False, use_tqdm=False)
    assert cont[0].prompt.endswith("The colour")  # no end-of-turn, no new assistant header
    with pytest.raises(ValueError, match="vision tower is not implemented"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)


def test_vllm_engine_arguments_the_offline_api_takes(caplog, monkeypatch):
    """vLLM scripts' LLM(...) arguments: those with no use here warn once each (they were a TypeError), strings for
    booleans and numbers read as vLLM's config parsing reads them ("no" turned prefix caching on), a torch.dtype by
    its name, an int compilation_config as vLLM's level; hf_token sets HF_TOKEN."""
    import logging

    import torch

    from ascendserve.config import EngineArgs
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING):
        args = EngineArgs.from_kwargs("m", swap_space=4, cpu_offload_gb=0, enable_lora=False, scheduling_policy="fcfs",
                                      disable_log_stats=True, hf_token="hf_x", enable_prefix_caching="no",
                                      gpu_memory_utilization="0.5", max_num_seqs="8", dtype=torch.bfloat16,
                                      compilation_config=3)
    assert (args.enable_prefix_caching, args.gpu_memory_utilization, args.max_num_seqs, args.dtype) == \
        (False, 0.5, 8, "bfloat16")
    assert args.compilation_config == {"level": 3} and os.environ["HF_TOKEN"] == "hf_x"
    warned = [r.getMessage() for r in caplog.records]
    assert sum("swap_space=4 is accepted but has no effect" in m for m in warned) == 1
    assert not any(name in m for m in warned for name in ("cpu_offload_gb", "enable_lora", "scheduling_policy"))
    with pytest.raises(ValueError, match="enforce_eager must be bool, got 'maybe'"):
        EngineArgs.from_kwargs("m", enforce_eager="maybe")
    EngineArgs.from_kwargs("m", pipeline_parallel_size=1)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be 1 for now .* got 2"):  # was inert: a warning
        EngineArgs.from_kwargs("m", pipeline_parallel_size=2)


def test_calls_vllm_scripts_make(llm):
    """lora_request=None and zero priorities are accepted (a TypeError before), a real one refused; prompts with
    multi_modal_data are refused (they ran as text, the images dropped); the pooling API says it is not here."""
    prompt = "The capital of France is"
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=None, priority=[0])[0]
    assert out.lora_request is None and out.metrics is None and out.outputs[0].lora_request is None
    with pytest.raises(ValueError, match="lora_request: LoRA adapters are not implemented"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="priority: requests run first come, first served"):
        llm.generate(prompt, GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="multi_modal_data: images and video are not processed yet"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": "x"}}, GREEDY, use_tqdm=False)
    for name in ("encode", "embed", "classify", "score", "reward"):
        with pytest.raises(NotImplementedError, match=f"LLM.{name} is only supported for pooling models"):
            getattr(llm, name)(prompt)
    assert pool_is_idle(llm)


def test_sampling_params_fields_of_vllm(llm):
    """truncate_prompt_tokens keeps the prompt's last k tokens; skip_reading_prefix_cache computes a cached prompt
    again; guided_decoding is structured_outputs; logits_processors are refused; from_optional and
    update_from_generation_config as vLLM's (each a TypeError or AttributeError before)."""
    prompt = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " * 2
    ids = llm.get_tokenizer().encode(prompt)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.generate(prompt, SamplingParams(max_tokens=1, skip_reading_prefix_cache=True),
                        use_tqdm=False)[0].num_cached_tokens == 0
    guided = llm.generate("Yes or no?", SamplingParams(max_tokens=4, guided_decoding={"choice": ["yes", "no"]},
                                                       extra_args={"k": 1}, flat_logprobs=True), use_tqdm=False)[0]
    assert guided.outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="logits_processors: per-request logits processors are not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
        SamplingParams(truncate_prompt_tokens=0)
    assert SamplingParams.from_optional(temperature=None, top_p=0.5).temperature == 1.0
    params = SamplingParams(stop_token_ids=[9])
    params.update_from_generation_config({"eos_token_id": [1, 2]}, model_eos_token_id=1)
    assert params.stop_token_ids == [2, 9]


def test_chat_template_kwargs_override_the_named_arguments(llm):
    """vLLM's LLM.chat: chat_template_kwargs win over the named arguments (a TypeError from transformers before);
    without a tokenizer chat says so."""
    conversation = [{"role": "user", "content": "Hi"}]
    plain = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    bare = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert plain.prompt.startswith(bare.prompt) and len(plain.prompt) > len(bare.prompt)
    tokenless = LLM.__new__(LLM)
    tokenless.llm_engine = type("E", (), {"tokenizer": None})()
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        tokenless.chat(conversation)
