"""Triton tensors <-> Quanta requests and outputs.

Input names follow Triton's TensorRT-LLM ensemble where they overlap (``text_input``,
``max_tokens``, ``stream``, ...), so existing clients, ``genai-perf`` and the HTTP generate
endpoints work unchanged; scheduling metadata are extra optional inputs. The spec below is the
single source of truth: the backend's ``auto_complete_config`` adds it to every model config.

Parsing works on a ``get(name) -> ndarray | None`` callable, not on ``pb_utils`` objects, so it
is testable without a server.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from quanta.core.errors import InvalidRequestError
from quanta.core.output import TokenLogprob
from quanta.core.request import RequestMetadata, SamplingParams
from quanta.core.stream import RequestMetrics
from quanta.core.structured import StructuredOutput

# (name, Triton data type, dims); every input is optional (text_input or input_ids is checked).
INPUTS: tuple[tuple[str, str, list[int]], ...] = (
    ("text_input", "TYPE_STRING", [1]),
    ("input_ids", "TYPE_INT32", [-1]),
    ("max_tokens", "TYPE_INT32", [1]),
    ("stream", "TYPE_BOOL", [1]),
    ("temperature", "TYPE_FP32", [1]),
    ("top_k", "TYPE_INT32", [1]),
    ("top_p", "TYPE_FP32", [1]),
    ("seed", "TYPE_UINT64", [1]),
    ("stop_words", "TYPE_STRING", [-1]),
    ("end_id", "TYPE_INT32", [1]),
    ("ignore_eos", "TYPE_BOOL", [1]),
    ("tenant", "TYPE_STRING", [1]),
    # Quanta: the gateway sets it true when the tenant comes from an API key; whoever can
    # reach Triton's ports is trusted with it, as with ``tenant``
    ("tenant_authenticated", "TYPE_BOOL", [1]),
    ("app", "TYPE_STRING", [1]),
    ("interaction_id", "TYPE_STRING", [1]),
    ("interaction_stage", "TYPE_INT32", [1]),
    ("interaction_last", "TYPE_BOOL", [1]),
    ("system_tokens", "TYPE_INT32", [1]),
    ("priority_class", "TYPE_STRING", [1]),
    ("ttft_slo_ms", "TYPE_FP32", [1]),
    ("tpot_slo_ms", "TYPE_FP32", [1]),
    # TensorRT-LLM's names for the sampler's other features, with their dtypes.
    ("repetition_penalty", "TYPE_FP32", [1]),
    ("presence_penalty", "TYPE_FP32", [1]),
    ("frequency_penalty", "TYPE_FP32", [1]),
    ("min_tokens", "TYPE_INT32", [1]),
    ("min_length", "TYPE_INT32", [1]),  # TensorRT-LLM's older name of min_tokens
    ("bad_words", "TYPE_STRING", [-1]),
    ("return_log_probs", "TYPE_BOOL", [1]),
    ("top_log_probs", "TYPE_INT32", [1]),  # Quanta: also the N most likely tokens' (0-20)
    ("return_prompt_log_probs", "TYPE_BOOL", [1]),  # Quanta: the prompt tokens' too (echo)
    ("exclude_input_in_output", "TYPE_BOOL", [1]),
    ("beam_width", "TYPE_INT32", [1]),  # 1 only
    ("num_return_sequences", "TYPE_INT32", [1]),  # 1-16 sequences, seeded seed + i
    ("pad_id", "TYPE_INT32", [1]),  # accepted: nothing is padded
    ("return_context_logits", "TYPE_BOOL", [1]),  # false only
    ("return_generation_logits", "TYPE_BOOL", [1]),  # false only
    # TensorRT-LLM's structured output: the type (json, json_schema, regex, ebnf_grammar;
    # Quanta adds choice, a JSON array of strings) and the guide (empty for json).
    ("guided_decoding_guide_type", "TYPE_STRING", [1]),
    ("guided_decoding_guide", "TYPE_STRING", [1]),
    # Quanta: true makes this a control request of its own (no other input): the engine
    # forgets every cached prefix, and the answer is one empty final response.
    ("reset_prefix_cache", "TYPE_BOOL", [1]),
    # Quanta: true makes this a health check of the engine (no other input is read): an
    # empty final response while the engine serves, else an error saying why not.
    ("health_check", "TYPE_BOOL", [1]),
)
OUTPUTS: tuple[tuple[str, str, list[int]], ...] = (
    ("text_output", "TYPE_STRING", [1]),
    ("output_ids", "TYPE_INT32", [-1]),
    ("finish_reason", "TYPE_STRING", [1]),
    ("arrival_time_ns", "TYPE_INT64", [1]),
    ("first_token_time_ns", "TYPE_INT64", [1]),
    ("finish_time_ns", "TYPE_INT64", [1]),
    ("num_prompt_tokens", "TYPE_INT32", [1]),
    ("num_output_tokens", "TYPE_INT32", [1]),
    ("num_preemptions", "TYPE_INT32", [1]),
    ("num_cached_tokens", "TYPE_INT32", [1]),  # prompt tokens found in the prefix cache
    ("sequence_length", "TYPE_INT32", [1]),  # tokens in this response's output_ids
    ("cum_log_probs", "TYPE_FP32", [1]),  # with return_log_probs, on the final response
    ("output_log_probs", "TYPE_FP32", [-1]),  # with return_log_probs: one per output id
    ("top_log_prob_ids", "TYPE_INT32", [-1]),  # with top_log_probs N: N per output id
    ("top_log_probs", "TYPE_FP32", [-1]),  # their log-probabilities, in the same order
    ("sequence_index", "TYPE_INT32", [1]),  # with num_return_sequences > 1: which one
    # with return_prompt_log_probs, once (first response): the prompt's token ids, and the
    # log-probabilities of all but the first (top_log_probs N: N alternatives each)
    ("prompt_ids", "TYPE_INT32", [-1]),
    ("prompt_log_probs", "TYPE_FP32", [-1]),
    ("prompt_top_log_prob_ids", "TYPE_INT32", [-1]),
    ("prompt_top_log_probs", "TYPE_FP32", [-1]),
)
# The tensorrt_llm layout declares a batch dimension (as TensorRT-LLM's configs do) of one
# request per Triton request; the engine batches across requests itself.
TRTLLM_MAX_BATCH = 1
# Outputs only the tensorrt_llm layout has: its clients ask for them.
TRTLLM_OUTPUTS: tuple[tuple[str, str, list[int]], ...] = (
    ("batch_index", "TYPE_INT32", [1]),  # always 0: one request per Triton request
)

# numpy kinds accepted per Triton type: Triton already enforces the configured type, this is the
# second line of defence for hand-made configs and the unit tests.
_KINDS = {
    "TYPE_STRING": "OSU",
    "TYPE_INT32": "iu",
    "TYPE_UINT64": "iu",
    "TYPE_FP32": "fiu",
    "TYPE_BOOL": "b",
}
_SAMPLING_INPUTS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "min_tokens": "min_tokens",
}
MAX_SEQUENCES = 16  # num_return_sequences: each is a request of its own in the engine
# Inputs TensorRT-LLM clients send whose only meaningful value here is the default.
_ONLY = {
    "beam_width": (1, "beam search is not supported"),
    "return_context_logits": (False, "logits are not returned; ask for return_log_probs"),
    "return_generation_logits": (False, "logits are not returned; ask for return_log_probs"),
}
_METADATA_INPUTS = tuple(RequestMetadata.model_fields)  # NOTE: each one is also in INPUTS
_RESET = "reset_prefix_cache"  # the control input: see is_reset_request

Getter = Callable[[str], "np.ndarray | None"]


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
    for name, dtype, dims in INPUTS:
        array = get(name)
        if array is not None:
            values[name] = _value(name, dtype, dims, array)
    prompt = _prompt(values)
    for name, (allowed, why) in _ONLY.items():
        if name in values and values[name] != allowed:
            raise InvalidRequestError(f"input '{name}' must be {allowed}: {why}")
    n = values.get("num_return_sequences", 1)
    if not 1 <= n <= MAX_SEQUENCES:
        raise InvalidRequestError(f"input 'num_return_sequences' must be 1 to {MAX_SEQUENCES}")
    min_length = values.get("min_length")
    if min_length is not None and values.setdefault("min_tokens", min_length) != min_length:
        raise InvalidRequestError("min_tokens and min_length (its older name) differ")
    sampling = {key: values[name] for name, key in _SAMPLING_INPUTS.items() if name in values}
    top_log_probs = values.get("top_log_probs", 0)
    return_log_probs = bool(values.get("return_log_probs", False)) or top_log_probs > 0
    if return_log_probs:
        sampling["logprobs"] = top_log_probs
    return_prompt_log_probs = bool(values.get("return_prompt_log_probs", False))
    if return_prompt_log_probs:
        sampling["prompt_logprobs"] = top_log_probs
    if "stop_words" in values:
        sampling["stop"] = tuple(values["stop_words"])
    if "end_id" in values:
        sampling["stop_token_ids"] = (values["end_id"],)
    guided = _structured_output(values)
    if guided is not None:
        sampling["structured_output"] = guided
    metadata = {name: values[name] for name in _METADATA_INPUTS if name in values}
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
    )


def is_reset_request(get: Getter, parameters: str | None = None) -> bool:
    """Whether the request asks for a prefix-cache reset (``reset_prefix_cache`` true) rather
    than a generation; raises ``InvalidRequestError`` for a malformed one.

    A reset is a request of its own: next to a prompt or any other input it is refused, so a
    client never has to guess whether its generation ran, or ran before or after the reset.
    """
    array = get(_RESET)
    if array is None or not _value(_RESET, "TYPE_BOOL", [1], array):
        return False
    _refuse_unknown_fields(parameters)
    others = [name for name, _, _ in INPUTS if name != _RESET and get(name) is not None]
    if others:
        raise InvalidRequestError(
            f"input '{_RESET}' makes a request of its own and takes no other input; "
            f"got {', '.join(others)}"
        )
    return True


def _value(name: str, dtype: str, dims: list[int], array: Any) -> Any:
    """One input's value (a scalar for dims [1], else a list), checked against its spec."""
    array = np.asarray(array)
    if array.dtype.kind not in _KINDS[dtype]:
        raise InvalidRequestError(
            f"input '{name}' must be {dtype.removeprefix('TYPE_')}, got {array.dtype}"
        )
    if dims != [1]:
        return [_scalar(name, v) for v in array.reshape(-1)]
    if array.size != 1:
        raise InvalidRequestError(
            f"input '{name}' must hold exactly one value, got shape {list(array.shape)}"
        )
    return _scalar(name, array.reshape(-1)[0])


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
    names = [name for name, _, _ in INPUTS]
    hints = [
        f"'{key}' (did you mean '{close[0]}'?)"
        if (close := difflib.get_close_matches(key, names, n=1))
        else f"'{key}'"
        for key in unknown
    ]
    raise InvalidRequestError(
        f"unknown input {', '.join(hints)}; this model's inputs are {', '.join(names)}"
    )


