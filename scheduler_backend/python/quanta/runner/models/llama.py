"""LLaMA 1/2/3 and lookalikes (RMSNorm, rotary positions, SwiGLU, grouped-query attention):
the layer kit's decoder as it is (``quanta.runner.layers``), its names HF's
``LlamaForCausalLM``'s."""

from __future__ import annotations

from quanta.runner.layers.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """The kit's plain decoder; the decode chain runs its layers where the kernels allow."""
