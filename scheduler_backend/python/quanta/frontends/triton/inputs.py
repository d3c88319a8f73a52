"""The Triton model's inputs: one table, and the two directions generated from it.

Every input tensor is declared once in ``INPUTS``: its name, Triton type, shape, what it means
and, for most, the ``SamplingParams`` or ``RequestMetadata`` field it carries one to one. From
that table come the config the backend's ``auto_complete_config`` adds to every model, the
client side (``request_inputs``: a request as JSON-able values keyed by tensor name, for
Triton's HTTP generate endpoints or ``tritonclient`` tensors), the backend side
(``parse_request``: tensors back into sampling settings, metadata and per-request options) and
the input table of ``docs/triton-api.md`` (``input_table``, kept in step by a test).

Names follow Triton's TensorRT-LLM ensemble where they overlap (``text_input``, ``max_tokens``,
``stream``, ...), so existing clients, ``genai-perf`` and the HTTP generate endpoints work
unchanged; scheduling metadata and Quanta's features are extra optional inputs. A handful of
inputs are not one-to-one with a field (the prompt, log-probabilities, guided decoding, the
control requests); their rules are the functions below the table, named after them.

Parsing works on a ``get(name) -> ndarray | None`` callable, not on ``pb_utils`` objects, so it
is testable without a server.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from quanta.core.errors import InvalidRequestError
from quanta.core.pooling import PoolingParams
from quanta.core.request import RequestMetadata, SamplingParams
from quanta.core.structured import StructuredOutput


@dataclass(frozen=True, slots=True)
class TritonType:
    """One Triton data type: the numpy kinds a backend accepts for it (Triton already enforces
    the configured type; this is the second line of defence for hand-made configs and the unit
    tests), and the numpy type and wire name a client sends it as."""

    kinds: str
    numpy: type[np.generic]
    wire: str


TYPES = {
    "TYPE_STRING": TritonType("OSU", np.object_, "BYTES"),
    "TYPE_INT32": TritonType("iu", np.int32, "INT32"),
    "TYPE_UINT64": TritonType("iu", np.uint64, "UINT64"),
    "TYPE_FP32": TritonType("fiu", np.float32, "FP32"),
    "TYPE_BOOL": TritonType("b", np.bool_, "BOOL"),
}


@dataclass(frozen=True, slots=True)
class Input:
    """One optional input tensor (``text_input`` or ``input_ids`` is checked by the parser).

    ``sampling`` / ``metadata``: the field it carries one to one; ``to_param`` / ``to_tensor``
    convert where the tensor's form differs from the field's. A client sends such an input
    when its field differs from the default, or always (``always_sent``). ``only``: an input
    TensorRT-LLM clients send that is accepted at this one value, refused otherwise with why.
    """

    name: str
    dtype: str
    meaning: str
    many: bool = False  # dims [-1] (a list), else [1] (one value)
    sampling: str | None = None
    metadata: str | None = None
    always_sent: bool = False
    to_param: Callable[[Any], Any] | None = None
    to_tensor: Callable[[Any], Any] | None = None
    only: tuple[Any, str] | None = None

    @property
    def dims(self) -> list[int]:
        return [-1] if self.many else [1]


def _one_stop_token(ids: tuple[int, ...]) -> int:
    if len(ids) != 1:
        raise ValueError("the Triton frontend takes one stop token id (end_id)")
    return ids[0]


def _json_object(name: str, text: str) -> dict[str, Any]:
    """An input that carries a JSON object as text; anything else is refused naming it."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"input '{name}' is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"input '{name}' must be a JSON object")
    return value


MAX_SEQUENCES = 16  # num_return_sequences: each is a request of its own in the engine
_S, _I, _U, _F, _B = "TYPE_STRING", "TYPE_INT32", "TYPE_UINT64", "TYPE_FP32", "TYPE_BOOL"