# TensorRT-LLM's guide types -> ``StructuredOutput`` kinds (``choice`` is Quanta's own).
GUIDE_TYPES = {
    "json": "json_object",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf_grammar": "grammar",
    "choice": "choice",
}


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
        raise InvalidRequestError(validation_message(exc, rename=_PARAM_TO_INPUT)) from None


_PARAM_TO_INPUT = {"stop": "stop_words", "stop_token_ids": "end_id", "logprobs": "top_log_probs"}


def validation_message(exc: ValidationError, rename: dict[str, str] | None = None) -> str:
    """One line per problem, ``name: message``, using the names the client sent."""
    rename = rename or {}
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        loc = rename.get(loc, loc)
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


def output_arrays(
    text: str,
    token_ids: list[int] | tuple[int, ...],
    *,
    finish_reason: str | None = None,
    metrics: RequestMetrics | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    top: int = 0,
    cumulative_logprob: float | None = None,
    sequence_index: int | None = None,
    prompt_ids: Sequence[int] = (),
    prompt_logprobs: Sequence[TokenLogprob] | None = None,
) -> dict[str, np.ndarray]:
    """Output tensors of one response; the final one also carries timing and accounting."""
    arrays = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int32),
        "sequence_length": np.array([len(token_ids)], dtype=np.int32),
    }
    if sequence_index is not None:
        arrays["sequence_index"] = np.array([sequence_index], dtype=np.int32)
    if logprobs is not None:
        arrays.update(_logprob_arrays("", logprobs, top))
    if prompt_logprobs is not None:
        arrays["prompt_ids"] = np.array(prompt_ids, dtype=np.int32)
        arrays.update(_logprob_arrays("prompt_", prompt_logprobs, top))
    if cumulative_logprob is not None:
        arrays["cum_log_probs"] = np.array([cumulative_logprob], dtype=np.float32)
    if finish_reason is not None:
        arrays["finish_reason"] = np.array([finish_reason.encode()], dtype=np.object_)
    if metrics is not None:
        arrays.update(
            arrival_time_ns=_ns(metrics.arrival_time),
            first_token_time_ns=_ns(metrics.first_token_time),
            finish_time_ns=_ns(metrics.finish_time),
            num_prompt_tokens=np.array([metrics.num_prompt_tokens], dtype=np.int32),
            num_output_tokens=np.array([metrics.num_output_tokens], dtype=np.int32),
            num_preemptions=np.array([metrics.num_preemptions], dtype=np.int32),
            num_cached_tokens=np.array([metrics.num_cached_tokens], dtype=np.int32),
        )
    return arrays


def _logprob_arrays(prefix: str, logprobs: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """``{prefix}output_log_probs`` (``prompt_log_probs`` for the prompt) and, with ``top``,
    the alternatives, ``top`` per token, flattened."""
    name = "prompt_log_probs" if prefix else "output_log_probs"
    arrays = {name: np.array([lp.logprob for lp in logprobs], dtype=np.float32)}
    if top:
        rows = [lp.top[:top] for lp in logprobs]
        ids = [t for row in rows for t, _ in row]
        arrays[f"{prefix}top_log_prob_ids"] = np.array(ids, dtype=np.int32)
        arrays[f"{prefix}top_log_probs"] = np.array([v for row in rows for _, v in row], np.float32)
    return arrays


def _ns(seconds: float | None) -> np.ndarray:
    """Loop-clock seconds (wall clock in servers) as int64 ns; 0 when the event never came."""
    return np.array([0 if seconds is None else round(seconds * 1e9)], dtype=np.int64)
