"""The simulator's lab: the papers' figures reproduced on it (``repro`` and the ``*_repro``
modules), its validation against the real engine (``validate``, ``validate_scenarios``,
``engine_replay``), the cost-model profiler and its calibration (``profile``, ``calibrate``)
and the benchmarks of the loop and the policies on the real engine (``bench``, ``step_time``).
"""
