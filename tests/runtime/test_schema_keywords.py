"""JSON-schema keywords: each one `runtime/schema_keywords.py` lets through is enforced by
XGrammar's grammar (a value breaking it is refused), and each one it would leave out is refused by
`check_grammar` with its name and place."""
from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from xgrammar.testing import _is_grammar_accept_string as accepts

from hicache.runtime.grammar import check_grammar
from hicache.runtime.schema_keywords import BOUNDS, FORMATS, STRUCTURE
from schemas import SCHEMAS

OBJ, ARR, INT, STR = "object", "array", "integer", "string"

# keyword -> (a schema using it, a JSON value breaking it)
ENFORCED = {
    "type": ({"type": INT}, '"a"'),
    "enum": ({"enum": ["a", "b"]}, '"c"'),
    "const": ({"const": "a"}, '"c"'),
    "$ref": ({"$defs": {"a": {"type": INT}}, "$ref": "#/$defs/a"}, '"c"'),
    "$defs": ({"$defs": {"a": {"type": INT}}, "$ref": "#/$defs/a"}, '"c"'),
    "definitions": ({"definitions": {"a": {"type": INT}}, "$ref": "#/definitions/a"}, '"c"'),
    "anyOf": ({"anyOf": [{"type": INT}, {"type": "boolean"}]}, '"c"'),
    "oneOf": ({"oneOf": [{"type": INT}, {"type": "boolean"}]}, '"c"'),
    "allOf": ({"allOf": [{"type": INT, "minimum": 3}]}, "1"),
    "properties": ({"type": OBJ, "properties": {"a": {"type": INT}}}, '{"a": "s"}'),
    "required": ({"type": OBJ, "properties": {"a": {"type": INT}}, "required": ["a"]}, "{}"),
    "additionalProperties": ({"type": OBJ, "properties": {"a": {"type": INT}}, "additionalProperties": False},
                             '{"b": 1}'),
    "patternProperties": ({"type": OBJ, "patternProperties": {"^a.*": {"type": INT}}}, '{"ab": "s"}'),
    "propertyNames": ({"type": OBJ, "additionalProperties": {"type": INT}, "propertyNames": {"pattern": "^a.*"}},
                      '{"b": 1}'),
    "unevaluatedProperties": ({"type": OBJ, "properties": {"a": {"type": INT}}, "unevaluatedProperties": {"type": INT}},
                              '{"b": "s"}'),
    "items": ({"type": ARR, "items": {"type": INT}}, '["a"]'),
    "prefixItems": ({"type": ARR, "prefixItems": [{"type": STR}], "items": False}, "[1]"),
    "unevaluatedItems": ({"type": ARR, "prefixItems": [{"type": STR}], "unevaluatedItems": {"type": INT}},
                         '["a", "b"]'),
    "minLength": ({"type": STR, "minLength": 3}, '"a"'),
    "maxLength": ({"type": STR, "maxLength": 1}, '"abc"'),
    "pattern": ({"type": STR, "pattern": "^a+$"}, '"b"'),
    "format": ({"type": STR, "format": "date"}, '"x"'),
    "minimum": ({"type": "number", "minimum": 5}, "3.5"),
    "maximum": ({"type": INT, "maximum": 5}, "7"),
    "exclusiveMinimum": ({"type": INT, "exclusiveMinimum": 5}, "5"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 5}, "5"),
    "multipleOf": ({"type": INT, "multipleOf": 3}, "4"),
    "minItems": ({"type": ARR, "items": {"type": INT}, "minItems": 2}, "[1]"),
    "maxItems": ({"type": ARR, "items": {"type": INT}, "maxItems": 1}, "[1, 2]"),
    "minProperties": ({"type": OBJ, "additionalProperties": {"type": INT}, "minProperties": 1}, "{}"),
    "maxProperties": ({"type": OBJ, "additionalProperties": {"type": INT}, "maxProperties": 1}, '{"a": 1, "b": 2}'),
}


def grammar(schema: dict):
    import xgrammar as xgr

    return xgr.Grammar.from_json_schema(json.dumps(schema))


def test_every_keyword_let_through_has_a_case():
    assert set(ENFORCED) == STRUCTURE | set(BOUNDS)


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_keywords_let_through_are_enforced(keyword):
    schema, breaking = ENFORCED[keyword]
    check_grammar("json_schema", json.dumps(schema))
    assert not accepts(grammar(schema), breaking)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_let_through_are_enforced(fmt):
    schema = {"type": STR, "format": fmt}
    check_grammar("json_schema", json.dumps(schema))
    assert not accepts(grammar(schema), '"a b\\u00e9"')


REFUSED = [
    ({"type": ARR, "items": {"type": STR}, "uniqueItems": True}, "'uniqueItems'", "/"),
    ({"type": OBJ, "properties": {"tags": {"type": ARR, "uniqueItems": True}}}, "'uniqueItems'", "/properties/tags"),
    ({"type": ARR, "contains": {"const": 5}}, "'contains'", "/"),
    ({"type": INT, "not": {"const": 1}}, "'not'", "/"),
    ({"type": INT, "if": {"minimum": 3}, "then": {"maximum": 5}}, "'if'", "/"),
    ({"type": OBJ, "dependentRequired": {"a": ["b"]}}, "'dependentRequired'", "/"),
    ({"type": STR, "contentEncoding": "base64"}, "'contentEncoding'", "/"),
    ({"type": STR, "maxLenght": 3}, "'maxLenght'", "/"),  # a typo is not silently dropped
    ({"minimum": 3}, "'minimum'", "/"),
    ({"anyOf": [{"minLength": 3}, {"type": INT}]}, "'minLength'", "/anyOf/0"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'", "/"),
    ({"type": STR, "format": "color"}, "'color'", "/"),
    ({"type": STR, "pattern": "a+", "maxLength": 2}, "'maxLength'", "/"),
    ({"type": STR, "format": "email", "minLength": 3}, "'minLength'", "/"),
    ({"allOf": [{"type": INT}, {"minimum": 3}]}, "'allOf'", "/"),
    ({"oneOf": [{"type": INT}, {"type": "number"}]}, "'oneOf'", "/"),
    ({"$defs": {"a/b": {"type": ARR, "uniqueItems": True}}, "$ref": "#/$defs/a~1b"}, "'uniqueItems'", "/$defs/a~1b"),
]


@pytest.mark.parametrize("schema, named, place", REFUSED)
def test_keywords_the_grammar_would_drop_are_refused_by_name_and_place(schema, named, place):
    with pytest.raises(ValueError) as e:
        check_grammar("json_schema", json.dumps(schema))
    assert str(e.value).startswith("json_schema ") and named in str(e.value) and f"(at {place})" in str(e.value)


class Pet(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    name: str = Field(max_length=20, description="its name")


class Owner(BaseModel):
    name: str
    pets: list[Pet | Dog] = Field(min_length=1)
    best: Pet | Dog = Field(discriminator="kind")
    email: str | None = None


def test_generated_and_suite_schemas_are_let_through():
    """pydantic's schemas (with $defs, anyOf, a discriminated oneOf), OpenAI's strict form of them,
    and the structured-output suite's."""
    from openai.lib._pydantic import to_strict_json_schema

    for schema in [Owner.model_json_schema(), to_strict_json_schema(Owner), *SCHEMAS]:
        check_grammar("json_schema", json.dumps(schema))
