"""How a message's list of content parts becomes the text a chat template reads, and which parts are refused."""
import pytest

from ascendserve.entrypoints.openai.chat_utils import normalize_messages
from ascendserve.entrypoints.openai.errors import OpenAIError


def content(parts):
    return normalize_messages([{"role": "user", "content": parts}])[0]["content"]


def test_text_parts_join_by_newlines():
    assert content(["a", {"type": "text", "text": "b"}, {"type": "input_text", "text": "c"},
                    {"type": "output_text", "text": "d"}]) == "a\nb\nc\nd"
    assert content([{"type": "refusal", "refusal": "I cannot."}]) == "I cannot."  # an assistant turn OpenAI returned
    assert content([{"text": "no type"}]) == "no type"  # known by its field, as vLLM
    assert content([{"type": "text", "text": None}, {"type": "text", "text": "x"}]) == "x"  # was the text "None\nx"


def refused(parts):
    with pytest.raises(OpenAIError) as info:
        content(parts)
    return info.value


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 10_000}},
    {"image_url": {"url": "http://x/a.png"}},  # no type: it is still an image, not an 'unknown part'
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "http://x/a.mp4"}},
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"type": "file", "file": {"file_data": "AAAA"}},
])
def test_media_parts_are_refused_by_position_without_echoing_them(part):
    error = refused(["look:", part])
    assert error.status == 400 and error.param == "messages[0].content[1]"
    assert "the vision tower is not implemented" in str(error) and "AAAA" not in str(error)


@pytest.mark.parametrize("part, param, message", [
    ({"type": "text", "text": 3}, "messages[0].content[0].text", "must be a string, got int"),
    ({"type": "jpeg", "data": "B" * 10_000}, "messages[0].content[0]", "unknown type 'jpeg'"),
    ({"data": "B" * 10_000}, "messages[0].content[0]", "has no 'type' (its fields: ['data'])"),
    (7, "messages[0].content[0]", "must be a content part object"),
])
def test_malformed_parts_name_the_field(part, param, message):
    error = refused([part])
    assert error.param == param and message in str(error) and "BBBB" not in str(error)
