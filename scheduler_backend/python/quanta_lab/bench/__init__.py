"""The lab's benchmarks: peers side by side (``peer``), answer quality against HF transformers
and llama.cpp, and single mechanisms (decode profile, loop overhead, safepoints, structured
output, speculative decoding, cached-prefix prefill, cancellation)."""
