"""The error mpidp raises for bad input or a failed job (no MPI here)."""


class MpidpError(ValueError):
    """A problem with the input or the job, raised with the same message on every rank."""
