"""Structured outputs on the engine: every kind of constraint holds on the demo model, under sampling, n > 1,
batches that mix constrained and free rows, preemption and async scheduling."""

import json
import re

import pytest
import torch

from ascendserve import LLM, SamplingParams
from ascendserve.engine.structured_output import StructuredOutputsParams
from ascendserve.worker.sampler import unpack_bitmask, unpack_bitmask_on_device

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog", None]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
PHONE = r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"
GRAMMAR = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,5}/ | /[0-9]{1,3}/'
PROMPTS = ["Here is a person described in JSON:", "Call me at", "A list:", "Is the sky green?"]


def holds(kind: str, text: str) -> bool:
    """Whether `text` satisfies the constraint of `kind` (checked here without the grammar engine)."""
    if kind == "json":
        value = json.loads(text)
        return (set(value) == {"name", "age", "pet"} and isinstance(value["name"], str) and len(value["name"]) <= 12
                and isinstance(value["age"], int) and 0 <= value["age"] <= 120 and value["pet"] in ("cat", "dog", None))
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(PHONE, text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe")
    return re.fullmatch(r"\((?:[a-z]{1,5}|[0-9]{1,3})(?:,(?:[a-z]{1,5}|[0-9]{1,3}))*\)", text) is not None


CONSTRAINTS = {"json": StructuredOutputsParams(json=PERSON), "json_object": StructuredOutputsParams(json_object=True),
               "regex": StructuredOutputsParams(regex=PHONE),
               "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
               "grammar": StructuredOutputsParams(grammar=GRAMMAR)}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_each_constraint_holds_greedy_and_sampled(llm, kind):
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=CONSTRAINTS[kind]),
              SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=120, structured_outputs=CONSTRAINTS[kind])]
    for out in llm.generate([PROMPTS[0], PROMPTS[0]], params, use_tqdm=False):
        for choice in out.outputs:
            assert choice.finish_reason == "stop", (kind, choice.text)  # the grammar ended it, within max_tokens
            assert holds(kind, choice.text), (kind, choice.text)


def test_constrained_rows_leave_their_batch_alone(llm):
    """A batch mixing constrained and free requests: each free one generates what it does alone, each constrained
    one what it does alone (the masks are per row)."""
    free = SamplingParams(temperature=0, max_tokens=20)
    constrained = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=CONSTRAINTS[k])
                   for k in ("regex", "json", "choice")]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    params = [constrained[0], free, constrained[1], constrained[2], free]
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], [q], use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert holds("regex", together[0].outputs[0].text) and holds("json", together[2].outputs[0].text)


def test_grammar_waits_for_its_start_token(llm):
    """`structured_outputs_wait_for` (a reasoning model's </think>): free generation up to and including that token,
    the grammar from the next one on."""
    free = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    start = free.token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=CONSTRAINTS["choice"],
                            structured_outputs_wait_for=start)
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == free.token_ids[:4]
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(out.token_ids[4:]) in ("yes", "no", "maybe")
    assert out.finish_reason == "stop"


