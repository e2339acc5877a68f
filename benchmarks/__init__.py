"""mpidp's benchmarks: one module per benchmark, run as ``python -m benchmarks.NAME`` from
the repository root (``make bench-*``); the shared machinery is in :mod:`benchmarks.harness`,
results go to benchmarks/results/."""