INPUTS: tuple[Input, ...] = (
    # -- the prompt: one of the two ---------------------------------------------------------
    Input("text_input", _S, "the prompt as text"),
    Input("input_ids", _I, "the prompt as token ids", many=True),
    # -- sampling (TensorRT-LLM's names) ----------------------------------------------------
    Input("max_tokens", _I, "most tokens to generate", sampling="max_tokens", always_sent=True),
    Input("stream", _B, "true: a response per new piece of text; false: one response"),
    Input("temperature", _F, "0 is greedy", sampling="temperature", always_sent=True),
    Input("top_k", _I, "0: off", sampling="top_k", always_sent=True),
    Input("top_p", _F, "1: off", sampling="top_p", always_sent=True),
    Input(
        "min_p",
        _F,
        "0: off; drops tokens under min_p x the top one's probability",
        sampling="min_p",
    ),
    Input("seed", _U, "the random stream; sequence i of several uses seed + i", sampling="seed"),
    Input("stop_words", _S, "strings that end the output", many=True, sampling="stop"),
    Input(
        "end_id",
        _I,
        "a token id that ends the output",
        sampling="stop_token_ids",
        to_param=lambda v: (v,),
        to_tensor=_one_stop_token,
    ),
    Input("ignore_eos", _B, "go on past the end-of-sequence token", sampling="ignore_eos"),
    # -- scheduling metadata (Quanta) -------------------------------------------------------
    Input("tenant", _S, "who sent it: fair sharing's unit", metadata="tenant"),
    # NOTE: the gateway sets it true when the tenant comes from an API key; whoever can reach
    # Triton's ports is trusted with it, as with ``tenant``.
    Input(
        "tenant_authenticated",
        _B,
        "the tenant comes from a credential (set by the gateway)",
        metadata="tenant_authenticated",
    ),
    Input("app", _S, "the application", metadata="app"),
    Input("interaction_id", _S, "the interaction its calls share", metadata="interaction_id"),
    Input(
        "interaction_stage",
        _I,
        "the call's index in its interaction, 0 first",
        metadata="interaction_stage",
    ),
    Input("interaction_last", _B, "this call answers the user", metadata="interaction_last"),
    Input(
        "system_tokens",
        _I,
        "leading prompt tokens that are system prompt",
        metadata="system_tokens",
    ),
    Input("priority_class", _S, "online or offline", metadata="priority_class"),
    Input("ttft_slo_ms", _F, "time-to-first-token objective", metadata="ttft_slo_ms"),
    Input("tpot_slo_ms", _F, "time-per-output-token objective", metadata="tpot_slo_ms"),
    # -- the sampler's other features (TensorRT-LLM's names and types) ----------------------
    Input(
        "repetition_penalty",
        _F,
        "HF's, over prompt and output; 1: off",
        sampling="repetition_penalty",
    ),
    Input("presence_penalty", _F, "OpenAI's, over the output; 0: off", sampling="presence_penalty"),
    Input(
        "frequency_penalty", _F, "OpenAI's, over the output; 0: off", sampling="frequency_penalty"
    ),
    Input(
        "min_tokens", _I, "tokens before EOS or end_id may end the output", sampling="min_tokens"
    ),
    Input("min_length", _I, "TensorRT-LLM's older name of min_tokens"),
    Input("bad_words", _S, "strings never generated (tokenized by the engine)", many=True),
    Input(
        "logit_bias",
        _S,
        'OpenAI\'s, as a JSON object: {"token id": bias in [-100, 100]} added to the logits',
        sampling="logit_bias",
        to_param=lambda text: _json_object("logit_bias", text),
        to_tensor=lambda bias: json.dumps({str(t): b for t, b in bias.items()}),
    ),
    Input("return_log_probs", _B, "log-probabilities of the output tokens"),
    Input("top_log_probs", _I, "also the N most likely tokens' (0-20); implies return_log_probs"),
    Input("return_prompt_log_probs", _B, "the prompt tokens' too (echo)"),
    Input("exclude_input_in_output", _B, "false: a non-streamed answer repeats the prompt"),
    Input("beam_width", _I, "1 only", only=(1, "beam search is not supported")),
    Input("num_return_sequences", _I, f"1-{MAX_SEQUENCES} sequences, seeded seed + i"),
    Input("pad_id", _I, "accepted: nothing is padded"),
    Input(
        "return_context_logits",
        _B,
        "false only",
        only=(False, "logits are not returned; ask for return_log_probs"),
    ),
    Input(
        "return_generation_logits",
        _B,
        "false only",
        only=(False, "logits are not returned; ask for return_log_probs"),
    ),
    # -- TensorRT-LLM's structured output ----------------------------------------------------
    Input("guided_decoding_guide_type", _S, "json, json_schema, regex, ebnf_grammar or choice"),
    Input("guided_decoding_guide", _S, "the schema, regex, grammar or JSON array of choices"),
    # -- embeddings (Quanta): the prompt's pooled hidden states instead of generated text ---
    Input("pooling", _S, "LAST or MEAN: embed the prompt (output embedding), generate nothing"),
    Input("normalize", _B, "with pooling: scale the embedding to unit L2 norm (default true)"),
    # -- control requests (Quanta): a request of their own, no other input -------------------
    Input("reset_prefix_cache", _B, "true: the engine forgets every cached prefix"),
    Input("health_check", _B, "true: an empty final response while the engine serves"),
)
BY_NAME = {i.name: i for i in INPUTS}
# ``SamplingParams`` fields no input carries one to one: bad words go as text (``bad_words``),
# the log-probabilities and the guide through the rules below (a test holds the table to it).
SAMPLING_BY_RULE = frozenset({"bad_words_ids", "logprobs", "prompt_logprobs", "structured_output"})
_RESET = "reset_prefix_cache"  # the control input: see is_reset_request
HEALTH_INPUT = "health_check"  # the control input of a health check (read by the backend)

