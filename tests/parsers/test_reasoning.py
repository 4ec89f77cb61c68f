"""The qwen3 reasoning parser on Qwen3.5 outputs, whole and streamed token by token."""

import pytest

from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest
from ascendserve.parsers import ParserNotFoundError
from ascendserve.parsers.reasoning import Qwen3ReasoningParser, get_reasoning_parser
from tests.fixtures import token_deltas
from tests.fixtures.qwen3_5_tokenizer import load_qwen3_5_tokenizer

TOOL_CALL = "<tool_call>\n<function=bash>\n<parameter=command>\ncat f.txt\n</parameter>\n</function>\n</tool_call>"

# (name, model output, expected reasoning, expected content) with thinking on (the template default).
THINKING_CASES = [
    ("without_start_token", "This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("without_start_token_complete_reasoning", "This is a reasoning section</think>",
     "This is a reasoning section", None),
    ("with_think", "<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("without_think_is_all_reasoning", "This is a reasoning section", "This is a reasoning section", None),
    ("only_open_tag", "<think>Still thinking about it", "Still thinking about it", None),
    ("multiline", "<think>\nline one\nline two\n</think>\n\nThe answer.", "\nline one\nline two\n",
     "\n\nThe answer."),
    ("qwen3_5_style", "Let me compute 2+2. 四。\n</think>\n\nThe answer is 4 😀.",
     "Let me compute 2+2. 四。\n", "\n\nThe answer is 4 😀."),
    ("tool_call_no_think_end", "I need to read the file.\n\n" + TOOL_CALL, "I need to read the file.\n\n", TOOL_CALL),
    ("tool_call_with_think_no_end", "<think>I need to read the file.\n" + TOOL_CALL, "I need to read the file.\n",
     TOOL_CALL),
    ("tool_call_after_think_end", "Need a tool.\n</think>\n\n" + TOOL_CALL, "Need a tool.\n", "\n\n" + TOOL_CALL),
    ("empty_reasoning", "</think>\n\nJust the answer.", None, "\n\nJust the answer."),
    ("empty", "", None, None),
]
DISABLED_CASES = ["Plain answer.", "Answer with <tool_call>\n<function=f>\n</function>\n</tool_call>",
                  "Hello\n\nWorld"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen3_5_tokenizer()


def chat_request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)


def stream(parser, tokenizer, output: str, tokens_per_step: int = 1) -> tuple[str, str, list[bool]]:
    """Feed `output` to the parser as a server would; return the joined reasoning and content."""
    reasoning, content, ended = [], [], []
    for step in token_deltas(tokenizer, output, tokens_per_step):
        delta = parser.extract_reasoning_streaming(step.previous_text, step.current_text, step.delta_text,
                                                   step.previous_token_ids, step.current_token_ids,
                                                   step.delta_token_ids)
        if delta is not None:
            assert delta.reasoning_content or delta.content
            assert delta.reasoning == delta.reasoning_content
            reasoning.append(delta.reasoning_content or "")
            content.append(delta.content or "")
        ended.append(parser.reasoning_ended)
    return "".join(reasoning), "".join(content), ended


def test_registry():
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert get_reasoning_parser("deepseek_r1") is Qwen3ReasoningParser
    with pytest.raises(ParserNotFoundError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("qwen9")


@pytest.mark.parametrize("name,output,reasoning,content", THINKING_CASES, ids=[c[0] for c in THINKING_CASES])
def test_extract_reasoning(tokenizer, name, output, reasoning, content):
    parser = get_reasoning_parser("qwen3")(tokenizer)
    assert parser.extract_reasoning(output, chat_request()) == (reasoning, content)


@pytest.mark.parametrize("tokens_per_step", [1, 3])
@pytest.mark.parametrize("name,output,reasoning,content", THINKING_CASES, ids=[c[0] for c in THINKING_CASES])
def test_streaming_matches_non_streaming(tokenizer, name, output, reasoning, content, tokens_per_step):
    parser = get_reasoning_parser("qwen3")(tokenizer)
    streamed_reasoning, streamed_content, ended = stream(parser, tokenizer, output, tokens_per_step)
    assert streamed_reasoning == (reasoning or "")
    assert streamed_content == (content or "")
    assert parser.reasoning_ended == ("</think>" in output or "<tool_call>" in output)
    assert ended == sorted(ended)  # once over, reasoning stays over


def test_streaming_whole_output_in_one_delta(tokenizer):
    output = "Thinking.\n</think>\n\nAnswer."
    ids = tokenizer.encode(output)
    parser = get_reasoning_parser("qwen3")(tokenizer)
    delta = parser.extract_reasoning_streaming("", output, output, [], ids, ids)
    assert (delta.reasoning_content, delta.content) == ("Thinking.\n", "\n\nAnswer.")


def test_end_token_alone_sends_nothing(tokenizer):
    parser = get_reasoning_parser("qwen3")(tokenizer)
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    assert parser.extract_reasoning_streaming("abc", "abc</think>", "</think>", [1], [1, end_id], [end_id]) is None
    assert parser.reasoning_ended


@pytest.mark.parametrize("output", DISABLED_CASES)
def test_thinking_disabled_is_all_content(tokenizer, output):
    kwargs = {"enable_thinking": False}
    parser = get_reasoning_parser("qwen3")(tokenizer, chat_template_kwargs=kwargs)
    assert parser.extract_reasoning(output, chat_request(chat_template_kwargs=kwargs)) == (None, output)
    assert stream(parser, tokenizer, output) == ("", output, [True] * len(token_deltas(tokenizer, output)))
    assert parser.is_reasoning_end(tokenizer.encode(output))


def test_request_kwargs_decide_non_streaming(tokenizer):
    parser = get_reasoning_parser("qwen3")(tokenizer)
    disabled = chat_request(chat_template_kwargs={"enable_thinking": False})
    assert parser.extract_reasoning("a</think>b", disabled) == (None, "a</think>b")
    assert parser.extract_reasoning("a</think>b", None) == ("a", "b")


def test_is_reasoning_end_on_rendered_prompts(tokenizer):
    parser = get_reasoning_parser("qwen3")(tokenizer)
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "Q2"}]
    thinking_on = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    thinking_off = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert not parser.is_reasoning_end(_ids(thinking_on))
    assert parser.is_reasoning_end(_ids(thinking_off))


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_is_reasoning_end_on_outputs(tokenizer):
    parser = get_reasoning_parser("qwen3")(tokenizer)
    assert not parser.is_reasoning_end(tokenizer.encode("still thinking"))
    assert parser.is_reasoning_end(tokenizer.encode("done</think>answer"))
    assert parser.is_reasoning_end(tokenizer.encode("plan <tool_call>\n<function=f>"))
    # A closed call earlier in a prompt (few-shot) does not end the reasoning that follows it.
    assert not parser.is_reasoning_end(tokenizer.encode("<tool_call>x</tool_call> thinking"))
    assert not parser.is_reasoning_end(tokenizer.encode("</think>answer<think>new thoughts"))


def test_extract_content_ids(tokenizer):
    parser = get_reasoning_parser("qwen3")(tokenizer)
    assert tokenizer.decode(parser.extract_content_ids(tokenizer.encode("a</think>\n\nb"))) == "\n\nb"
    assert tokenizer.decode(parser.extract_content_ids(tokenizer.encode("a" + TOOL_CALL))) == TOOL_CALL
    assert parser.extract_content_ids(tokenizer.encode("only thinking")) == []


def test_tokenizer_without_think_tokens_is_an_error():
    class NoThink:
        unk_token_id = 0

        def convert_tokens_to_ids(self, token):
            return 0

    with pytest.raises(ValueError, match="<think>"):
        Qwen3ReasoningParser(NoThink())
