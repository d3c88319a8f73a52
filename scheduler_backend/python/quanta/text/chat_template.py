"""Chat messages -> one prompt string.

Why two ways: Quanta's tiny checkpoints (and OPT) ship no chat template, so there is a plain
documented default; checkpoints that do ship one (``chat_template`` in
``tokenizer_config.json``, as HF writes it) get theirs, rendered with jinja2's sandbox the way
HF's ``apply_chat_template`` does (``messages``, ``add_generation_prompt=True``, ``bos_token``,
``eos_token``, ``raise_exception``). jinja2 is imported only when such a template is used.

The default template writes one ``<role>: <content>`` line per message and ends with
``assistant:``, so the model continues as the assistant::

    system: You are terse.
    user: Hi!
    assistant:

Messages are anything with a ``role`` and a ``text()`` (``ChatTurn``): the gateway passes its
request's messages, ``quanta build`` and the command-line tools pass ``Turn``s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from quanta.core.errors import InvalidRequestError
from quanta.text.tool_prompt import conversation, template_reads_tools

if TYPE_CHECKING:
    from quanta.text.tokenizer import Tokenizer


class ChatTurn(Protocol):
    """One message of a conversation, as a template reads it."""

    @property
    def role(self) -> str: ...

    def text(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Turn:
    """A plain-text message, for callers that hold no request of their own."""

    role: str
    content: str

    def text(self) -> str:
        return self.content


class ChatTemplateError(InvalidRequestError):
    """The template refused the conversation (``raise_exception``: roles must alternate...)."""


class ChatTemplateLoadError(ValueError):
    """A template this renderer cannot run (a jinja syntax error, an unknown filter, tag or
    test), found when the template is loaded."""


class ChatTemplate:
    """Renders a conversation; ``source`` is a jinja2 template or ``None`` for the default."""

    def __init__(
        self,
        source: str | None = None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        count_tokens: Callable[[str], int] | None = None,
        token_text: Callable[[int], str] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        tokenizer: Tokenizer | None = None,
        model_dir: Path | None = None,
        origin: str = "the chat template",
    ) -> None:
        """Compiles ``source`` and renders one user turn with it, so a template this renderer
        cannot run fails here (``ChatTemplateLoadError`` naming ``origin``, where the
        template came from) rather than at the first chat request."""
        self.source = source
        # The checkpoint, for the prompt size limit (``limits.py``): its tokenizer's longest
        # token and its context length.
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        # The checkpoint's tokenizer as a gateway needs it: token counts of system
        # messages, the text of each token that logprobs name, and the text of a prompt given
        # as token ids that ``echo`` repeats.
        self.count_tokens = count_tokens
        self.token_text = token_text
        self.decode = decode
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        self._template: Any = None
        if source is not None:
            self._template = _compile(source, origin)
            self._probe(origin)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> ChatTemplate:
        """The checkpoint's template if its ``tokenizer_config.json`` has one, else the default."""
        if model_dir is None:
            return cls()
        tokenizer = _tokenizer(Path(model_dir))
        count = None if tokenizer is None else (lambda text: len(tokenizer.encode(text)))
        text = None if tokenizer is None else (lambda token: tokenizer.decode([token]))
        decode = None if tokenizer is None else tokenizer.decode
        path = Path(model_dir) / "tokenizer_config.json"
        known = {"tokenizer": tokenizer, "model_dir": Path(model_dir)}
        if not path.is_file():
            return cls(count_tokens=count, token_text=text, decode=decode, **known)
        config = json.loads(path.read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if isinstance(source, list):  # HF's named templates: take "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            return cls(count_tokens=count, token_text=text, decode=decode, **known)
        return cls(
            source,
            bos_token=_token(config, "bos_token"),
            eos_token=_token(config, "eos_token"),
            count_tokens=count,
            token_text=text,
            decode=decode,
            origin=f"the chat template of {path}",
            **known,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTemplate:
        """A jinja2 template from a file (``--chat-template``)."""
        return cls(Path(path).read_text(encoding="utf-8"), origin=f"the chat template {path}")

    def _probe(self, origin: str) -> None:
        """One user turn, with and without the generation prompt. A refusal
        (``raise_exception``) is the template's answer to that conversation and loads; any
        other failure (an undefined filter or test, a type error) is a template the server
        could not serve."""
        import jinja2

        for prompt in (True, False):
            try:
                self.render([Turn("user", "Hello")], add_generation_prompt=prompt)
            except ChatTemplateError:
                pass
            except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
                raise ChatTemplateLoadError(
                    f"{origin} does not render one user turn "
                    f"(add_generation_prompt={prompt}): {type(exc).__name__}: {exc}"
                ) from exc

    @property
    def has_own_template(self) -> bool:
        """False when this is the plain default (the checkpoint ships no template)."""
        return self._template is not None

    def render(
        self,
        messages: Sequence[ChatTurn],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt, ending where the assistant's reply starts (without that start when
        ``add_generation_prompt`` is false, as HF's templates take it); raises
        ``ChatTemplateError`` when the template refuses the conversation. ``tools`` (OpenAI's
        list) and the tool turns are written as the template expects them
        (``text/tool_prompt.py``).

        ``continue_final_message``: the prompt ends inside the final message, so the model
        goes on with it (a prefilled reply), as HF's ``apply_chat_template`` cuts it: after
        the message's text, wherever the template put it last. ``template_kwargs``: more
        variables for the template (``enable_thinking``, ...); the names it already gets
        (``TEMPLATE_VARIABLES``) are refused."""
        taken = sorted(set(template_kwargs or ()) & TEMPLATE_VARIABLES)
        if taken:
            raise ChatTemplateError(f"template variables {taken} are set by the server")
        if continue_final_message and not messages:
            raise ChatTemplateError("continue_final_message needs a final message")
        native = template_reads_tools(self.source)
        if self._template is None:
            turns = conversation(messages, tools, native=False)
            text = "".join(f"{t['role']}: {t['content']}\n" for t in turns)
            if continue_final_message:
                return text.removesuffix("\n")
            return text + ("assistant:" if add_generation_prompt else "")
        extra = {"tools": list(tools)} if tools and native else {}
        rendered = str(
            self._template.render(
                messages=conversation(messages, tools, native=native),
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **self._special,
                **extra,
                **(template_kwargs or {}),
            )
        )
        return _open_final(rendered, messages[-1].text()) if continue_final_message else rendered

    def system_tokens(self, messages: Sequence[ChatTurn]) -> int | None:
        """Tokens of the rendered prompt that come from its leading system messages (what
        FairServe weighs as system prompt), or None when they cannot be told apart: no
        tokenizer, or a template whose system part is not a prefix of the prompt."""
        k = 0
        while k < len(messages) and messages[k].role in ("system", "developer"):
            k += 1
        if self.count_tokens is None or k == 0:
            return None if self.count_tokens is None else 0
        if self._template is None:
            prefix = "".join(f"{m.role}: {m.text()}\n" for m in messages[:k])
        else:
            system = [{"role": m.role, "content": m.text()} for m in messages[:k]]
            try:
                prefix = str(
                    self._template.render(
                        messages=system, add_generation_prompt=False, **self._special
                    )
                )
            except ChatTemplateError:
                return None
        return self.count_tokens(prefix) if self.render(messages).startswith(prefix) else None


# What every render gives the template; ``template_kwargs`` may not set them.
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
)


def _open_final(rendered: str, final: str) -> str:
    """``rendered`` cut right after the final message's text (its last occurrence), as HF's
    ``continue_final_message`` cuts it: whatever closes the turn goes, so the model continues
    the message. A template that trims the text's surrounding space is cut after the trimmed
    text."""
    at = rendered.rfind(final.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the template does not write the final message's text"
        )
    whole = final.lstrip()
    kept = whole if rendered[at : at + len(whole)] == whole else final.strip()
    return rendered[: at + len(kept)]


def _raise(message: str) -> None:
    """``raise_exception(...)`` as HF's templates call it."""
    raise ChatTemplateError(message)


def _compile(source: str, origin: str) -> Any:
    """The template in the environment HF's ``apply_chat_template`` renders in: a sandbox
    that trims blocks, ``{% break %}``/``{% continue %}``, the ``{% generation %}`` tag
    (assistant-mask training markers; here it writes its body), ``tojson`` without HTML
    escaping and with ``indent``/``separators``/``sort_keys``, and ``strftime_now``, so
    a checkpoint's template writes the same prompt here as under transformers."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateLoadError(
            f"{origin} does not compile (line {exc.lineno}): {exc.message}"
        ) from exc


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson``: plain ``json.dumps``, not jinja's HTML-safe one, which would write
    ``<`` in a tool's description as ``\\u003c``."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """Today's date as templates write it into their system prompt (Llama 3.x)."""
    from datetime import datetime

    return datetime.now().strftime(format)


def _token(config: dict[str, Any], key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):  # AddedToken serialised as a dict
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tokenizer(model_dir: Path) -> Tokenizer | None:
    """The checkpoint's own tokenizer, when the directory has one."""
    from quanta.text.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except (FileNotFoundError, OSError, ValueError):
        return None
