"""An OpenAI-compatible HTTP gateway in front of a Triton server running the ``quanta`` backend.

``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` are served by FastAPI; every
generation is forwarded to Triton over one gRPC bidirectional stream per request, so a client
that goes away cancels its Triton request (and frees its KV blocks). The gateway holds no model:
it validates, renders chat prompts, and translates between the two protocols.
"""
