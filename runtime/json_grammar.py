"""The grammar of a JSON schema, with its length-bounded strings rewritten so that XGrammar's
token masks for them are computed when the grammar compiles, not at every step.

XGrammar writes a string of at most `n` characters as `"\\"" C{m, n} "\\""` (C: a character the
string may hold). It keeps a bounded repetition's count in the matcher, so in such a string every
token that could run past the bound, or close the string and go on, is checked against the stack
each time a mask is filled: near the bound, most of the vocabulary. The same language, written
as `m` copies of C and then rules that each know how many characters are left,

    C_close_k ::= "\\"" | C C_close_{k-1}        C_close_0 ::= "\\""

lets the compiler precompute each state's mask: a fill then checks only the tokens that close
the string and go on. Bounds above `MAX_UNROLLED` are left to XGrammar (a rule per character).
"""
from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

MAX_UNROLLED = 128  # the longest maxLength written out as rules
# as XGrammar prints its grammars: a quoted literal, a character class (both kept whole, so that
# nothing inside them matches), or a bounded repetition of a rule followed by a closing quote
_BOUNDED_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\b(\w+)\{(\d+), (\d+)\} "\\""')


def json_schema_grammar(schema: str, max_whitespace: int) -> Any:
    """xgrammar.Grammar of the JSON schema text `schema` (at most `max_whitespace` whitespace
    characters between tokens), bounded strings rewritten (see the module's docstring)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=max_whitespace)
    text = str(grammar)
    rewritten = unroll_bounded_strings(text)
    if rewritten == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(rewritten)
    except (RuntimeError, ValueError) as e:  # a form this module does not know: keep XGrammar's
        logger.debug("bounded strings left as they are: %s", e)
        return grammar


def unroll_bounded_strings(ebnf: str) -> str:
    """`ebnf` (XGrammar's printed form) with each `C{m, n} "\\""` (n <= MAX_UNROLLED) written as
    m copies of C then `C_close_{n-m}`, whose rules are appended; unchanged when none is found,
    or when a new rule's name is taken."""
    defined = set(re.findall(r"^(\w+) ::=", ebnf, re.MULTILINE))
    rules: dict[str, str] = {}

    def unroll(m: re.Match) -> str:
        if m.group(1) is None:  # a literal or a class
            return m.group(0)
        name, low, high = m.group(1), int(m.group(2)), int(m.group(3))
        if name not in defined or not low <= high <= MAX_UNROLLED:
            return m.group(0)
        for k in range(high - low + 1):
            rules[f"{name}_close_{k}"] = f'("\\"" | ({name} {name}_close_{k - 1}))' if k else '("\\"")'
        return " ".join([name] * low + [f"{name}_close_{high - low}"])

    out = _BOUNDED_STRING.sub(unroll, ebnf)
    if not rules or defined & rules.keys():
        return ebnf
    return out.rstrip("\n") + "\n" + "".join(f"{name} ::= {body}\n" for name, body in rules.items())
