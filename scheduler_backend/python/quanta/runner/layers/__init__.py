"""The layer kit every decoder family is composed of (``quanta.runner.models``).

``attention`` (grouped-query, q/k/v bias, q/k norm, partial rotary, sliding window,
soft-capping), ``mlp`` (SwiGLU, GeGLU, fused gate/up), ``norms`` (RMSNorm, Gemma's 1 + w),
``rotary`` (default, linear, llama3, yarn, longrope), ``decoder`` (the layer, the model, the
LM head: scaled or tied embeddings, final soft-capping) and ``parallel`` (each layer's
tensor-parallel split). A family's model file subclasses ``decoder.DecoderForCausalLM``; its
config parser (``quanta.families``) turns the checkpoint's options on.
"""