# TensorRT-LLM's guide types -> ``StructuredOutput`` kinds (``choice`` is Quanta's own).
GUIDE_TYPES = {
    "json": "json_object",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf_grammar": "grammar",
    "choice": "choice",
}

Getter = Callable[[str], "np.ndarray | None"]


# -- client side: a request -> tensors ----------------------------------------------------------
def request_inputs(
    prompt: str | list[int],
    params: SamplingParams,
    *,
    stream: bool,
    metadata: RequestMetadata | None = None,
    pooling: PoolingParams | None = None,
) -> dict[str, Any]:
    """The model inputs for one request, as JSON-able values keyed by tensor name; raises
    ``ValueError`` for settings no input can carry. With ``pooling`` the request embeds its
    prompt (``params`` are then not used)."""
    inputs: dict[str, Any] = (
        {"input_ids": list(prompt)} if isinstance(prompt, list) else {"text_input": prompt}
    )
    # the answer only, also from a model in the tensorrt_llm layout (which echoes)
    inputs |= {"stream": stream, "exclude_input_in_output": True}
    defaults = SamplingParams()
    for spec in INPUTS:
        if spec.sampling is None:
            continue
        value = getattr(params, spec.sampling)
        if spec.always_sent or value != getattr(defaults, spec.sampling):
            value = spec.to_tensor(value) if spec.to_tensor is not None else value
            inputs[spec.name] = list(value) if spec.many else value
    if params.bad_words_ids:
        raise ValueError("the Triton frontend takes bad words as text (the bad_words input)")
    inputs |= _log_probs_inputs(params) | _guide_inputs(params.structured_output)
    if metadata is not None:
        given = metadata.model_dump(exclude_none=True)
        inputs |= {s.name: given[s.metadata] for s in INPUTS if s.metadata in given}
    if pooling is not None:
        inputs |= {"pooling": pooling.pooling_type, "normalize": pooling.normalize}
    return inputs


def _log_probs_inputs(params: SamplingParams) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    if params.logprobs is not None:
        inputs["return_log_probs"] = True
    if params.prompt_logprobs is not None:
        inputs["return_prompt_log_probs"] = True
    top = {params.logprobs or 0, params.prompt_logprobs or 0} - {0}
    if len(top) > 1:
        raise ValueError("the Triton frontend takes one top_log_probs for output and prompt")
    if top:
        inputs["top_log_probs"] = top.pop()
    return inputs


def _guide_inputs(guided: StructuredOutput | None) -> dict[str, Any]:
    if guided is None:
        return {}
    kind = next(name for name, kind in GUIDE_TYPES.items() if kind == guided.kind)
    inputs: dict[str, Any] = {"guided_decoding_guide_type": kind}
    if guided.kind != "json_object":
        inputs["guided_decoding_guide"] = guided.guide
    return inputs


# -- backend side: tensors -> a request -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What one Triton request asks for, validated."""

    prompt: str | list[int]
    params: SamplingParams
    metadata: RequestMetadata
    stream: bool
    echo: bool = False  # exclude_input_in_output: false: a non-streamed answer repeats the prompt
    return_log_probs: bool = False
    top_log_probs: int = 0
    return_prompt_log_probs: bool = False
    num_return_sequences: int = 1
    bad_words: tuple[str, ...] = ()  # tokenized by the engine into SamplingParams.bad_words_ids
    pooling: PoolingParams | None = None  # an embedding request (``core/pooling.py``)


