"""JSON schemas, regular expressions and EBNF grammars for the structured-output tests, with the
prompts that ask for them. Strings are bounded (maxLength, enum, pattern) so that every output
ends within the tests' token budgets."""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SHORT = {"type": "string", "maxLength": 16}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": {"type": "integer", "minimum": -100, "maximum": 100}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME}, "required": ["id", "name"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"title": SHORT, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"name": NAME, "nickname": NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                                              "minItems": 3, "maxItems": 3}}, "required": ["rgb"]},
    {"type": "object", "properties": {"weekday": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}},
     "required": ["weekday"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["USD", "EUR"]}}, "required": ["price", "currency"]},
    {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                                "minItems": 1, "maxItems": 3}}, "required": ["words"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"},
                                      "stable": {"type": "boolean"}}, "required": ["version", "stable"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                                               "maximum": 4}}, "required": ["kind", "legs"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9a-f]{4}$"}, "parts": {
        "type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}}}, "required": ["id", "parts"]},
    {"type": "object", "properties": {"percent": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}},
     "required": ["percent"]},
    {"type": "object", "properties": {"name": NAME, "scores": {"type": "array", "maxItems": 3, "items": {
        "type": "number", "minimum": 0, "maximum": 100}}}, "required": ["name", "scores"]},
]

# (regular expression, prompt): fullmatch is the check
REGEXES: list[tuple[str, str]] = [
    (r"(red|green|blue)(, (red|green|blue)){2}", "Name three colors:"),
    (r"[0-9]{3}-[0-9]{4}", "A phone number:"),
    (r"(yes|no)\.", "Is the sky blue? Answer:"),
    (r"[A-Z][a-z]{2,8}", "A city name:"),
    (r"\d{1,2}:\d{2} (AM|PM)", "The time is"),
]

# (EBNF grammar, an equivalent regular expression to check with, prompt)
EBNFS: list[tuple[str, str, str]] = [
    ('root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]', r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))*\)",
     "A tuple of small numbers:"),
    ('root ::= answer "!"\nanswer ::= "yes" | "no"', r"(yes|no)!", "Do you like tea?"),
    ('root ::= word (" " word){0,2}\nword ::= [a-z]{1,6}', r"[a-z]{1,6}( [a-z]{1,6}){0,2}", "Three words:"),
]


def schema_prompt(schema: dict) -> str:
    return f"Write one JSON value that follows this JSON schema: {schema}\nJSON:"
