"""The JSON Schema features structured output can enforce, checked where a schema enters.

The grammar engine (xgrammar) turns a schema into a grammar, but a few keywords it cannot
express and ignores (``uniqueItems``, ``contains``, ``not``, ``if``/``then``/``else``,
dependencies, ``allOf`` of several schemas, ``multipleOf`` on non-integers, length bounds
beside a ``pattern`` or ``format``, unknown formats), or only approximates (``oneOf`` becomes
``anyOf``; ``enum``/``const`` drop the keywords beside them; ``required`` names missing from
``properties`` are dropped; a regular expression's literal quote, backslash or control
character is written raw inside the JSON string). Output under such a schema need not fit it,
so the schema is refused, naming the keyword and where it sits, before anything runs.

Three are rewritten into what they mean instead (``enforced_schema``): an ``enum``/``const``
keeps only the values of the ``type`` beside it, a required name the schema leaves to
``additionalProperties`` gets that schema as a property of its own, and ``format: ipv4``
becomes a pattern without leading zeros.

Pure Python, so the check runs wherever a ``StructuredOutput`` is built (the gateway answers
400 before the engine sees the request).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from quanta.core.json_regex import escaped_literal

# Formats the engine writes as their syntax (an unknown one would be any string). NOTE: it
# checks syntax only: a ``date`` may be February 31st. Its ``ipv4`` lets an octet start with
# 0 (``010``: octal to some parsers, refused by Python's ``ipaddress``), so ``ipv4`` is
# written as the pattern below instead.
FORMATS = frozenset(
    {"date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "time", "uri"}
    | {"uri-reference", "uri-template", "uuid"}
)

_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"^({_OCTET}\.){{3}}{_OCTET}$"

_REFUSED = {
    "not": "a negated schema",
    "if": "a conditional schema",
    "then": "a conditional schema",
    "else": "a conditional schema",
    "contains": "an array that must contain an item",
    "minContains": "an array that must contain an item",
    "maxContains": "an array that must contain an item",
    "dependentRequired": "properties required by others",
    "dependentSchemas": "schemas applied by a property",
    "dependencies": "properties required by others",
    "$dynamicRef": "a dynamic reference",
    "$recursiveRef": "a recursive reference",
}
# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE = ("additionalProperties", "items", "additionalItems", "propertyNames")
_ONE += ("unevaluatedProperties", "unevaluatedItems")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that constrain a value; beside ``enum``/``const`` only ``type`` is enforced.
_VALIDATION = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "format"}
    | {"minLength", "maxLength", "pattern", "items", "prefixItems", "minItems", "maxItems"}
    | {"uniqueItems", "properties", "required", "additionalProperties", "patternProperties"}
    | {"propertyNames", "minProperties", "maxProperties", "allOf", "anyOf", "oneOf", "$ref"}
)


class SchemaNotEnforceable(ValueError):
    """A schema (or part of one) that the grammar cannot enforce; says what and where."""


def enforced_schema(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """``schema`` as the grammar is compiled from it (a copy, with the rewrites above);
    raises ``SchemaNotEnforceable`` naming the first keyword it cannot enforce."""
    schema = copy.deepcopy(schema)
    _check(schema, schema, "")
    return schema


def _check(node: Any, root: Any, where: str) -> None:
    if not isinstance(node, dict):
        return
    for keyword, why in _REFUSED.items():
        if keyword in node:
            raise _refuse(keyword, where, f"{why} cannot be enforced")
    _check_keywords(node, root, where)
    if "enum" in node or "const" in node:
        _narrow_values(node, where)
    if isinstance(node.get("required"), list) and node.get("type", "object") == "object":
        _give_required_a_property(node, where)
    for keyword in _ONE:
        if isinstance(node.get(keyword), dict):
            _check(node[keyword], root, f"{where}/{keyword}")
    for keyword in _MANY:
        if isinstance(node.get(keyword), list):
            for i, sub in enumerate(node[keyword]):
                _check(sub, root, f"{where}/{keyword}/{i}")
    for keyword in _NAMED:
        if isinstance(node.get(keyword), dict):
            for name, sub in node[keyword].items():
                _check(sub, root, f"{where}/{keyword}/{_pointer(name)}")


def _check_keywords(node: dict[str, Any], root: Any, where: str) -> None:
    if node.get("uniqueItems") is True and not _at_most(node.get("maxItems"), 1):
        raise _refuse("uniqueItems", where, "unique array items cannot be enforced")
    if "multipleOf" in node and node.get("type") != "integer":
        raise _refuse("multipleOf", where, "only an integer's multipleOf can be enforced")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise _refuse("allOf", where, "allOf of several schemas cannot be enforced")
    if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], root):
        raise _refuse(
            "oneOf",
            where,
            "branches that may overlap would be enforced as anyOf; use anyOf, or branches "
            "that differ in type or in the const of a required property",
        )
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    fmt = node.get("format")
    if fmt is not None and _may_be_string(node) and fmt not in FORMATS:
        raise _refuse("format", where, f"{fmt!r} is not one of {', '.join(sorted(FORMATS))}")
    for keyword in ("pattern", "format"):
        if keyword in node and lengths and _may_be_string(node):
            raise _refuse(lengths[0], where, f"a length beside {keyword} cannot be enforced")
    if "pattern" in node and "format" in node:
        raise _refuse("pattern", where, "a pattern beside a format cannot be enforced")
    if fmt == "ipv4" and "pattern" not in node and _may_be_string(node):
        node["pattern"] = _IPV4
        del node["format"]
    if isinstance(node.get("pattern"), str):
        _check_pattern(node["pattern"], "pattern", where)
    if isinstance(node.get("patternProperties"), dict):
        for pattern in node["patternProperties"]:
            _check_pattern(pattern, "patternProperties", where)


def _check_pattern(pattern: str, keyword: str, where: str) -> None:
    """Refuse a regular expression that can put a quote, a backslash or a control character
    into the JSON string (the engine writes them unescaped)."""
    try:
        char = escaped_literal(pattern)
    except ValueError as exc:
        raise _refuse(keyword, where, f"{pattern!r} is not a regular expression: {exc}") from None
    if char is not None:
        raise _refuse(
            keyword,
            where,
            f"{pattern!r} matches {char!r}, which a JSON string holds only escaped",
        )


def _narrow_values(node: dict[str, Any], where: str) -> None:
    """Keep only the enum/const values of the ``type`` beside them; refuse any other
    validation keyword there (the engine writes one of the values, whatever else it says)."""
    keyword = "const" if "const" in node else "enum"
    other = sorted(k for k in node if k in _VALIDATION)
    if other:
        raise _refuse(other[0], where, f"only 'type' is enforced beside {keyword}")
    types = node.get("type")
    if types is None:
        return
    allowed = {types} if isinstance(types, str) else set(types)
    if keyword == "const":
        if not _of_type(node["const"], allowed):
            raise _refuse("const", where, f"its value is not of type {types}")
        return
    values = node["enum"] if isinstance(node["enum"], list) else []
    kept = [v for v in values if _of_type(v, allowed)]
    if not kept:
        raise _refuse("enum", where, f"none of its values is of type {types}")
    node["enum"] = kept


def _give_required_a_property(node: dict[str, Any], where: str) -> None:
    """A required name absent from ``properties`` is left to ``additionalProperties`` (any
    value when absent), which the engine would not require: name it a property of its own."""
    properties = node.get("properties", {})
    missing = [n for n in node["required"] if isinstance(n, str) and n not in properties]
    if not missing or not isinstance(properties, dict):
        return
    extra = node.get("additionalProperties", True)
    if extra is False or "patternProperties" in node:
        raise _refuse(
            "required", where, f"{missing[0]!r} is required but not among the properties"
        )
    node["properties"] = {
        **properties,
        **{name: extra if isinstance(extra, dict) else {} for name in missing},
    }


def _disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no value fits two branches, as far as their types or a required property's
    const tell (a discriminated union); unknown means possibly overlapping."""
    resolved = [_deref(b, root) for b in branches]
    for i, a in enumerate(resolved):
        for b in resolved[i + 1 :]:
            if not (_types_disjoint(a, b) or _discriminated(a, b)):
                return False
    return True