def parse_request(
    get: Getter, parameters: str | None = None, *, echo_by_default: bool = False
) -> ParsedRequest:
    """Read and validate every input; raises ``InvalidRequestError`` naming the bad input.

    ``echo_by_default``: TensorRT-LLM's default, a non-streamed answer repeats the prompt
    unless ``exclude_input_in_output`` is true (the ``tensorrt_llm`` layout).
    ``parameters`` is the request's parameters as Triton hands them over (a JSON object):
    Triton's HTTP generate endpoint turns every field that names no input into one, so a
    misspelt ``max_token`` arrives there and is refused, as gRPC refuses an unknown input.
    """
    _refuse_unknown_fields(parameters)
    values: dict[str, Any] = {}
    for spec in INPUTS:
        array = get(spec.name)
        if array is not None:
            values[spec.name] = _value(spec, array)
    prompt = _prompt(values)
    for spec in INPUTS:
        if spec.only is not None and spec.name in values and values[spec.name] != spec.only[0]:
            raise InvalidRequestError(f"input '{spec.name}' must be {spec.only[0]}: {spec.only[1]}")
    n = values.get("num_return_sequences", 1)
    if not 1 <= n <= MAX_SEQUENCES:
        raise InvalidRequestError(f"input 'num_return_sequences' must be 1 to {MAX_SEQUENCES}")
    min_length = values.get("min_length")
    if min_length is not None and values.setdefault("min_tokens", min_length) != min_length:
        raise InvalidRequestError("min_tokens and min_length (its older name) differ")
    sampling = {
        spec.sampling: spec.to_param(values[spec.name]) if spec.to_param else values[spec.name]
        for spec in INPUTS
        if spec.sampling is not None and spec.name in values
    }
    top_log_probs = values.get("top_log_probs", 0)
    return_log_probs = bool(values.get("return_log_probs", False)) or top_log_probs > 0
    if return_log_probs:
        sampling["logprobs"] = top_log_probs
    return_prompt_log_probs = bool(values.get("return_prompt_log_probs", False))
    if return_prompt_log_probs:
        sampling["prompt_logprobs"] = top_log_probs
    guided = _structured_output(values)
    if guided is not None:
        sampling["structured_output"] = guided
    metadata = {
        spec.metadata: values[spec.name]
        for spec in INPUTS
        if spec.metadata is not None and spec.name in values
    }
    return ParsedRequest(
        prompt=prompt,
        params=_validated(SamplingParams, sampling),
        metadata=_validated(RequestMetadata, metadata),
        stream=bool(values.get("stream", False)),
        echo=not values.get("exclude_input_in_output", not echo_by_default),
        return_log_probs=return_log_probs,
        top_log_probs=top_log_probs,
        return_prompt_log_probs=return_prompt_log_probs,
        num_return_sequences=n,
        bad_words=tuple(values.get("bad_words", ())),
        pooling=_pooling(values, n),
    )


def is_reset_request(get: Getter, parameters: str | None = None) -> bool:
    """Whether the request asks for a prefix-cache reset (``reset_prefix_cache`` true) rather
    than a generation; raises ``InvalidRequestError`` for a malformed one.

    A reset is a request of its own: next to a prompt or any other input it is refused, so a
    client never has to guess whether its generation ran, or ran before or after the reset.
    """
    array = get(_RESET)
    if array is None or not _value(BY_NAME[_RESET], array):
        return False
    _refuse_unknown_fields(parameters)
    others = [spec.name for spec in INPUTS if spec.name != _RESET and get(spec.name) is not None]
    if others:
        raise InvalidRequestError(
            f"input '{_RESET}' makes a request of its own and takes no other input; "
            f"got {', '.join(others)}"
        )
    return True


def _value(spec: Input, array: Any) -> Any:
    """One input's value (a scalar for dims [1], else a list), checked against its spec."""
    array = np.asarray(array)
    if array.dtype.kind not in TYPES[spec.dtype].kinds:
        raise InvalidRequestError(
            f"input '{spec.name}' must be {spec.dtype.removeprefix('TYPE_')}, got {array.dtype}"
        )
    if spec.many:
        return [_scalar(spec.name, v) for v in array.reshape(-1)]
    if array.size != 1:
        raise InvalidRequestError(
            f"input '{spec.name}' must hold exactly one value, got shape {list(array.shape)}"
        )
    return _scalar(spec.name, array.reshape(-1)[0])


