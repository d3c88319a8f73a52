"""The Triton Python-based backend ``quanta``: one ``EngineLoop`` per model instance.

Shaped like Triton's vLLM backend: decoupled mode (enforced by ``auto_complete_config``),
``execute()`` only validates, converts and submits, the engine runs on its own thread, a
response thread sends the outputs, and cancellation goes through the engine's normal abort path.
``triton_python_backend_utils`` exists only inside Triton's stub process, so it is imported in
``initialize`` and handed to the parts that need it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from quanta.core.errors import EngineDeadError, EngineStepError, QuantaError, ShuttingDownError
from quanta.core.faults import ENV as FAULTS_ENV
from quanta.core.faults import FaultPlan
from quanta.core.loop import LoopHealth
from quanta.core.stream import RequestOutput
from quanta.core.watchdog import Watchdog
from quanta.frontends.triton.drain import DrainWatch, drain_dir_from_env
from quanta.frontends.triton.inputs import HEALTH_INPUT, INPUTS, is_reset_request, parse_request
from quanta.frontends.triton.metrics import FinishedRecord, MetricsReporter, PrefilledRecord
from quanta.frontends.triton.responder import (
    InflightRequest,
    Reply,
    Responder,
    SequenceGroupSender,
)
from quanta.frontends.triton.settings import (
    load_model_config,
    parameters_from_model_config,
    parse_parameters,
)
from quanta.frontends.triton.tensors import OUTPUTS, TRTLLM_MAX_BATCH, TRTLLM_OUTPUTS

log = logging.getLogger(__name__)

_ERROR_CODES = {
    "invalid_argument": "INVALID_ARG",
    # NOTE: the Python backend has no RESOURCE_EXHAUSTED; UNAVAILABLE is the closest status
    # (HTTP 503), and the message's tag says what it really is.
    "resource_exhausted": "UNAVAILABLE",
    "cancelled": "CANCELLED",
    "shutting_down": "UNAVAILABLE",
    "internal": "INTERNAL",
}
_DRAINING = "the server is shutting down and takes no new requests; retry on another replica"
_FINISH_LABELS = {
    "invalid_argument": "invalid",
    "resource_exhausted": "throttled",
    "cancelled": "abort",
    "shutting_down": "shutdown",
    "internal": "error",
}


def _use_environment_locale() -> None:
    """Apply the environment's character locale, which Triton's embedded interpreter never
    does: without it files open as ASCII, and torch.compile (the compiled decode attention)
    fails on its UTF-8 templates. Falls back to C.UTF-8, which every glibc has."""
    import locale

    for name in ("", "C.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
        if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            return


def _layout(model_config: dict[str, Any]) -> str:
    raw = (model_config.get("parameters") or {}).get("io_layout") or {}
    return str(raw.get("string_value") or "quanta")


class TritonResponses:
    """``ResponseFactory`` over ``pb_utils``: output tensors or a typed ``TritonError``."""

    def __init__(self, pb_utils: Any, *, batch_dim: bool = False) -> None:
        self._pb = pb_utils
        self._batch_dim = batch_dim  # the TensorRT-LLM layout: every output is [1, ...]
        self.final_flag: int = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def response(self, arrays: dict[str, Any]) -> Any:
        if self._batch_dim:
            # NOTE: as TensorRT-LLM's models answer: text_output is [1] (its clients read
            # text_output[0] as bytes), every other output gets the batch dimension.
            arrays = {"batch_index": np.zeros(1, dtype=np.int32), **arrays}
            arrays = {
                name: value if name == "text_output" else value[None, ...]
                for name, value in arrays.items()
            }
        tensors = [self._pb.Tensor(name, value) for name, value in arrays.items()]
        return self._pb.InferenceResponse(output_tensors=tensors)

    def error(self, code: str, message: str) -> Any:
        """The message starts with ``[code]``: a gRPC stream error carries no status, so this
        tag is how a client (the OpenAI gateway's ``classify``) tells throttling (429) from a
        bad request (400) or an engine failure (500)."""
        err = self._pb.TritonError
        status = getattr(err, _ERROR_CODES.get(code, "INTERNAL"), err.INTERNAL)
        return self._pb.InferenceResponse(error=err(f"[{code}] {message}", status))


class TritonPythonModel:
    """The class Triton's Python backend instantiates once per model instance."""

    @staticmethod
    def auto_complete_config(auto_complete_model_config: Any) -> Any:
        """Models carry only parameters: the tensors and decoupled mode come from here."""
        cfg = auto_complete_model_config
        current = cfg.as_dict()
        # NOTE: the engine batches per iteration, Triton must not (no dynamic batcher); the
        # TensorRT-LLM layout only declares a batch dimension, as its configs do, so
        # clients built for them send [1, 1] for a scalar.
        cfg.set_max_batch_size(TRTLLM_MAX_BATCH if _layout(current) == "tensorrt_llm" else 0)
        cfg.set_model_transaction_policy({"decoupled": True})
        have_in = {t["name"] for t in current.get("input", [])}
        have_out = {t["name"] for t in current.get("output", [])}
        for spec in INPUTS:
            if spec.name not in have_in:
                cfg.add_input(
                    {
                        "name": spec.name,
                        "data_type": spec.dtype,
                        "dims": spec.dims,
                        "optional": True,
                    }
                )
        extra = TRTLLM_OUTPUTS if _layout(current) == "tensorrt_llm" else ()
        for name, dtype, dims in (*OUTPUTS, *extra):
            if name not in have_out:
                cfg.add_output({"name": name, "data_type": dtype, "dims": dims})
        return cfg

    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        from quanta.frontends.engine import build_engine

        self._pb = pb_utils
        model_config = load_model_config(args)
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "the quanta backend streams: set model_transaction_policy { decoupled: true }"
            )
        engine_config, settings = parse_parameters(parameters_from_model_config(model_config))
        _use_environment_locale()
        self._trtllm = settings.io_layout == "tensorrt_llm"
        if settings.torch_threads is not None:
            import torch

            torch.set_num_threads(settings.torch_threads)
        if settings.preset is not None:
            from quanta.build.checkpoint import ensure_checkpoint

            ensure_checkpoint(settings.preset, Path(engine_config.model), settings.preset_seed)
        self._engine = build_engine(engine_config)
        self._loop = self._engine.loop
        self._name = args["model_instance_name"]
        self._ids = itertools.count()
        self._settings = settings
        faults = settings.fault_injection or os.environ.get(FAULTS_ENV, "")
        if faults:
            self._loop.inject(FaultPlan.parse(faults))
            pb_utils.Logger.log_warn(f"{self._name}: fault injection ({faults}) is on: tests only")
        self._unhealthy: str | None = None  # why the engine stopped serving
        self._unhealthy_lock = threading.Lock()
        self._loop.on_fatal = lambda reason: self._engine_failed(f"the engine loop died: {reason}")
        self._watchdog = Watchdog(
            self._loop,
            stall_timeout=settings.stall_timeout_s,
            on_unhealthy=lambda health: self._engine_failed(health.reason),
        )
        self._metrics = MetricsReporter(
            pb_utils,
            labels={
                "model": args["model_name"],
                "version": args["model_version"],
                "instance": self._name,
            },
            stats=self._loop.stats,
            interval=settings.metrics_interval_ms / 1000,
            max_tenant_labels=settings.max_tenant_labels,
            info=self._engine.describe(),
            restarts=int(os.environ.get("QUANTA_SERVER_RESTARTS", "0") or 0),
            health=self._health,
            step_tokens=self._loop.take_step_tokens,
        )
        responses = TritonResponses(pb_utils, batch_dim=settings.io_layout == "tensorrt_llm")
        self._responder_final_flag = responses.final_flag
        self._responder = Responder(
            responses,
            self._loop.cancel,
            on_finished=self._finished,
            on_prefilled=self._prefilled,
            cancel_check_interval=settings.cancel_check_interval_ms / 1000,
        )
        self._loop.start()
        self._responder.start()
        self._metrics.start()
        self._watchdog.start()
        self._drain: DrainWatch | None = None
        drain_dir = drain_dir_from_env()
        if drain_dir is not None and drain_dir.is_dir():
            self._drain = DrainWatch(
                drain_dir,
                self._name,
                num_live=self._responder.num_live,
                end_all=lambda reason: self._loop.stop(reason, ShuttingDownError),
            )
            self._drain.start()
        described = " ".join(f"{k}={v}" for k, v in self._engine.describe().items())
        pb_utils.Logger.log_info(f"{self._name}: serving {described}")

    def execute(self, requests: list[Any]) -> None:
        """Submit each request and return at once; responses are sent by the responder."""
        for request in requests:
            self._submit(request)
        return None

    def finalize(self) -> None:
        """Stop the loop (failing what is in flight), flush responses, then drop metrics."""
        if self._drain is not None:
            self._drain.stop()
        self._watchdog.stop()
        self._loop.stop("the model is being unloaded; the request was aborted")
        self._responder.stop()
        self._metrics.stop()

    # -- helpers -----------------------------------------------------------------------------
    def _submit(self, request: Any) -> None:
        rid = f"{self._name}-{next(self._ids)}"
        sender = request.get_response_sender()
        inflight = InflightRequest(rid, sender, stream=False)
        if self._drain is not None and self._drain.is_draining():
            self._responder.reject(inflight, ShuttingDownError(_DRAINING))
            return
        if self._unhealthy is not None:
            self._responder.reject(inflight, self._dead_error(self._unhealthy))
            return
        try:
            get = functools.partial(self._input, request)
            if get(HEALTH_INPUT) is not None:
                self._answer_health(inflight)
                return
            if is_reset_request(get, request.parameters()):
                self._reset_prefix_cache(inflight)
                return
            parsed = parse_request(get, request.parameters(), echo_by_default=self._trtllm)
            n = parsed.num_return_sequences
            requests = [
                self._engine.make_request(
                    parsed.prompt,
                    parsed.params.for_sequence(i),
                    metadata=parsed.metadata,
                    request_id=f"{rid}.{i}" if n > 1 else rid,
                    bad_words=parsed.bad_words,
                    pooling=parsed.pooling,
                )
                for i in range(n)
            ]
            for r in requests:
                self._loop.validate(r)
        except QuantaError as exc:
            self._responder.reject(inflight, exc)
            return
        except Exception as exc:  # a bug in conversion fails this request, not the model
            log.exception("submitting %s failed", rid)
            self._responder.reject(inflight, EngineStepError(f"internal error: {exc}"))
            return
        if n > 1:  # one Triton request, n sequences: the last to end sends the final flag
            sender = SequenceGroupSender(sender, n, self._responder_final_flag)
        for i, r in enumerate(requests):
            member = InflightRequest(
                r.request_id,
                sender,
                stream=parsed.stream,
                tenant=parsed.metadata.tenant,
                priority_class=parsed.metadata.priority_class,
                return_log_probs=parsed.return_log_probs,
                top_log_probs=parsed.top_log_probs,
                return_prompt_log_probs=parsed.return_prompt_log_probs,
                sequence_index=i if n > 1 else None,
                embedding=parsed.pooling is not None,
                num_prompt_tokens=r.num_prompt_tokens,
            )
            if parsed.echo:
                member.echo_ids = tuple(r.prompt_token_ids)
                member.echo_text = r.prompt or self._engine.tokenizer.decode(r.prompt_token_ids)
            sink = self._responder.track(member)
            try:
                self._loop.submit(r, sink)
            except QuantaError as exc:
                self._responder.reject(member, exc)

    def _reset_prefix_cache(self, inflight: InflightRequest) -> None:
        """Ask the loop to forget every cached prefix, then answer with an empty final response.

        NOTE: not waited for (``execute`` never blocks on the loop); the loop takes the reset
        before any request submitted after this call, so whatever a client sends once it has
        the answer finds nothing cached from before."""
        self._loop.reset_prefix_cache(wait=False)
        self._responder.reply(inflight, Reply())

    def _answer_health(self, inflight: InflightRequest) -> None:
        """A health check: an empty final response while the engine serves, else the typed
        error that says why not (the OpenAI gateway's ``/health`` asks this way, since
        Triton 2.51's own readiness cannot be told by a Python backend)."""
        health = self._health()
        if health.healthy:
            self._responder.reply(inflight, Reply())
        else:
            self._responder.reject(inflight, self._dead_error(health.reason))

    def _health(self) -> LoopHealth:
        """The watchdog's fresh reading; unhealthy for good once the engine was failed."""
        health = self._watchdog.health()
        reason = self._unhealthy
        if reason is not None and health.healthy:
            return LoopHealth(False, reason, health.seconds_since_step, health.num_unfinished)
        return health

    @staticmethod
    def _dead_error(reason: str) -> EngineDeadError:
        return EngineDeadError(f"the engine is unhealthy and the server restarts: {reason}")

    def _engine_failed(self, reason: str) -> None:
        """The engine stopped serving (its loop died or stalled): refuse new requests, end
        every one in flight with ``EngineDeadError``, log why, and end tritonserver
        ``unhealthy_exit_s`` later so that its supervisor restarts it. Idempotent; called
        from the loop or the watchdog thread."""
        with self._unhealthy_lock:
            if self._unhealthy is not None:
                return
            self._unhealthy = reason
        delay = self._settings.unhealthy_exit_s
        ended = self._responder.fail_all(self._dead_error(reason))
        then = (
            f"; tritonserver ends in {delay:g} s so that it is restarted"
            if delay >= 0
            else "; health checks fail from now on (unhealthy_exit_s < 0: not ended)"
        )
        message = (
            f"{self._name}: the engine is unhealthy: {reason}; "
            f"{ended} request(s) in flight ended{then}"
        )
        print(f"quanta: {message}", file=sys.stderr, flush=True)
        try:
            self._pb.Logger.log_error(message)
        except Exception:
            log.exception("logging through Triton failed")
        if delay >= 0:
            timer = threading.Timer(delay, self._end_server, args=(reason,))
            timer.daemon = True
            timer.start()

    def _end_server(self, reason: str) -> None:
        """Send what is queued, then end tritonserver (the parent of this stub process).

        Why SIGKILL: Triton 2.51's Python backend can neither mark a model not ready nor
        restart a decoupled model's stub, and a tritonserver that shuts down cleanly (SIGTERM)
        exits 0, which ``quanta serve`` takes for a deliberate stop; a killed one is restarted
        (by ``quanta serve``, or by the container runtime). Every request was answered first."""
        self._responder.flush(timeout=5.0)
        parent = os.getppid()
        if not _is_tritonserver(parent):
            log.error("not ending process %d (not tritonserver): %s", parent, reason)
            return
        print(f"quanta: ending tritonserver (pid {parent}): {reason}", file=sys.stderr, flush=True)
        os.kill(parent, signal.SIGKILL)
        os._exit(1)

    def _input(self, request: Any, name: str) -> Any:
        tensor = self._pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _finished(self, inflight: InflightRequest, out: RequestOutput) -> None:
        error = out.error
        reason = _FINISH_LABELS.get(error.code, "error") if error else out.finish_reason
        self._metrics.record(
            FinishedRecord(
                tenant=inflight.tenant,
                priority_class=inflight.priority_class,
                finish_reason=reason or "unknown",
                throttled=error is not None and error.code == "resource_exhausted",
                metrics=out.metrics,
                prompt_counted=inflight.prefilled,
            )
        )

    def _prefilled(self, inflight: InflightRequest) -> None:
        self._metrics.record(
            PrefilledRecord(inflight.tenant, inflight.priority_class, inflight.num_prompt_tokens)
        )


def _is_tritonserver(pid: int) -> bool:
    """Whether ``pid`` runs tritonserver (so a test harness is never the one killed)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"
    except OSError:
        return False
