"""What a trainer can give the layers of a model, and what it refuses.

A layer states what it needs from whoever runs it (:attr:`mpidp.nn.Layer.needs`):
``replica-sums`` (sums over the global batch, as :class:`mpidp.nn.BatchNorm` takes its
statistics) or ``sample-index`` (the samples' global positions, which key
:class:`mpidp.nn.Dropout`'s masks). Every trainer asks :func:`refuses_model` before any
work, so a combination that cannot work is refused the same way on every rank, naming the
option, the mode and the reason. Pure: no MPI.
"""

from __future__ import annotations

from .kinds import PIPELINED

_NO_GLOBAL_BATCH = "no global batch to take statistics over (use LayerNorm, or another {fix})"
#: (a layer's need, a mode it cannot be met in) -> why; see :attr:`mpidp.nn.Layer.needs`
REFUSED_NEEDS = {
    ("replica-sums", "pipeline"): "each stage sees one micro-batch at a time, so no stage "
                                  "holds the global batch to take statistics over (use "
                                  "LayerNorm, or --parallel data)",
    ("replica-sums", "local-sgd"): "each replica steps on its own part of the batch, so there "
                                   "is " + _NO_GLOBAL_BATCH.format(fix="--sync"),
    ("replica-sums", "async-ps"): "each worker steps on its own batch at its own pace, so "
                                  "there is " + _NO_GLOBAL_BATCH.format(fix="--sync"),
    ("sample-index", "pipeline"): "a stage after the first does not know which samples a "
                                  "micro-batch holds, so masks could not be keyed to the "
                                  "samples (use --parallel data)",
}
_LAYER = {"replica-sums": "BatchNorm", "sample-index": "Dropout"}


def refuses_model(needs, parallel: str = "data", sync: str = "allreduce") -> str | None:
    """Why a model whose layers need ``needs`` cannot be trained with ``parallel``
    (``data``, ``pipeline``, ``hybrid``) and ``sync``, naming the option, the mode and the
    reason; None when it can."""
    mode = ("pipeline", f"--parallel {parallel}") if parallel in PIPELINED \
        else (sync, f"--sync {sync}")
    for need in sorted(needs):
        why = REFUSED_NEEDS.get((need, mode[0]))
        if why is not None:
            return f"{mode[1]} cannot train a model with {_LAYER.get(need, need)}: {why}"
    return None
