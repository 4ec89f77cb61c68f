"""Chat prompt rendering: OpenAI messages -> the checkpoint's Jinja chat template -> prompt text."""

import json
import os
import re

from ascendserve.entrypoints.openai.errors import OpenAIError
from ascendserve.parsers.tool.qwen3_coder import BAD_NAME_RE as CODER_BAD_NAME_RE
from ascendserve.parsers.tool.schema_types import parameter_properties, schema_types, value_kind

# Strings that mark a --chat-template value as a template rather than a file name.
_JINJA_MARKERS = ("{{", "{%")

# Per tool-call parser: the text that opens a call to `name` (a format string) and the opening that lets the model pick
# the name (plain text). A forced `tool_choice` appends one to the prompt and holds the rest to the tools' schemas
# (forced_call_grammar): a named function gets exactly one call, whose end ends the request; "required" gets one call or
# more until the model ends its turn (one with parallel_tool_calls false), as vLLM's guided decoding gives.
TOOL_CALL_OPENINGS = {
    "qwen3_coder": ("<tool_call>\n<function={name}>\n", "<tool_call>\n<function="),
    "hermes": ('<tool_call>\n{{"name": "{name}", "arguments": ', '<tool_call>\n{"name": "'),
}
TOOL_CALL_OPENINGS["qwen3_xml"] = TOOL_CALL_OPENINGS["qwen3_coder"]  # the same format, vLLM's other parser of it
# The call tags a tokenizer may hold as one added token each (Qwen3.5: 248058, 248059). llguidance treats every added
# token as special: the literal text never matches it (its mask let the token through, then refused it), so a forced
# call's grammar names such a tag by its id (single_token_tags).
CALL_TAGS = ("<tool_call>", "</tool_call>")


def single_token_tags(tokenizer) -> dict[str, int]:
    """{tag: token id} for the CALL_TAGS that `tokenizer` holds as one added token."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return {tag: added[tag] for tag in CALL_TAGS if tag in added}


def forced_call_grammar(parser: str, tools: list[dict], name: str | None, repeat: bool = False,
                        lead: str | None = None, tag_tokens: dict[str, int] | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of what a forced call's opening (TOOL_CALL_OPENINGS) leaves to the model
    (with `lead`, the opening itself comes first, after optional blank space: the grammar of the whole call, for a
    model that thinks before it; else the prompt holds the opening):
    for `name` its arguments, else (tool_choice "required" over several tools) a tool's name and then its arguments,
    up to the call's end; with `repeat` ("required", parallel calls allowed: vLLM's one or more) further calls to any
    of the tools may follow, until the model ends its turn. `tools` are the request's function definitions ({"name",
    "parameters"}). hermes: the arguments as a JSON object of the function's parameter schema; qwen3_coder:
    `<parameter=NAME>` blocks of the schema's properties, strings as raw text (anything up to the block's end) or one
    of their enum, other types as JSON of their schema (_coder_value). `tag_tokens` (single_token_tags): the call tags
    the tokenizer holds as one token, which the grammar takes as that token."""
    def framing(text: str) -> str:  # the call's fixed text, its tags as their tokens
        return _lark_with_tokens(text, tag_tokens or {})

    schemas = {tool["name"]: {"type": "object", **(tool.get("parameters") or {})} for tool in tools}
    hermes = parser == "hermes"
    if not hermes:
        for tool, schema in schemas.items():
            _check_coder_property_names(tool, schema)
    rules = []

    def arguments(i: int, tool: str) -> str:
        if hermes:  # the arguments: a JSON object of the schema (an object even where it names no type)
            return f"%json {json.dumps(schemas[tool])} {framing('}' + chr(10) + '</tool_call>')}"
        return f"{_coder_params(schemas[tool], f'p{i}', rules)} {_lark('</function>')}"

    after_name = '", "arguments": ' if hermes else ">\n"
    for i, tool in enumerate(schemas):
        rules.append(f"call_{i}: {_lark(call_name_text(parser, tool) + after_name)} {arguments(i, tool)}")
    rules.append("any_call: " + " | ".join(f"call_{i}" for i in range(len(schemas))))
    if name is not None:
        rules.append(f"named_call: {arguments(len(schemas), name)}")
    first = "any_call" if name is None else "named_call"
    if lead is not None:
        rules += ["LEAD_SPACE: /[ \\n]+/", f"opened_call: LEAD_SPACE? {framing(lead)} {first}"]
        first = "opened_call"
    if not repeat:
        rules.append(f"start: {first}")
    elif hermes:  # each call closes itself; the next opens after a newline, or the turn ends
        rules.append(f"start: {first} ({framing(HERMES_NEXT_CALL)} any_call)*")
    else:  # a call's </tool_call> comes after its </function>; the turn ends after the last one
        rules.append(f"start: {first} ({framing(CODER_NEXT_CALL)} any_call)* {framing(CODER_LAST_CALL_END)}")
    if not hermes:  # a raw-text value: the shortest text that ends its block, with none of the tags the
        # parser splits at inside it (its regexes would cut the call there)
        rules += ["coder_text[lazy]: CODER_TEXT",
                  r"CODER_TEXT: /(.|\n)*\n<\/parameter>\n/ & ~/(.|\n)*(<parameter=|<\/parameter>(.|\n)(.|\n)|"
                  r"<\/function>|<function=|<\/?tool_call>)(.|\n)*/"]
    return "\n".join(rules) + "\n"