def test_bad_constraints_are_value_errors(llm):
    for spec, message in [(dict(regex="[a"), "regex could not be compiled"),
                          (dict(json={"type": "nope"}), "JSON schema could not be compiled"),
                          (dict(grammar="start: missing_rule"), "grammar could not be compiled")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    assert llm.generate(["x"], SamplingParams(max_tokens=3, structured_outputs={"choice": ["ab"]}),
                        use_tqdm=False)[0].outputs[0].text == "ab"  # vLLM's dict form
    with pytest.raises(ValueError, match="unknown constraint"):
        SamplingParams(structured_outputs={"jsn": {}})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constraints_hold_through_preemption_and_async_scheduling(async_scheduling):
    """A KV pool too small for every sequence at once: requests are preempted and recomputed; with async
    scheduling the next step is prepared before a grammar has seen the last token. Same tokens as one at a time."""
    llm = LLM(max_model_len=160, num_gpu_blocks_override=12, block_size=16, async_scheduling=async_scheduling)
    kinds = ["json", "regex", "grammar", "json"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=CONSTRAINTS[k])
              for i, k in enumerate(kinds)]
    ballast = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # two long free rows fill the pool
    prompts = PROMPTS + ["Once upon a time", "The weather today"]
    together = llm.generate(prompts, params + [ballast, ballast], use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for kind, out, prompt, p in zip(kinds, together, PROMPTS, params):
        assert holds(kind, out.outputs[0].text), (kind, out.outputs[0].text)
        assert out.outputs[0].token_ids == llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids


def test_bitmask_words_unpack_to_tokens():
    """Bit b of int32 word w allows token 32 w + b (llguidance's layout), the sign bit included."""
    words = torch.tensor([[0b101, -2**31, 1]], dtype=torch.int32)
    allowed = unpack_bitmask(words, 70)
    assert allowed.shape == (1, 70) and allowed[0].nonzero().flatten().tolist() == [0, 2, 63, 64]
    random = torch.randint(-2**31, 2**31 - 1, (3, 40), dtype=torch.int32)  # the GPU / NPU form, run here on the CPU
    assert torch.equal(unpack_bitmask_on_device(random, 1270), unpack_bitmask(random, 1270))


def test_a_rejected_token_stops_constraining_instead_of_ending_the_output(llm):
    """A token the grammar rejects (possible only when another processor banned every allowed one) leaves the grammar
    failed: no longer masking, and not 'ended' (which would finish the request as if its output were complete)."""
    tokenizer = llm.get_tokenizer()
    state, = llm.llm_engine.grammar_compiler.compile(StructuredOutputsParams(choice=["yes"]), 1)
    state.accept(tokenizer.encode("no", add_special_tokens=False)[0])
    assert state.failed and not state.ended and not state.active
    done, = llm.llm_engine.grammar_compiler.compile(StructuredOutputsParams(choice=["yes"]), 1)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        done.accept(token)
    assert done.ended and not done.failed and not done.active


def test_forced_call_grammars_compile_for_defs_untyped_and_tagged_values(llm):
    """qwen3_coder: a property whose items $ref the schema's $defs compiles (each property's JSON carries them); a raw
    text value cannot hold a tag the parser splits at. hermes: a schema without "type" still makes an object."""
    from ascendserve.entrypoints.openai.chat_utils import forced_call_grammar

    compiler, tokenizer = llm.llm_engine.grammar_compiler, llm.get_tokenizer()
    schema = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
              "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/P"}},
                                               "note": {"type": "string"}}}

    def accepts(parser: str, parameters: dict, text: str) -> bool:
        grammar = forced_call_grammar(parser, [{"name": "f", "parameters": parameters}], "f")
        state, = compiler.compile(StructuredOutputsParams(grammar=grammar), 1)
        for token in tokenizer.encode(text, add_special_tokens=False):
            state.accept(token)
        return state.ended and not state.failed

    ok = '<parameter=items>\n[{"x": 1}]\n</parameter>\n<parameter=note>\na <b> c\n</parameter>\n</function>'
    assert accepts("qwen3_coder", schema, ok)
    assert not accepts("qwen3_coder", schema, '<parameter=items>\n[{"x": "1"}]\n</parameter>\n</function>')
    assert not accepts("qwen3_coder", schema, "<parameter=note>\na</function>b\n</parameter>\n</function>")
    assert accepts("hermes", {"properties": {"a": {"type": "integer"}}}, '{"a": 1}}\n</tool_call>')
    assert not accepts("hermes", {"properties": {"a": {"type": "integer"}}}, '5}\n</tool_call>')


