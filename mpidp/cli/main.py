"""Command line: ``mpidp train``, ``sweep``, ``predict``, ``model``, ``plot``, ``info``,
``export``, ``check-layer``, run under ``mpiexec -n P``.

Every rank parses the same arguments and takes the same decisions; only rank 0 prints.
Bad input exits with status 2 on every rank and leaves ``--out`` untouched; a stop on
SIGTERM/SIGUSR1 exits with 75 after a checkpoint; a stalled rank ends the job with 3.
``--help``, ``--version``, ``info``, ``plot``, ``export`` and ``check-layer`` work without MPI:
it starts only for the commands that need it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import platform
import sys
from collections.abc import Sequence

from .. import __version__
from ..atomic import DISK_FULL, WriteError, check_folder, write_error
from ..errors import spelled
from . import settings
from .flags import spelling
from .parser import EXIT_USAGE, build_parser, refuse, subcommand
from .places import refusal


def _start_mpi():
    """``mpidp.comm`` (MPI starts here); a one-line hint and exit 2 when there is no MPI."""
    try:
        from .. import comm as C
    except (ImportError, RuntimeError, OSError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"mpidp: cannot start MPI ({why}). Install it with pip install 'mpidp[mpi]' "
              "(mpi4py and the mpich wheel), or build mpi4py against your cluster's MPI: "
              "pip install --no-binary mpi4py mpi4py", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    return C


def info() -> dict:
    """Versions, the MPI library and every rank's host (printed by rank 0). Collective when
    MPI is there; without it, a single process's view."""
    import numpy as np
    try:
        from threadpoolctl import threadpool_info
        blas = [{k: d.get(k) for k in ("internal_api", "version", "num_threads",
                                       "threading_layer", "architecture")}
                for d in threadpool_info() if d.get("user_api") == "blas"]
    except ImportError:
        blas = "unknown (install threadpoolctl)"
    result = {"mpidp": __version__, "python": platform.python_version(), "numpy": np.__version__,
              "blas": blas, "env": {k: os.environ[k] for k in sorted(os.environ)
                                              if k.startswith(("OPENBLAS", "OMP_", "MKL_"))}}
    try:
        from .. import comm as C
    except (ImportError, RuntimeError, OSError) as exc:
        result.update(mpi=f"not available: {str(exc).splitlines()[0] if str(exc) else exc!r}",
                      hosts=[platform.node()])
    else:
        comm = C.world()
        result.update(mpi=C.mpi_info(comm),
                      hosts=C.bcast_obj(comm, C.gather_obj(comm, platform.node())))
        if comm.rank != 0:
            return result
    print(json.dumps(result, indent=2), flush=True)
    return result