# Between forced calls (tool_choice "required" with parallel calls): what closes one call and opens the next, up to the
# name; and what closes the last qwen3_coder call
HERMES_NEXT_CALL = '\n<tool_call>\n{"name": "'
CODER_NEXT_CALL = "\n</tool_call>\n<tool_call>\n<function="
CODER_LAST_CALL_END = "\n</tool_call>"


def call_name_text(parser: str, name: str) -> str:
    """How a forced call writes the function's name in `parser`'s format (hermes: inside a JSON string); ValueError for
    a name the parser could not read back."""
    if parser == "hermes":
        return json.dumps(name, ensure_ascii=False)[1:-1]
    if not name or CODER_BAD_NAME_RE.search(name):
        raise ValueError(f"tools: the function name {name!r} cannot be written in {parser}'s call format "
                         f"(`<function=NAME>` takes no spaces, quotes, braces or angle brackets)")
    return name


def _check_coder_property_names(tool: str, schema: dict) -> None:
    properties = schema.get("properties")
    for prop in properties if isinstance(properties, dict) else ():
        if not prop or prop != prop.strip() or any(c in prop for c in "<>\n"):
            raise ValueError(f"tools: the parameter name {prop!r} of function {tool!r} cannot be written in "
                             f"qwen3_coder's call format (`<parameter=NAME>` takes no angle brackets, newlines or "
                             f"surrounding spaces)")


def _coder_params(schema: dict, prefix: str, rules: list[str]) -> str:
    """qwen3_coder's parameter blocks of one function (a rule per property, added to `rules`): in the schema's order
    (the one the chat template shows the model), each at most once, the schema's required ones always; with no
    properties in the schema, any parameter names."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not properties:
        rules.append(f'{prefix}_any: "<parameter=" /[^>\\n]+/ ">\\n" coder_text')
        return f"{prefix}_any*"
    required = set(schema.get("required") or ())
    names = []
    definitions = {key: schema[key] for key in ("$defs", "definitions") if key in schema}  # what $refs point into
    for j, (prop, prop_schema) in enumerate(parameter_properties(schema).items()):
        rules.append(f"{prefix}_{j}: {_lark(f'<parameter={prop}>' + chr(10))} {_coder_value(prop_schema, definitions)}")
        names.append(f"{prefix}_{j}" + ("" if prop in required else "?"))
    return " ".join(names)


def _coder_value(schema, definitions: dict) -> str:
    """One parameter's value and the block's end, as the qwen3_coder parser reads the value
    (schema_types.convert_param_value): JSON of the schema for the JSON kinds, one of the values of a string enum,
    else raw text (coder_text: lazy, so it takes the end with it)."""
    end = _lark("\n</parameter>\n")
    kind = value_kind(schema)
    if kind in ("integer", "number", "boolean", "object", "array"):
        types = set(schema_types(schema))
        if len(types - {"null"}) > 1 or not types <= _JSON_SCHEMA_TYPES:
            # the parser reads the first type alone, and knows its own names ("int32", "bool"): that JSON type
            schema = {"type": [kind, "null"] if "null" in types else kind}
        return f"%json {json.dumps({**schema, **definitions})} {end}"
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if kind == "string" and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lark(v) for v in enum) + f") {end}"
    return "coder_text"


_JSON_SCHEMA_TYPES = {"string", "integer", "number", "boolean", "object", "array", "null"}


def _lark(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _lark_with_tokens(text: str, tokens: dict[str, int]) -> str:
    """Lark for `text` with each of `tokens`' strings in it as that token (llguidance's `<[id]>`), the rest literals."""
    if not tokens:
        return _lark(text)
    parts = [part for part in re.split("(" + "|".join(map(re.escape, tokens)) + ")", text) if part]
    return " ".join(f"<[{tokens[part]}]>" if part in tokens else _lark(part) for part in parts) or _lark("")


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file path, or the template itself; raise ValueError for neither."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return _compiled(f.read(), value)
    if any(marker in value for marker in _JINJA_MARKERS):
        return _compiled(value, "the template string")
    raise ValueError(f"--chat-template {value!r} is neither an existing file nor a Jinja template "
                     f"(a template contains '{{{{' or '{{%'); example: --chat-template ./template.jinja")


def _compiled(template: str, where: str) -> str:
    """The template, once transformers' Jinja environment compiles it; a syntax error is a ValueError naming the line
    (it was a 400 on every chat request)."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: {where} is not a valid Jinja template: {e.message} "
                         f"(line {e.lineno})") from None
    return template


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Text parts joined into strings, a null or missing content made "" (an assistant turn that only calls
    tools sends `"content": null`), tool-call arguments parsed to objects (what templates expect)."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            message["content"] = _join_text_parts(content, i)
        elif not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content must be a string or a list of content parts, "
                              f"got {type(content).__name__}", 400, param=f"messages[{i}].content")
        if message.get("tool_calls"):
            message["tool_calls"] = [_parse_arguments(call) for call in message["tool_calls"]]
        out.append(message)
    return out


