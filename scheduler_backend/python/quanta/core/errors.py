"""Typed errors that reach clients; frontends map each class to one protocol status code."""

from __future__ import annotations


class QuantaError(Exception):
    """Base class: every error a client can see derives from it."""

    #: Short machine-readable kind, used by frontends to pick a status code.
    code: str = "internal"


class InvalidRequestError(QuantaError, ValueError):
    """The request can never be served as given (bad prompt, bad sampling values)."""

    code = "invalid_argument"


class EmptyPromptError(InvalidRequestError):
    """A prompt with no tokens has nothing to condition on."""


class PromptTooLongError(InvalidRequestError):
    """Prompt plus ``max_tokens`` exceeds the model's context length."""


class CapacityError(InvalidRequestError):
    """The request can never fit in the configured KV pools, so waiting would be forever."""


class ThrottledError(QuantaError):
    """A policy refused the request under load (e.g. FairServe throttling). The message
    names the limit that was hit and ends with "retry after N s" when the policy knows
    when the limit clears, which the OpenAI gateway turns into ``Retry-After``."""

    code = "resource_exhausted"


class RequestAbortedError(QuantaError):
    """The request was cancelled, or the engine stopped before it finished."""

    code = "cancelled"


class ShuttingDownError(QuantaError):
    """The server is draining before a shutdown: it takes no new requests (retry elsewhere),
    and one still running when the drain time ran out was ended."""

    code = "shutting_down"


class EngineStepError(QuantaError):
    """An exception inside an engine step failed the requests of that step."""

    code = "internal"


class EngineDeadError(QuantaError):
    """The engine hit an error it cannot contain to one request (its loop died, or made no
    progress for too long): every request in flight ends with this error, new ones are
    refused, and the server ends so that its supervisor starts a fresh one. Retry shortly;
    the code is the one a draining server gives (HTTP 503), since the cure is the same."""

    code = "shutting_down"


class PolicyError(QuantaError):
    """A policy produced a decision the block pools cannot carry out: a policy bug."""

    code = "internal"


class CapabilityError(QuantaError, ValueError):
    """A policy needs an engine capability (hidden cache, layer safepoints, async copies) that
    the runner lacks; raised when the loop is built, before any request is accepted."""

    code = "internal"


class WorkerLostError(QuantaError, RuntimeError):
    """A tensor-parallel worker died: the KV cache it held for every request is gone, so
    every request on the engine ends with this error; the next step starts new workers."""

    code = "internal"