def plot(args) -> int:
    """Run ``mpidp plot`` with the parsed ``args`` (:mod:`mpidp.observe.plot` draws); exit status
    2 with a message on bad input or an image that cannot be written (none left half-written)."""
    from ..observe import plot as P
    try:
        P.need_matplotlib()
        out = P.output_path(args.out)
        if any(P.is_sweep(folder) for folder in args.runs):
            if len(args.runs) > 1:
                raise ValueError("give one sweep folder alone (its trials are plotted "
                                 "against each setting they vary)")
            summary = P.load_sweep(args.runs[0])
            panels = P.draw_sweep(summary, out, args.title)
            print(f"wrote {out} ({summary['select']} of {len(panels[0]['y'])} trials "
                  f"against {', '.join(p['setting'] for p in panels)})")
            return 0
        runs = [P.load_run(folder) for folder in args.runs]
        P.draw(runs, out, args.x, args.title)
    except (ImportError, ValueError, OSError) as exc:
        print(f"mpidp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    with spelled(spelling(parser)):  # messages name settings by their flags
        return _main(parser, argv)


def _main(parser, argv: list[str]) -> int:
    typed = list(argv)  # what the user wrote: the options given (a table's are added below)
    if argv[:1] == ["sweep"]:  # its other options are train's, for every trial
        from .sweep import parse
        args = parse(parser, argv)
    else:
        args = parser.parse_args(argv)
    command = subcommand(parser, args.command)
    refuse(refusal(args, command))  # before anything opens a path, and before MPI
    if args.command == "info":
        info()
        return 0
    if args.command in ("plot", "export", "check-layer"):
        from . import check_layer, export
        return {"plot": plot, "export": export.main, "check-layer": check_layer.main}[args.command](args)
    from_file: set[tuple[str, bool]] = set()
    if args.command == "train" and args.config:
        args, argv, from_file = settings.with_config_file(parser, argv, args.config)
        refuse(refusal(args, command))  # the file's paths
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr with no file
        faulthandler.enable()  # descriptor (a notebook): no traceback on a fatal signal
    # A rank killed by SIGSEGV or SIGBUS (a mapped data file cut short under it) prints
    # where it was before mpiexec ends the job.
    from ..run.signals import PREEMPTED_EXIT, Preempted, deferred_stops
    with deferred_stops() as noted:
        C = _start_mpi()
        comm = C.world()
    from ..run.elastic import TOO_FEW_RANKS_EXIT, TooFewRanks
    if noted:  # nothing done yet: end as a stop during the data load does
        import signal
        sys.stderr.write(f"[mpidp] rank {comm.rank}/{comm.size}: stopped by "
                         f"{signal.Signals(noted[0]).name} while MPI started; nothing was "
                         f"trained or saved, so run the same command again (exit "
                         f"{PREEMPTED_EXIT}).\n")
        if comm.size > 1:  # the others may not have had it: end the job
            C.abort_job(PREEMPTED_EXIT)
        return PREEMPTED_EXIT
    try:
        if args.command == "train" and args.resume and args.checkpoint_dir:
            if stored := C.root_decides(comm, settings.stored_config, args.checkpoint_dir):
                args, argv = settings.with_stored(parser, argv, stored)  # as it was trained
        _run(args, comm, parser, command, typed[typed.index(args.command) + 1:], from_file)
    except Preempted as exc:
        if comm.rank == 0:
            print(f"mpidp: {exc}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    except TooFewRanks as exc:  # on every survivor, which leave at exit (comm.elastic)
        if exc.first:
            print(f"mpidp: {exc}", file=sys.stderr, flush=True)
        return TOO_FEW_RANKS_EXIT
    except C.MpidpError as exc:  # raised identically on every rank
        if comm.rank == 0:
            print(f"mpidp: error: {exc}", file=sys.stderr, flush=True)
        from ..comm.elastic import exit_with
        exit_with(EXIT_USAGE)  # an elastic run's survivors, which leave at exit, too
        return EXIT_USAGE
    except OSError as exc:  # an output this rank alone writes (rank 0): a full disk ...
        if not isinstance(exc, WriteError) and exc.errno not in DISK_FULL:
            raise
        print(f"mpidp: error: {write_error(exc)}", file=sys.stderr, flush=True)
        if comm.size > 1:  # the others may wait in a collective: end the job, in one line
            C.abort_job(EXIT_USAGE)
        return EXIT_USAGE
    except (SystemExit, KeyboardInterrupt) as exc:  # one rank leaving must not hang the others
        code = exc.code if isinstance(exc, SystemExit) else 130
        if comm.size > 1:
            C.abort_job(code if isinstance(code, int) and code else 1)
        raise
    return 0


def _run(args, comm, parser, command, after: list[str], from_file: set[tuple[str, bool]]) -> None:
    if args.command == "train":
        from .train import train
        train(args, comm, settings.settle(args, command, after, from_file))
    elif args.command == "model":
        from .. import comm as C
        from ..scale.calibrate import calibrate, format_report
        from ..scale.calibrate import save as save_model
        C.root_decides(comm, check_folder, args.out, "--out")  # before minutes of measuring
        report = calibrate(comm, args.batch_size)
        if comm.rank == 0:
            print(format_report(report), "\nwrote " + ", ".join(save_model(report, args.out)),
                  flush=True)
    elif args.command == "predict":
        from .options import given
        from .predict import predict
        predict(args, comm, given(command, after))
    elif args.command == "sweep":
        from .sweep import run
        run(args, comm, parser)
