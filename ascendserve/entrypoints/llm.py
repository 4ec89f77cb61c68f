"""The offline API: `LLM(model, **engine_args).generate(...)` / `.chat(...)`, as in vLLM."""

from collections.abc import Sequence

from tqdm import tqdm

from ascendserve.config import EngineArgs
from ascendserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from ascendserve.engine.llm_engine import LLMEngine
from ascendserve.engine.outputs import RequestOutput
from ascendserve.engine.sampling_params import RequestOutputKind, SamplingParams


def _pooling_only(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.{name} is only supported for pooling models (embedding, classification, "
                                  f"reward), which this engine does not run; use generate / chat / beam_search")
    method.__name__ = name
    return method


class LLM:
    """Generate from prompts with a continuously batched engine; takes vLLM's engine arguments."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model, **engine_args))

    def get_tokenizer(self):
        """The tokenizer the engine uses."""
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (vLLM's); False, and nothing dropped, while requests hold blocks."""
        return self.llm_engine.kv_cache_manager.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use without sampling_params: the checkpoint's generation_config.json defaults
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM; plain SamplingParams()
        without them or with generation_config="vllm"."""
        return SamplingParams(**(self.llm_engine.default_sampling_params or {}))

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. vLLM's lora_request and priority are
        accepted when they ask for nothing (None; priorities all 0): this engine has neither."""
        _no_lora(lora_request)
        if priority is not None and any(priority):
            raise ValueError("priority: requests run first come, first served here (no priority scheduling); "
                             "pass None or zeros")
        prompts = _as_list(prompts)
        params = _params_per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts))
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                if p.output_kind == RequestOutputKind.DELTA:  # only each request's last output is kept: make it whole
                    p = p.clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(engine.next_request_id())
                engine.add_request(ids[-1], prompt, p)
        except BaseException:  # a KeyboardInterrupt too: nothing of this call stays queued
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None, lora_request=None,
             chat_template_content_format: str = "auto", mm_processor_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """Render one conversation (list of messages) or many with the chat template, then generate.
        chat_template_kwargs override the named template arguments, as vLLM's; text content parts are joined
        (chat_template_content_format has no other effect)."""
        from ascendserve.entrypoints.openai.chat_utils import render_chat
        from ascendserve.entrypoints.openai.errors import OpenAIError

        _no_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: multimodal input is not implemented (the vision tower is not yet)")
        kwargs = dict(chat_template_kwargs or {})
        chat_template = kwargs.pop("chat_template", chat_template)
        tools = kwargs.pop("tools", tools)
        documents = kwargs.pop("documents", None)
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        if continue_final_message and add_generation_prompt:  # transformers' and the server's error, before any work
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: pass "
                             "add_generation_prompt=False to continue the last assistant message")
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of message dicts (or a list of such lists), got "
                            f"{type(messages).__name__}")
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this LLM was built with skip_tokenizer_init=True; "
                             "use generate with token ids")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            try:  # the server's rendering: content parts joined, null content "", arguments parsed
                text = render_chat(tokenizer, conversation, chat_template=chat_template, tools=tools,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, documents=documents,
                                   chat_template_kwargs=kwargs)
            except OpenAIError as e:
                raise ValueError(e.message) from None
            prompts.append({"prompt": text, "add_special_tokens": False})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: the best `params.beam_width` beams of each prompt (a str, {"prompt": ...} or
        {"prompt_token_ids": [...]}), best first; each beam's tokens and text hold its prompt too, as vLLM's."""
        _no_lora(lora_request)
        engine = self.llm_engine
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        max_logprobs = engine.config.args.max_logprobs
        if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
            raise ValueError(f"beam_width {params.beam_width} ranks 2 x {params.beam_width} = {2 * params.beam_width} "
                             f"logprobs a step, but max_logprobs is {max_logprobs}; raise max_logprobs (or -1)")
        token_prompts = []
        for prompt in _as_list(prompts):
            token_prompts.append(engine.tokenize_prompt(prompt)[1])
            engine.validate_prompt(token_prompts[-1])

        def generate(batch: list[list[int]], step_params: SamplingParams) -> list[RequestOutput]:
            return self.generate([{"prompt_token_ids": ids} for ids in batch], step_params, use_tqdm=False)

        results = beam_search(generate, token_prompts, params, engine.eos_token_ids, engine.config.max_model_len)
        tokenizer = self.get_tokenizer()
        for beams in results:
            for beam in beams:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        return [BeamSearchOutput(beams) for beams in results]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
            except BaseException:
                engine.abort_request([i for i in ids if i not in finished])
                raise
        return [finished[i] for i in ids]


    # vLLM's pooling API (embedding, classification, reward models): not run here, each a NotImplementedError
    encode, embed, classify, score, reward = (_pooling_only(name) for name in
                                              ("encode", "embed", "classify", "score", "reward"))


def _no_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not implemented in this engine")


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts is None or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a str, a prompt dict or a list of them, got {type(prompts).__name__}")
    return list(prompts)


def _params_per_prompt(params, num: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num
    if isinstance(params, SamplingParams):
        return [params] * num
    if isinstance(params, dict) or not hasattr(params, "__iter__"):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
    params = list(params)
    if len(params) != num:
        raise ValueError(f"sampling_params has {len(params)} entries for {num} prompts; give one or one per prompt")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be a SamplingParams or a list of them; the list holds "
                        f"{sorted({type(p).__name__ for p in params})}")
    return params