def test_forced_call_grammars_keep_required_parameters_and_escape_names(llm):
    """qwen3_coder: the schema's properties in its order, each once, the required ones always (as hermes' JSON
    schema holds them); hermes: a name is written as JSON string text; names the qwen3_coder parser could not read
    back are a ValueError (a 400 at the server)."""
    from ascendserve.entrypoints.openai.chat_utils import forced_call_grammar
    from ascendserve.parsers.tool import Hermes2ProToolParser

    compiler, tokenizer = llm.llm_engine.grammar_compiler, llm.get_tokenizer()

    def accepts(parser: str, tools: list[dict], name: str | None, text: str) -> bool:
        state, = compiler.compile(StructuredOutputsParams(grammar=forced_call_grammar(parser, tools, name)), 1)
        for token in tokenizer.encode(text, add_special_tokens=False):
            state.accept(token)
        return state.ended and not state.failed

    f = [{"name": "f", "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                                      "required": ["b"]}}]
    block = {"a": "<parameter=a>\n1\n</parameter>\n", "b": "<parameter=b>\nx\n</parameter>\n"}
    assert accepts("qwen3_coder", f, "f", block["b"] + "</function>")
    assert accepts("qwen3_coder", f, "f", block["a"] + block["b"] + "</function>")
    for text in ("</function>", block["a"] + "</function>", block["b"] + block["a"] + "</function>",
                 block["b"] + block["b"] + "</function>"):
        assert not accepts("qwen3_coder", f, "f", text), text
    # every value as the parser reads it: a type list, anyOf, the parser's own type names, a string enum, a $ref
    typed = [{"name": "f", "parameters": {
        "$defs": {"Box": {"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"]}},
        "properties": {"n": {"type": ["integer", "null"]}, "m": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                       "k": {"type": "int32"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "box": {"$ref": "#/$defs/Box"}}}}]

    def value(prop: str, text: str) -> str:
        return f"<parameter={prop}>\n{text}\n</parameter>\n</function>"

    for prop, good, bad in [("n", ["7", "null"], ["abc", "7.5"]), ("m", ["2.5", "null"], ["x"]),
                            ("k", ["3"], ["three"]), ("unit", ["celsius", "fahrenheit"], ["kelvin", "celsius!"]),
                            ("box", ['{"w": 2}'], ['{"w": "2"}', "a box"])]:
        for text in good:
            assert accepts("qwen3_coder", typed, "f", value(prop, text)), (prop, text)
        for text in bad:
            assert not accepts("qwen3_coder", typed, "f", value(prop, text)), (prop, text)
    from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest
    from ascendserve.parsers.tool import Qwen3CoderToolParser
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                    tools=[{"type": "function", "function": typed[0]}])
    call = '<tool_call>\n<function=f>\n' + value("box", '{"w": 2}') + "\n</tool_call>"
    info = Qwen3CoderToolParser(tokenizer).extract_tool_calls(call, request)
    assert json.loads(info.tool_calls[0].function.arguments) == {"box": {"w": 2}}  # the $ref read as an object
    # "required" with parallel calls: one or more, each to any tool, until the turn ends (EOS); a named one: one call
    two = [{"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}},
           {"name": "g", "parameters": {"properties": {"b": {"type": "string"}}}}]
    eos = tokenizer.eos_token_id
    coder = ('g>\n<parameter=b>\nx\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=f>\n'
             '<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>')
    hermes = 'g", "arguments": {"b": "x"}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>'
    for parser, text in (("qwen3_coder", coder), ("hermes", hermes)):
        state, = compiler.compile(StructuredOutputsParams(grammar=forced_call_grammar(parser, two, None, True)), 1)
        for token in tokenizer.encode(text, add_special_tokens=False):
            state.accept(token)
        assert not state.ended and not state.failed, parser  # a third call may follow
        state.accept(eos)
        assert state.ended and not state.failed, parser
        single, = compiler.compile(StructuredOutputsParams(grammar=forced_call_grammar(parser, two, None)), 1)
        tokens, used = tokenizer.encode(text, add_special_tokens=False), 0
        while not single.ended:
            single.accept(tokens[used])
            used += 1
        assert used < len(tokens) and "<function=f>" not in tokenizer.decode(tokens[:used])  # one call only
    quoted = [{"name": 'say "hi"', "parameters": {}}, {"name": "other", "parameters": {}}]
    written = 'say \\"hi\\"", "arguments": {}}\n</tool_call>'
    assert accepts("hermes", quoted, None, written)
    info = Hermes2ProToolParser(tokenizer).extract_tool_calls('<tool_call>\n{"name": "' + written, None)
    assert [c.function.name for c in info.tool_calls] == ['say "hi"']
    with pytest.raises(ValueError, match="function name 'say \"hi\"' cannot be written in qwen3_coder"):
        forced_call_grammar("qwen3_coder", quoted, None)
    with pytest.raises(ValueError, match="parameter name 'a>b' of function 'f' cannot be written"):
        forced_call_grammar("qwen3_coder", [{"name": "f", "parameters": {"properties": {"a>b": {}}}}], "f")


def test_forced_call_grammar_with_its_opening(llm):
    """For a model that thinks first, the grammar holds the whole call from after </think>: blank space, then the
    opening (TOOL_CALL_OPENINGS), then what it leaves to the model; nothing else is allowed."""
    from ascendserve.entrypoints.openai.chat_utils import TOOL_CALL_OPENINGS, forced_call_grammar

    compiler, tokenizer = llm.llm_engine.grammar_compiler, llm.get_tokenizer()
    tools = [{"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}, "required": ["a"]}},
             {"name": "g", "parameters": {"properties": {}}}]
    call = "<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"

    def accepts(name: str | None, text: str) -> bool:
        named, opening = TOOL_CALL_OPENINGS["qwen3_coder"]
        lead = named.format(name=name) if name else opening
        grammar = forced_call_grammar("qwen3_coder", tools if name is None else tools[:1], name, name is None, lead)
        state, = compiler.compile(StructuredOutputsParams(grammar=grammar), 1)
        for token in tokenizer.encode(text, add_special_tokens=False):
            state.accept(token)
        return (state.ended or state.matcher.is_accepting()) and not state.failed  # "required": more calls may follow

    assert accepts("f", "\n\n<tool_call>\n<function=f>\n" + call.removesuffix("\n</tool_call>"))
    assert accepts(None, "<tool_call>\n<function=f>\n" + call)
    assert accepts(None, "\n<tool_call>\n<function=g>\n</function>\n</tool_call>")
    assert not accepts("f", "Sure! <tool_call>\n<function=f>\n" + call)
    assert not accepts(None, "\n\n<tool_call>\n<function=h>\n</function>\n</tool_call>")
