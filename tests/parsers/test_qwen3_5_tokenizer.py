"""The Qwen3.5 tokenizer fixture loads like a real checkpoint and matches shared/reference/qwen3_5.md."""

import hashlib
import json
import unicodedata
from pathlib import Path

import pytest
import regex

from tests.fixtures.qwen3_5_tokenizer import (ADDED_TOKENS, CHAT_TEMPLATE, PRETOKENIZE_REGEX,
                                              build_qwen3_5_tokenizer, fetch_ranks, load_qwen3_5_tokenizer,
                                              load_ranks)

TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
SHARED_TEMPLATE = Path(__file__).resolve().parents[3] / "shared/reference/qwen3_5_chat_template.jinja"

MIXED_TEXTS = [
    "Hello, world! How's it going? I'm fine; we'll see. THEY'RE HERE.",
    "你好，世界！今天天气怎么样？我想去加拿大旅游，人力资源部门说可以。",
    "日本語のテキスト、カタカナとひらがな。東京タワーは333メートルです。",
    "مرحبا بالعالم، كيف حالك؟ ١٢٣",
    "Emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧‍👦 ✨🔥",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n   \n\r\n",
    "Numbers: 1234567890, 3.14159, -42, 1e10, 0x1F, 10,000.",
    "नमस्ते दुनिया, สวัสดีครับ, Привет, мир! Γειά σου Κόσμε.",
    "Decomposed e\u0301 and composed é; A\u030a; ﬁ ligature",
    "  leading spaces and trailing   ",
    "<|im_start|>user\nHi <think>there</think><|im_end|>",
]

# The tools instructions of the template, as reference §3 prints them.
TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
WEATHER_TOOL_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Get weather", '
                     '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, '
                     '"days": {"type": "integer"}}, "required": ["city"]}}}')


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen3_5_tokenizer()


@pytest.fixture(scope="module")
def ranks():
    return load_ranks(fetch_ranks())


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm in plain Python: NFC, the regex split, then lowest-rank pair merges."""
    ids = []
    for piece in regex.findall(PRETOKENIZE_REGEX, unicodedata.normalize("NFC", text)):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            pair_ranks = [ranks.get(parts[i] + parts[i + 1]) for i in range(len(parts) - 1)]
            candidates = [(r, i) for i, r in enumerate(pair_ranks) if r is not None]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


def test_loads_as_qwen3_5_tokenizer(tokenizer):
    assert type(tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert len(tokenizer) == 248077
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 248046
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 248044
    assert tokenizer.bos_token is None


def test_special_token_ids(tokenizer):
    expected = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
                "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|image_pad|>": 248056,
                "<|video_pad|>": 248057, "<tool_call>": 248058, "</tool_call>": 248059,
                "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
                "</think>": 248069, "<|audio_pad|>": 248076}
    for token, token_id in expected.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(248044, 248077)] == [t for t, _ in ADDED_TOKENS]


def test_special_tokens_are_single_tokens_in_text(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n</tool_call><|im_end|>")
    for token_id in (248045, 248068, 248069, 248058, 248059, 248046):
        assert token_id in ids


def test_skip_special_tokens_keeps_think_and_tool_call(tokenizer):
    ids = tokenizer.encode("<|im_start|><think>a</think><tool_call>b</tool_call><|im_end|><|endoftext|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>b</tool_call>"


def test_generation_config_stops_on_both_eos(tokenizer):
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(build_qwen3_5_tokenizer())
    assert config.eos_token_id == [248046, 248044]
    assert json.loads(Path(build_qwen3_5_tokenizer(), "generation_config.json").read_text())["eos_token_id"] == [
        248046, 248044]


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("text", MIXED_TEXTS[:-1])
def test_encoding_matches_tiktoken_algorithm(tokenizer, ranks, text):
    assert tokenizer.encode(text) == reference_encode(text, ranks)


def test_known_encodings(tokenizer):
    # Regression anchors taken from the pinned ranks file.
    assert tokenizer.encode("Hello world") == [9419, 1814]
    assert tokenizer.encode("!") == [0]
    assert tokenizer.encode("12345") == [16, 17, 18, 19, 20]  # digits one per token (\p{N})
    assert tokenizer.encode("\n") == [198]


def test_pretokenizer_keeps_combining_marks_in_words(tokenizer):
    split = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    devanagari = "नमस्ते"
    assert len(split(devanagari)) == 1  # Qwen2's regex would cut at the marks
    assert tokenizer.encode("e\u0301") == tokenizer.encode("é")  # NFC first


def test_chat_template_is_the_official_one(tokenizer):
    assert hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest() == TEMPLATE_SHA256
    assert tokenizer.chat_template == CHAT_TEMPLATE
    if SHARED_TEMPLATE.exists():
        assert SHARED_TEMPLATE.read_text() == CHAT_TEMPLATE


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_template_thinking_on_and_off(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(tokenizer, messages, add_generation_prompt=True) == base + "<think>\n"
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False) == (
        base + "<think>\n\n</think>\n\n")
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True) == base + "<think>\n"


def test_template_reference_tools_example(tokenizer):
    messages = [
        {"role": "system", "content": "Sys prompt."},
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need tool.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": '{"temp": 20}'},
        {"role": "tool", "content": "second result"},
    ]
    expected = (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + WEATHER_TOOL_JSON + "\n</tools>" + TOOLS_INSTRUCTIONS + "\n\nSys prompt.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris for 3 days?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 20}\n</tool_response>\n"
        "<tool_response>\nsecond result\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True) == expected


def test_template_tools_without_system_and_thinking_off(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    expected = (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + WEATHER_TOOL_JSON + "\n</tools>" + TOOLS_INSTRUCTIONS + "<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True,
                  enable_thinking=False) == expected


def test_template_drops_reasoning_of_earlier_turns(tokenizer):
    messages = [
        {"role": "system", "content": "  You are helpful.\n"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple math."},
        {"role": "user", "content": "And 3+3?"},
    ]
    expected = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n")
    assert render(tokenizer, messages, add_generation_prompt=True) == expected


def test_template_splits_think_out_of_content_in_current_turn(tokenizer):
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "<think>\nPonder.\n</think>\n\nAnswer."}]
    expected = ("<|im_start|>user\nQ<|im_end|>\n"
                "<|im_start|>assistant\n<think>\nPonder.\n</think>\n\nAnswer.<|im_end|>\n")
    assert render(tokenizer, messages) == expected


def test_template_parallel_calls_and_python_scalars(tokenizer):
    calls = [{"type": "function", "function": {"name": "f", "arguments": {
                 "flag": True, "none": None, "items": [1, "a"], "obj": {"k": "v"}, "n": 2.5}}},
             {"function": {"name": "g", "arguments": {}}}]
    messages = [{"role": "user", "content": "Go"},
                {"role": "assistant", "content": "Calling.", "tool_calls": calls}]
    expected = ("<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nCalling."
                "\n\n<tool_call>\n<function=f>\n<parameter=flag>\nTrue\n</parameter>\n"
                "<parameter=none>\nNone\n</parameter>\n<parameter=items>\n[1, \"a\"]\n</parameter>\n"
                "<parameter=obj>\n{\"k\": \"v\"}\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n"
                "</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call><|im_end|>\n")
    assert render(tokenizer, messages) == expected


def test_template_images_become_vision_placeholders(tokenizer):
    messages = [{"role": "user", "content": [{"type": "image", "image": "x.png"},
                                             {"type": "text", "text": "What is this?"}]}]
    expected = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n")
    assert render(tokenizer, messages, add_generation_prompt=True) == expected
