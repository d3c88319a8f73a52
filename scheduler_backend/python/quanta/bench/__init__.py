"""The benchmarks a deployment is measured with: a serving replay (``bench serve``), its
workload files (``bench workload``), engine tokens/s (``bench engine``) and load time
(``bench load``). The lab's benchmarks are ``quanta_lab.bench``."""
