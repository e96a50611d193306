"""A small JSON Schema validator: the keywords docs/check.schema.json uses (type, enum, properties,
required, additionalProperties, items, anyOf, $ref to #/$defs, minimum, minLength, maxItems). Test
support only: the package does not depend on jsonschema."""

from __future__ import annotations

from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def errors(instance: Any, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    """Every way ``instance`` breaks ``schema``, each as ``path: what``; empty when it is valid."""
    root = schema if root is None else root
    if "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/$defs/"), ref
        found = errors(instance, root["$defs"][ref[len("#/$defs/") :]], root, path)
        rest = {k: v for k, v in schema.items() if k not in ("$ref", "description")}
        return found + (errors(instance, rest, root, path) if rest else [])
    if "anyOf" in schema:
        options = [errors(instance, option, root, path) for option in schema["anyOf"]]
        if all(options):
            return [f"{path}: matches none of anyOf ({'; '.join(o[0] for o in options)})"]
    found: list[str] = []
    if "type" in schema and not _typed(instance, schema["type"]):
        return [f"{path}: {type(instance).__name__} is not {schema['type']}"]
    if "enum" in schema and instance not in schema["enum"]:
        found.append(f"{path}: {instance!r} is not one of {schema['enum']}")
    if (
        isinstance(instance, (int, float))
        and not isinstance(instance, bool)
        and "minimum" in schema
        and instance < schema["minimum"]
    ):
        found.append(f"{path}: {instance} < {schema['minimum']}")
    if isinstance(instance, str) and len(instance) < schema.get("minLength", 0):
        found.append(f"{path}: shorter than {schema['minLength']}")
    if isinstance(instance, list):
        if len(instance) > schema.get("maxItems", len(instance)):
            found.append(f"{path}: more than {schema['maxItems']} items")
        for i, item in enumerate(instance):
            found += errors(item, schema.get("items", {}), root, f"{path}[{i}]")
    if isinstance(instance, dict):
        found += [
            f"{path}: {key!r} is required"
            for key in schema.get("required", ())
            if key not in instance
        ]
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in properties:
                found += errors(value, properties[key], root, f"{path}.{key}")
            elif extra is False:
                found.append(f"{path}: {key!r} is not allowed")
            elif isinstance(extra, dict):
                found += errors(value, extra, root, f"{path}.{key}")
    return found


def _typed(instance: Any, kinds: str | list[str]) -> bool:
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        if kind == "integer" and isinstance(instance, int) and not isinstance(instance, bool):
            return True
        if (
            kind == "number"
            and isinstance(instance, (int, float))
            and not isinstance(instance, bool)
        ):
            return True
        if kind in _TYPES and isinstance(instance, _TYPES[kind]):
            return True
    return False