def _refuse_unknown_fields(parameters: str | None) -> None:
    """Custom request parameters mean nothing to this model; Triton's own (``triton_*``)
    are left to Triton."""
    if not parameters:
        return
    try:
        given = json.loads(parameters)
    except ValueError:
        return  # not ours to judge: Triton built it
    unknown = sorted(k for k in given if not str(k).startswith("triton_"))
    if not unknown:
        return
    names = [spec.name for spec in INPUTS]
    hints = [
        f"'{key}' (did you mean '{close[0]}'?)"
        if (close := difflib.get_close_matches(key, names, n=1))
        else f"'{key}'"
        for key in unknown
    ]
    raise InvalidRequestError(
        f"unknown input {', '.join(hints)}; this model's inputs are {', '.join(names)}"
    )


def _structured_output(values: dict[str, Any]) -> StructuredOutput | None:
    kind = values.get("guided_decoding_guide_type")
    guide = values.get("guided_decoding_guide")
    if kind is None:
        if guide is not None:
            raise InvalidRequestError(
                "input 'guided_decoding_guide' needs 'guided_decoding_guide_type'"
            )
        return None
    if kind not in GUIDE_TYPES:
        raise InvalidRequestError(
            f"input 'guided_decoding_guide_type' must be one of {', '.join(GUIDE_TYPES)}, "
            f"got {kind!r}"
        )
    if kind != "json" and not guide:
        raise InvalidRequestError(
            f"guided_decoding_guide_type {kind} needs a guided_decoding_guide"
        )
    try:
        return StructuredOutput.from_guide(GUIDE_TYPES[kind], guide or "")
    except ValidationError as exc:
        detail = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise InvalidRequestError(f"input 'guided_decoding_guide': {detail}") from None
    except ValueError as exc:
        raise InvalidRequestError(f"input 'guided_decoding_guide': {exc}") from None


def _pooling(values: dict[str, Any], num_return_sequences: int) -> PoolingParams | None:
    """An embedding request's pooling, from ``pooling`` and ``normalize``."""
    if "pooling" not in values:
        if "normalize" in values:
            raise InvalidRequestError("input 'normalize' needs 'pooling' (LAST or MEAN)")
        return None
    if num_return_sequences != 1:
        raise InvalidRequestError("input 'pooling' makes one embedding: num_return_sequences 1")
    fields = {"pooling_type": values["pooling"], "normalize": values.get("normalize", True)}
    try:
        return PoolingParams(**fields)
    except ValidationError:
        raise InvalidRequestError(
            f"input 'pooling' must be LAST or MEAN, got {values['pooling']!r}"
        ) from None


def _prompt(values: dict[str, Any]) -> str | list[int]:
    if "text_input" in values and "input_ids" in values:
        raise InvalidRequestError("give either text_input or input_ids, not both")
    if "input_ids" in values:
        return [int(t) for t in values["input_ids"]]
    if "text_input" in values:
        return str(values["text_input"])
    raise InvalidRequestError("missing input: give text_input (a string) or input_ids")


def _scalar(name: str, value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"input '{name}' is not valid UTF-8") from None
    if isinstance(value, np.generic):
        return value.item()
    return value


def _validated(model: type[Any], fields: dict[str, Any]) -> Any:
    try:
        return model(**fields)
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc, rename=_FIELD_TO_INPUT)) from None


# A bad value is reported under the input's name where it differs from the field's.
_FIELD_TO_INPUT = {
    s.sampling: s.name for s in INPUTS if s.sampling is not None and s.sampling != s.name
} | {"logprobs": "top_log_probs"}


def validation_message(exc: ValidationError, rename: dict[str, str] | None = None) -> str:
    """One line per problem, ``name: message``, using the names the client sent."""
    rename = rename or {}
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        loc = rename.get(loc, loc)
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


def input_table() -> str:
    """The inputs as the Markdown table of ``docs/triton-api.md``; a default is the field's
    own, so the page cannot drift from the models."""
    rows = ["| input | type | shape | default | meaning |", "|---|---|---|---|---|"]
    for spec in INPUTS:
        kind = spec.dtype.removeprefix("TYPE_")
        rows.append(f"| `{spec.name}` | {kind} | {spec.dims} | {_default(spec)} | {spec.meaning} |")
    return "\n".join(rows)


def _default(spec: Input) -> str:
    if spec.sampling is not None:
        value = SamplingParams.model_fields[spec.sampling].get_default()
    elif spec.metadata is not None:
        value = RequestMetadata.model_fields[spec.metadata].get_default()
    elif spec.only is not None:
        value = spec.only[0]
    else:
        return "-"
    if value is None or value == ():
        return "none"
    return f"`{json.dumps(value)}`"
