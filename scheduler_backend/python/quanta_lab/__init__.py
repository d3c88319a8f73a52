"""Quanta's lab: what measures and explains Quanta rather than serves with it.

Paper reproductions and the simulator's validation and calibration (``quanta_lab.sim``), the
side-by-side runs against vLLM, llama.cpp and HF transformers, quality runs and the benchmarks
of single mechanisms (``quanta_lab.bench``). It imports anything in ``quanta``; nothing in
``quanta`` imports it. Its commands join the ``quanta`` CLI through an entry point
(``quanta_lab.cli``).
"""
