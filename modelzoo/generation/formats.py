"""Response formats as rows carry them: the OpenAI API's `response_format` (or model.json_schema) as canonical JSON
text, each distinct text compiled once by modelzoo/generation/structured.py. Torch-free: the params and the data
tool read it."""
from __future__ import annotations

import json
from typing import Any

JSON_OBJECT, JSON_SCHEMA = "json_object", "json_schema"


class FormatError(ValueError):
    """A response format that is malformed or that the grammar library cannot compile."""


def canonical_format(response_format: Any) -> str | None:
    """The OpenAI API's `response_format` (a mapping) as the canonical text rows store, or None for plain text.

    Accepts {"type": "text"}, {"type": "json_object"} and {"type": "json_schema", "json_schema": {"schema": {...},
    "name": ..., "strict": ...}}; raises FormatError for anything else."""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise FormatError(f"response_format must be an object with a type, got {response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return json.dumps({"type": JSON_OBJECT})
    if kind != JSON_SCHEMA:
        raise FormatError(f"response_format type {kind!r} is not supported (text, json_object or json_schema)")
    spec = response_format.get(JSON_SCHEMA)
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise FormatError("response_format json_schema needs json_schema.schema, a JSON schema object")
    return schema_format(schema)


def schema_format(schema: dict[str, Any]) -> str:
    """The canonical response format of a JSON schema (model.json_schema)."""
    return json.dumps({"type": JSON_SCHEMA, "schema": schema})  # keys keep their order: a schema's properties come in it
