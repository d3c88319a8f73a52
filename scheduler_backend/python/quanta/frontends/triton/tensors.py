"""The Triton model's outputs: the tensors each response carries, built from a request's output.

The inputs and their parsing are ``inputs.py``; the backend's ``auto_complete_config`` adds both
lists to every model config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from quanta.core.output import TokenLogprob
from quanta.core.stream import RequestMetrics

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
    # with pooling, on the final response: the prompt's embedding (``core/pooling.py``)
    ("embedding", "TYPE_FP32", [-1]),
)
# The tensorrt_llm layout declares a batch dimension (as TensorRT-LLM's configs do) of one
# request per Triton request; the engine batches across requests itself.
TRTLLM_MAX_BATCH = 1
# Outputs only the tensorrt_llm layout has: its clients ask for them.
TRTLLM_OUTPUTS: tuple[tuple[str, str, list[int]], ...] = (
    ("batch_index", "TYPE_INT32", [1]),  # always 0: one request per Triton request
)


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
    embedding: Sequence[float] | None = None,
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
    if embedding is not None:
        arrays["embedding"] = np.array(embedding, dtype=np.float32)
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
