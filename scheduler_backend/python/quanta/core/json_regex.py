"""Which characters a regular expression (a JSON schema's ``pattern``) writes as literals.

The grammar engine matches a ``pattern`` against a JSON string's text, and writes what the
expression names literally, unescaped: a quote, a backslash or a control character among them
would break the JSON (a class mixing them with other characters loses them, which still
fits). ``escaped_literal`` finds such a literal so the schema can be refused. Python's own
parser reads the expression (JSON Schema validators such as ``jsonschema`` use ``re`` too).
"""

from __future__ import annotations

import re
import re._constants as sre_c
import re._parser as sre_parse
from typing import Any

# Characters a JSON string holds only escaped.
_ESCAPED = frozenset({*range(0x20), ord('"'), ord("\\")})


def escaped_literal(pattern: str) -> str | None:
    """The first character ``pattern`` names that a JSON string holds only escaped: as a
    literal, or as a class of nothing else; None when there is none. Raises ``ValueError``
    when ``pattern`` is not a regular expression."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise ValueError(str(exc)) from None
    return _escaped_literal(list(parsed.data))


def _escaped_literal(items: list[tuple[Any, Any]]) -> str | None:
    for op, arg in items:
        if op is sre_c.LITERAL and arg in _ESCAPED:
            return chr(arg)
        if op is sre_c.IN and all(_only_escaped(member) for member in arg):  # no NEGATE
            return chr(arg[0][1] if arg[0][0] is sre_c.LITERAL else arg[0][1][0])
        for sub in _subpatterns(op, arg):
            found = _escaped_literal(list(sub))
            if found is not None:
                return found
    return None


def _only_escaped(member: tuple[Any, Any]) -> bool:
    op, arg = member
    if op is sre_c.LITERAL:
        return bool(arg in _ESCAPED)
    if op is sre_c.RANGE:
        return all(c in _ESCAPED for c in range(arg[0], arg[1] + 1))
    return False


def _subpatterns(op: Any, arg: Any) -> list[Any]:
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT):
        return [arg[2]]
    if op is sre_c.SUBPATTERN:
        return [arg[3]]
    if op is sre_c.BRANCH:
        return list(arg[1])
    if op is sre_c.ATOMIC_GROUP:
        return [arg]
    if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
        return [arg[1]]
    return []
