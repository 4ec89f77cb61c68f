"""Typing raw tool-call parameter text by the tool's JSON schema (shared by XML-style tool parsers)."""

import ast
import json
import math
from typing import Any

from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest
from ascendserve.logger import init_logger

logger = init_logger(__name__)

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_BOOLEAN_TYPES = {"boolean", "bool", "binary"}
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float", "double")
_NULL_TEXTS = {"null", "None"}  # the chat template renders a Python None as "None"


def tool_properties(request: ChatCompletionRequest | None, function_name: str) -> dict[str, Any]:
    """The `properties` of `function_name`'s parameter schema in `request.tools` ({} when unknown)."""
    for tool in getattr(request, "tools", None) or []:
        if tool.function.name == function_name:
            return parameter_properties(tool.function.parameters)
    return {}


def parameter_properties(parameters: Any) -> dict[str, Any]:
    """A parameter schema's `properties`, each one that is a local `$ref` ("#/$defs/Name", "#/definitions/Name")
    replaced by the schema it names, so its type is seen ({} when there are none)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict):
        return {}
    return {name: _resolve_ref(schema, parameters) for name, schema in properties.items()}


def _resolve_ref(schema: Any, root: dict) -> Any:
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str):
        return schema
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        target = (root.get(key) or {}).get(ref[len(prefix):]) if ref.startswith(prefix) else None
        if isinstance(target, dict):
            return {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def value_kind(schema: Any) -> str | None:
    """How the parser reads a parameter of this schema: "string" (raw text), a JSON type name ("integer", "number",
    "boolean", "object", "array", whose text is JSON), or None (no schema: raw text)."""
    if not isinstance(schema, dict):
        return None
    kind = next((t for t in schema_types(schema) if t != "null"), "string")
    if kind in _STRING_TYPES:
        return "string"
    if kind.startswith(_INTEGER_PREFIXES):
        return "integer"
    if kind.startswith(_NUMBER_PREFIXES):
        return "number"
    if kind in _BOOLEAN_TYPES:
        return "boolean"
    return kind


def dump_arguments(arguments: dict[str, Any]) -> str:
    """Arguments as the JSON string OpenAI responses carry (vLLM's separators, UTF-8 kept)."""
    return json.dumps(arguments, ensure_ascii=False)


def convert_param_value(value: str, schema: Any) -> Any:
    """The JSON value for a raw parameter text; without a schema (or on a mismatch) the text itself.

    Examples: ("42", integer) -> 42; ("42", string) -> "42"; ("true", boolean) -> True;
    ('{"a": 1}', object) -> {"a": 1}; ("None", integer) -> None; ("null", string) -> "null".
    """
    if not isinstance(schema, dict):
        return value
    types = schema_types(schema)
    nullable = "null" in types
    kind = next((t for t in types if t != "null"), "string")
    is_null = value.strip() in _NULL_TEXTS
    if kind in _STRING_TYPES:
        return None if nullable and is_null else value
    if is_null:
        return None
    if kind.startswith(_INTEGER_PREFIXES):
        return _to_integer(value)
    if kind.startswith(_NUMBER_PREFIXES):
        return _to_number(value)
    if kind in _BOOLEAN_TYPES:
        return _to_boolean(value)
    return _to_json(value)


def schema_types(schema: dict[str, Any]) -> list[str]:
    """The lower-case type names a schema allows, from `type` (a name or a list) and `anyOf`/`oneOf`."""
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            if isinstance(option, dict):
                types.extend(schema_types(option))
    if not types and "properties" in schema:
        types = ["object"]
    elif not types and "items" in schema:
        types = ["array"]
    return [t.strip().lower() for t in types]


def _to_integer(value: str) -> Any:
    try:
        return int(value.strip())
    except ValueError:
        number = _to_number(value)
        if isinstance(number, float) and number.is_integer():
            return int(number)
        logger.debug("parameter value %r is not an integer; kept as a string", value)
        return value


def _to_number(value: str) -> Any:
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return value
    return number if math.isfinite(number) else value


def _to_boolean(value: str) -> Any:
    text = value.strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    return value


def _to_json(value: str) -> Any:
    """json.loads, then Python literal syntax ("{'k': 'v'}", "True"), else the text itself."""
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except ValueError:
        pass
    try:
        parsed = ast.literal_eval(value.strip())
        json.dumps(parsed, allow_nan=False)
        return parsed
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
