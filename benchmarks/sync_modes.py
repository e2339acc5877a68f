"""The modes ``bench_sync.py`` times, importable without starting MPI (``bench_network.py``
checks its ``--modes`` against them before it builds anything)."""

MODES = ("allreduce", "per-layer", "overlapped", "compressed", "ps", "ps-bcast", "ps-dedicated",
         "sharded-ps", "accumulate", "local-sgd", "compute-only")
# named in --modes only: strategy choice measured at setup, fused allreduce without and
# with node-aware reduction, the hand-written loop as a mode of its own (with --only), and
# compressed with int8 codes (or bfloat16 by NumPy's passes, not numba's kernels),
# overlapped whose last sums finish during the next forward
EXTRA_MODES = ("auto", "allreduce-flat", "allreduce-node", "handwritten", "compressed-int8",
               "compressed-numpy", "overlapped-forward")
