"""The JSON-schema keywords the grammar enforces, and the refusal of every other one.

XGrammar turns a schema into a grammar and leaves out, silently, what it cannot express
(`uniqueItems`, `not`, `if`/`then`/`else`, `contains`, `dependentRequired`, `multipleOf` on
numbers, most `format`s, length bounds beside a `pattern` or a `format`, the bounds of a schema
that names no `type`, `allOf` of several schemas, `oneOf` of branches that may overlap, which it
reads as `anyOf`). An output would then break the schema it was promised to follow. So a schema is
checked first: each keyword is one XGrammar enforces, in a form that it enforces, or an annotation
that asks nothing of the output; anything else is refused, by name and place.
"""
from __future__ import annotations

from typing import Any, Iterator

# keywords that ask nothing of the output
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor",
                         "deprecated", "readOnly", "writeOnly", "discriminator"})
# keywords that XGrammar enforces, with the type the bounds among them need beside them
STRUCTURE = frozenset({"type", "enum", "const", "$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf",
                       "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                       "unevaluatedProperties", "items", "prefixItems", "unevaluatedItems"})
BOUNDS = {"minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
          "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
          "multipleOf": "integer", "minItems": "array", "maxItems": "array",
          "minProperties": "object", "maxProperties": "object"}
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})

_ONE_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_NAME_TYPES = frozenset({"string"})


def unenforced(schema: Any) -> str | None:
    """Why the grammar of `schema` (a parsed JSON schema) would not enforce all of it: the first
    keyword it would leave out, named with its place (a JSON pointer); None when it enforces all."""
    for pointer, node, implied in _subschemas(schema):
        why = _unenforced_here(node, implied, schema)
        if why is not None:
            return f"{why} (at {pointer or '/'})"
    return None


def _subschemas(schema: Any) -> Iterator[tuple[str, dict, frozenset[str]]]:
    """Every object schema inside `schema` (itself first), with its JSON pointer and the types its
    place implies (a property name is a string)."""
    stack = [("", schema, frozenset())]
    while stack:
        pointer, node, implied = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false, or a malformed value XGrammar itself refuses
        yield pointer, node, implied
        for key in _ONE_SCHEMA:
            if key in node:
                stack.append((f"{pointer}/{key}", node[key], _NAME_TYPES if key == "propertyNames" else frozenset()))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((f"{pointer}/{key}/{i}", s, frozenset()) for i, s in enumerate(node[key]))
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((f"{pointer}/{key}/{_escape(k)}", s, frozenset()) for k, s in node[key].items())


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _unenforced_here(node: dict, implied: frozenset[str], root: Any) -> str | None:
    unknown = next((k for k in node if k not in ANNOTATIONS and k not in STRUCTURE and k not in BOUNDS), None)
    if unknown is not None:
        return f"the keyword {unknown!r} is not enforced by the grammar"
    types = _types(node) or set(implied)
    for key, needs in BOUNDS.items():
        if key in node and not (types & ({"number", "integer"} if needs == "number" else {needs})):
            shown = '"number" or "integer"' if needs == "number" else f'"{needs}"'
            return f"the keyword {key!r} is enforced only beside \"type\": {shown}"
    return _unenforced_form(node, types, root)


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _unenforced_form(node: dict, types: set[str], root: Any) -> str | None:
    if "multipleOf" in node and "number" in types:
        return "the keyword 'multipleOf' is enforced only for integers"
    if "format" in node and node["format"] not in FORMATS:
        return f"the format {node['format']!r} is not enforced by the grammar (enforced: {', '.join(sorted(FORMATS))})"
    length = next((k for k in ("minLength", "maxLength") if k in node), None)
    shape = next((k for k in ("pattern", "format") if k in node), None)
    if length and shape:
        return f"the keyword {length!r} is not enforced beside {shape!r}"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "the keyword 'allOf' is enforced only with a single schema"
    if isinstance(node.get("oneOf"), list) and not _disjoint([_resolved(b, root) for b in node["oneOf"]]):
        return "the keyword 'oneOf' is enforced only when its branches cannot overlap (use 'anyOf')"
    return None


MAX_REF_HOPS = 32


def _resolved(branch: Any, root: Any) -> Any:
    """`branch` with its local `$ref`s followed (`#/...` pointers into `root`); None for a
    reference this cannot follow."""
    for _ in range(MAX_REF_HOPS):
        ref = branch.get("$ref") if isinstance(branch, dict) else None
        if not isinstance(ref, str):
            return branch
        if not ref.startswith("#"):
            return None
        branch = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(branch, dict) or part not in branch:
                return None
            branch = branch[part]
    return None


def _disjoint(branches: list) -> bool:
    """Whether no value can match two of `branches`, by a rule that is easy to check: each names
    one type and no two the same (integer counts as a number), each is a set of constants with none
    shared, or each is an object whose required property `k` is a different constant."""
    if len(branches) < 2:
        return True
    if not all(isinstance(b, dict) for b in branches):
        return False
    kinds = [b.get("type") for b in branches]
    if all(isinstance(k, str) for k in kinds):
        kinds = ["number" if k == "integer" else k for k in kinds]
        if len(set(kinds)) == len(kinds):
            return True
    constants = [_constants(b) for b in branches]
    if all(c is not None for c in constants) and _no_shared(constants):
        return True
    return _tagged(branches)


def _constants(branch: Any) -> list | None:
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return [branch["const"]]
    return branch["enum"] if isinstance(branch.get("enum"), list) else None


def _no_shared(groups: list[list]) -> bool:
    seen: list = []
    for group in groups:
        if any(_same(v, s) for v in group for s in seen):
            return False
        seen.extend(group)
    return True


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _tagged(branches: list[dict]) -> bool:
    """Objects that all require a property whose value is a different constant in each."""
    if not all(b.get("type") == "object" and isinstance(b.get("properties"), dict) for b in branches):
        return False
    shared = set.intersection(*(set(b.get("required") or ()) for b in branches))
    for tag in shared:
        values = [_constants(b["properties"].get(tag)) for b in branches]
        if all(v is not None for v in values) and _no_shared(values):
            return True
    return False