def _types_disjoint(a: Any, b: Any) -> bool:
    ta, tb = _types(a), _types(b)
    return ta is not None and tb is not None and not (_widen(ta) & _widen(tb))


def _discriminated(a: Any, b: Any) -> bool:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    for name in set(a.get("required", ())) & set(b.get("required", ())):
        va = _values(a.get("properties", {}).get(name))
        vb = _values(b.get("properties", {}).get(name))
        if va is not None and vb is not None and not va & vb:
            return True
    return False


def _types(node: Any) -> set[str] | None:
    if not isinstance(node, dict):
        return None
    values = _values(node)
    if values is not None:
        return {_json_type(json.loads(v)) for v in values}
    types = node.get("type")
    if isinstance(types, str):
        return {types}
    if isinstance(types, list) and all(isinstance(t, str) for t in types):
        return set(types)
    return None


def _values(node: Any) -> set[str] | None:
    """The values ``node`` allows, each as canonical JSON text, when it lists them."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {_encode(node["const"])}
    if isinstance(node.get("enum"), list):
        return {_encode(v) for v in node["enum"]}
    return None


def _of_type(value: Any, types: set[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _widen(types: set[str]) -> set[str]:
    """JSON Schema types as sets that intersect: an integer is also a number."""
    out = set(types)
    if "number" in out:
        out.add("integer")
    if "integer" in out:
        out.add("number")
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "null" if value is None else "object"


def _may_be_string(node: dict[str, Any]) -> bool:
    types = node.get("type")
    return types is None or types == "string" or (isinstance(types, list) and "string" in types)


def _at_most(value: Any, limit: int) -> bool:
    return isinstance(value, int) and value <= limit


def _deref(node: Any, root: Any) -> Any:
    """A local ``$ref`` (``#/...``) followed, for the oneOf check; anything else as is."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < 32:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target: Any = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        node, seen = target, seen + 1
    return node


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _refuse(keyword: str, where: str, why: str) -> SchemaNotEnforceable:
    return SchemaNotEnforceable(
        f"the JSON schema's {keyword!r} at {where or '/'} cannot be used: {why}"
    )
