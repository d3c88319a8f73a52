"""Structured output: what a request's output must match, and the constraint enforcing it.

Pure Python like the rest of the core: the grammar library lives in ``quanta.structured``,
which compiles a ``StructuredOutput`` into a ``TokenConstraint`` when the request is made. The
core only advances a request's constraint when one of its tokens is committed, never when a
step merely ran, so a request that is preempted, swapped, recomputed or whose step was
aborted at a safepoint resumes with exactly the grammar state it had: its output is the one an
uninterrupted run produces.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from quanta.core.json_schema import enforced_schema

GuideKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class StructuredOutput(BaseModel):
    """One guide for the output, as vLLM's guided decoding spells it (exactly one of
    ``json_schema``, ``json_object``, ``regex``, ``choice``, ``grammar``).

    ``json_schema`` is kept as compact JSON text with its keys in the order given (the order
    of ``properties`` is the order the output writes them). ``grammar`` is EBNF in the grammar
    library's (GBNF-like) syntax. JSON output under a schema is written one way,
    ``{"a": 1, "b": [2, 3]}``: a small model allowed any whitespace can fill the output with it
    until ``max_tokens``. A schema is always enforced strictly (properties it does not name are
    refused unless it allows them), as vLLM does whatever OpenAI's ``strict`` says, and one
    using a keyword the grammar cannot enforce is refused (``core.json_schema``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_as_text(cls, value: Any) -> Any:
        if isinstance(value, dict | bool):
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"json_schema is not JSON: {exc}") from None
            if not isinstance(parsed, dict | bool):
                raise ValueError("json_schema must be a JSON object")
            return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)
        return value

    @field_validator("json_schema")
    @classmethod
    def _enforceable(cls, value: str | None) -> str | None:
        if value is not None:
            enforced_schema(json.loads(value))  # raises naming what cannot be enforced
        return value

    @field_validator("choice")
    @classmethod
    def _non_empty_choices(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and (not value or any(c == "" for c in value)):
            raise ValueError("choice must list at least one non-empty string")
        return value

    @field_validator("regex", "grammar")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        given = [kind for kind in _KINDS if _given(self, kind)]
        if len(given) != 1:
            raise ValueError(
                "structured output takes exactly one of json_schema, json_object, regex, "
                f"choice, grammar; got {', '.join(given) or 'none'}"
            )
        return self

    @property
    def kind(self) -> GuideKind:
        return next(kind for kind in _KINDS if _given(self, kind))

    @property
    def guide(self) -> str:
        """The guide as one string (a choice list as a JSON array; empty for json_object):
        what Triton's ``guided_decoding_guide`` input carries."""
        kind = self.kind
        if kind == "choice":
            return json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return ""
        return str(getattr(self, kind))

    @classmethod
    def from_guide(cls, kind: str, guide: str) -> StructuredOutput:
        """The inverse of ``kind``/``guide``; raises ``ValueError`` for an unknown kind or a
        malformed guide."""
        if kind not in _KINDS:
            raise ValueError(f"unknown guide type {kind!r}; use one of {', '.join(_KINDS)}")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            try:
                choices = json.loads(guide)
            except ValueError:
                raise ValueError("a choice guide is a JSON array of strings") from None
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise ValueError("a choice guide is a JSON array of strings")
            return cls(choice=tuple(choices))
        return cls(**{kind: guide})


_KINDS: tuple[GuideKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


def _given(spec: StructuredOutput, kind: str) -> bool:
    value = getattr(spec, kind)
    return value is True if kind == "json_object" else value is not None


class TokenConstraint(Protocol):
    """A request's grammar state. The core calls ``accept`` with each committed token; the
    runner asks the object itself (outside the core) for the mask of allowed next tokens."""

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (state unchanged) when the grammar forbids it."""
        ...

    @property
    def terminated(self) -> bool:
        """The grammar accepted its stop token: nothing may follow."""
        ...


class ConstraintCompiler(Protocol):
    """Turns a ``StructuredOutput`` into a fresh ``TokenConstraint`` (one per request);
    raises ``InvalidRequestError`` naming the problem when the guide cannot be compiled."""

    def __call__(self, spec: StructuredOutput) -> TokenConstraint: ...


__all__ = ["ConstraintCompiler", "GuideKind", "StructuredOutput", "TokenConstraint"]