# Content-part types that carry media (OpenAI's, the Responses API's and vLLM's extensions), none of which is read yet.
_MEDIA_PARTS = ("image_url", "input_image", "image", "image_pil", "image_embeds", "video_url", "video", "video_embeds",
                "input_audio", "audio_url", "audio", "audio_embeds", "file", "input_file")
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}  # type -> its field


def _join_text_parts(parts: list, index: int) -> str:
    """A list of content parts as the text a template reads (text parts joined by newlines); a media or malformed part
    is a 400 naming `messages[i].content[j]`, never echoing the part itself (an inline image is megabytes)."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{index}].content[{j}]"
        if isinstance(part, str):  # a bare string part, as vLLM takes it
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise OpenAIError(f"{where} must be a content part object such as {{'type': 'text', 'text': ...}}, got "
                              f"{type(part).__name__}", 400, param=where)
        kind = part.get("type")
        if kind is None:  # as vLLM: a part without a type is known by its field
            kind = next((k for k in (*_TEXT_PARTS, *_MEDIA_PARTS) if k in part), None)
        if kind in _TEXT_PARTS:
            text = part.get(_TEXT_PARTS[kind])
            if text is None:
                continue
            if not isinstance(text, str):
                raise OpenAIError(f"{where}.{_TEXT_PARTS[kind]} must be a string, got {type(text).__name__}", 400,
                                  param=f"{where}.{_TEXT_PARTS[kind]}")
            texts.append(text)
        elif kind in _MEDIA_PARTS:
            raise OpenAIError(f"{where} is of type {kind!r}, but images, video and audio are not read yet (the "
                              f"vision tower is not implemented): send text parts only.", 400, param=where)
        elif kind is None:
            raise OpenAIError(f"{where} has no 'type' (its fields: {sorted(map(str, part))[:8]}); expected "
                              f"{{'type': 'text', 'text': ...}}", 400, param=where)
        else:
            shown = kind if isinstance(kind, str) and len(kind) <= 40 else f"{str(kind)[:40]}..."
            raise OpenAIError(f"{where} has an unknown type {shown!r}; the types read are 'text' (also "
                              f"'input_text', 'output_text', 'refusal')", 400, param=where)
    return "\n".join(texts)


def _parse_arguments(call):
    """A history tool call with its arguments as an object, as templates iterate them: a JSON string decoded; an
    empty, null, broken or non-object one made {} (vLLM's reading; agents replay a call without arguments as "")."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**call["function"], "arguments": arguments}}


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None, tools: list[dict] | None,
                add_generation_prompt: bool, continue_final_message: bool, documents=None,
                chat_template_kwargs: dict | None = None) -> str:
    """The prompt text; a template error (bad roles, missing template) becomes a 400."""
    from jinja2 import TemplateError

    if tokenizer is None:
        raise OpenAIError("This server runs without a tokenizer: chat needs one.", 400)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("This model has no chat template; give one (the server's --chat-template, a file or a Jinja "
                          "string, or chat_template=...), or use completions.", 400)
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise OpenAIError("continue_final_message needs the last message to be an assistant message.", 400,
                          param="continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                "continue_final_message", "tokenize"} & set(kwargs)
    if reserved:
        raise OpenAIError(f"chat_template_kwargs cannot set {sorted(reserved)}; use the request fields.", 400,
                          param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            normalize_messages(messages), tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **kwargs)
    except OpenAIError:
        raise
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise OpenAIError(f"The chat template could not render these messages: {type(e).__name__}: {e}", 400,
                          param="messages") from None
    return text if isinstance(text, str) else tokenizer.decode(text)
