"""``mpidp train``: from command-line options to a finished run, in every mode: options
checked against the mode, data loaded, the mode's trainer built and trained (the synchronous
modes through the one loop, :func:`mpidp.run.loop.run`), the replicas checked (a mismatch
fails the run), and the outputs written by rank 0."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from .. import comm as C
from .. import nn
from ..comm.elastic import errors_return, hosts_problem, members, ulfm_problem
from ..data import distribute as D
from ..data.balance import format_balance
from ..nn.standardize import moments
from ..observe.metrics import gather_timings
from ..observe.progress import line_seconds
from ..observe.watch import Watch, log, say, setup_logging
from ..parallel import DataParallel, make_trainer
from ..parallel.async_ps import AsyncPS, epoch_history, fit_async
from ..parallel.data_feed import fit
from ..parallel.elastic import last_run
from ..parallel.modes import make_sync
from ..parallel.pipeline_feed import figures, fit_pipeline, whole_model
from ..run import faults
from ..run.checkpoint import claimed, restore
from ..run.elastic import lost_while_preparing
from ..run.folders import clean_stale_tmp
from ..run.signals import StopSignals
from ..run.spec import RunSpec
from . import flags
from . import options as O
from .imports import absolute_paths, import_modules, imports_of
from .job import Job, check_out, load_data, load_settings, partition_of
from .model import build_layers, check_fits, check_inputs, check_model_file, optimizer_factory


def train(args: argparse.Namespace, comm: C.Comm, given: set[str]) -> dict | None:
    """Run ``mpidp train``. Collective. Returns the metrics on rank 0, None elsewhere."""
    t_start = time.perf_counter()
    setup_logging(args.quiet, args.verbose)
    if "epochs" not in given:
        args.epochs = nn.default_epochs(args.model)
    errors = O.problems(args, given, comm.size) or _strategy_problems(args)
    for check in (lambda: faults.parse(os.environ.get("MPIDP_FAULT")), line_seconds):
        try:  # a bad MPIDP_FAULT or MPIDP_PROGRESS_SECONDS: refused before any work
            check()
        except ValueError as exc:
            errors.append(str(exc))
    if args.elastic and not errors:  # refused before any work where MPI cannot survive it
        errors += [why for why in (ulfm_problem(comm) or hosts_problem(comm),) if why]
    if errors:  # every rank computes the same list from the same arguments
        raise C.MpidpError("; ".join(errors))
    if args.elastic:  # a rank lost from here on is survived (the watchdog's copy too)
        errors_return(comm)
        members(comm)
    # started before the user's modules: one that stalls a rank is named
    watchdog = (C.Watchdog(comm, args.watchdog or None, args.watchdog_grace).start()
                if args.watchdog != 0 else None)
    stop, lost = None, []  # lost: the ranks an elastic run lost before its first step
    try:
        while True:
            job = None
            try:
                _prepare(args, comm)
                stop = stop or StopSignals(comm)
                config = {k: (list(v) if isinstance(v, tuple) else v)
                          for k, v in vars(args).items()}
                config["world_size"] = comm.size
                # the folders are held before any work: a used one is refused
                with claimed(comm, args.out, args.checkpoint_dir, resume=args.resume,
                             restart=args.restart) as run_id:
                    if args.checkpoint_dir:
                        with C.excused("reading the data's fingerprint"):  # all of its bytes
                            config["data_fingerprint"] = D.data_fingerprint(
                                comm, args.dataset, together=args.distribute == "local"
                                and O.mode_of(args) != "async-ps")
                    job = Job(args, comm, config, run_id, watchdog, stop, t_start, lost=lost)
                    return (_train_model_parallel if O.mode_of(args) in O.MODEL_PARALLEL
                            else _train_data_parallel)(job)
            except Exception as exc:
                if not args.elastic or job is not None and job.started:
                    raise
                comm, now = lost_while_preparing(exc, comm, watchdog, args.min_ranks)
                lost += now  # the survivors prepare again, over themselves
                if stop is not None:
                    stop.comm = comm
    finally:
        if stop is not None:
            stop.close()
        if watchdog is not None:
            watchdog.stop()


def _prepare(args: argparse.Namespace, comm: C.Comm) -> None:
    """The user's modules imported, the model file and ``--out`` checked. Collective."""
    with C.excused("preparing the run"):  # watched as loading the data is
        with C.user_code(f"importing --import {', '.join(imports_of(args))}"):  # layers
            C.run_agreed(comm, import_modules, imports_of(args))
        vars(args)["import"] = absolute_paths(imports_of(args))  # so a resume finds them
        C.run_agreed(comm, check_model_file, args)  # a bad model file or layer: now
        C.root_decides(comm, check_out, args)
        if comm.rank == 0 and os.path.isdir(args.out):
            clean_stale_tmp(args.out)  # what a writer killed mid-write left behind


def _strategy_problems(args: argparse.Namespace) -> list[str]:
    """What the mode's settings refuse as the options give them, and what ``--sync
    overlapped`` refuses of the optimizer and the NaN policy: known before any data."""
    mode = O.mode_of(args)
    try:
        settings = flags.settings_of(mode, args)
        if mode != "overlapped":
            return []
        optimizer = nn.make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay,
                                      clip_norm=args.clip_norm, clip_value=args.clip_value)
    except (C.MpidpError, ValueError) as exc:
        return [str(exc)]
    why = make_sync(mode, settings).refuses_run(optimizer, args.on_nonfinite)
    return [why] if why else []


def _data_parallel_trainer(job: Job, data: D.Data) -> DataParallel:
    """The model and its data-parallel trainer, as the options say. Collective."""
    args, comm = job.args, job.comm
    layers, loss = C.run_agreed(comm, build_layers, args, data)
    check_inputs(comm, args, layers, data)
    make_opt = optimizer_factory(args, data.train.n_total)
    # async-ps evaluates with an allreduce; a resumed run's settings of another mode (kept
    # from its checkpoint) are not read: a mode's settings carry only its own fields
    name = "allreduce" if args.sync == "async-ps" else args.sync
    settings = flags.settings_of(name, args)
    if args.elastic and getattr(settings, "node_aware", False) is None:  # auto: off, since a
        settings = dataclasses.replace(settings, node_aware=False)  # node's wait outlives a loss
    sync = make_sync(name, settings, optimizer_factory=make_opt)
    dp = make_trainer("data", layers, data.sample_shape, make_opt(), loss, comm,
                      dtype=args.dtype, init_sync=args.init_sync,
                      on_nonfinite=args.on_nonfinite, sync=sync)
    dp.model.init_(np.random.default_rng(args.seed))  # the same numbers on every rank
    if args.standardize:
        D.fit_over_ranks(comm, dp.model.layers[0], data.train.X)
    dp.sync_params(args.init_sync)  # rank 0's initial model everywhere (bcast), or checked
    dp.timer.slowdown = args.slowdown.get(comm.rank, 1.0)  # ranks beyond: refused before
    return dp


def _train_data_parallel(job: Job) -> dict | None:
    args, comm = job.args, job.comm
    with job.loading():
        data = load_data(comm, args, server=0 if O.dedicated_server(args) else None)
    C.run_agreed(comm, check_fits, args, data, 1.0, C.local_ranks(comm))
    dp = _data_parallel_trainer(job, data)
    how = dp.sync.describe()
    watch = job.watch(dp.timer, data, lambda: dp.model, f"model: {dp.model!r}",
                      *([how] if how else []))
    log.debug(f"[rank {comm.rank}] {C.mpi_info(C.self_comm())['processor']}: "
              f"{len(data.train.X)} train rows, {len(data.test.X)} test rows")
    resume = job.resume(lambda: restore(comm, args.checkpoint_dir, dp.model, dp.optimizer), watch)
    planned = faults.Injector(comm.rank)  # the faults of the final write
    try:
        if args.sync == "async-ps":
            history, extra = _fit_async(job, dp, data, job.spec(  # the server reports
                watch, resume=resume, on_epoch=None, on_step=None, progress=False))
        else:
            job.started = True  # a rank lost from here on: the survivors go back a step
            history = fit(dp, data.train, test=_held_out(data), spec=job.spec(
                watch, partition=partition_of(args, data), resume=resume,
                elastic=(lambda over: _regroup(job, watch, data, over)) if args.elastic
                else False, min_ranks=args.min_ranks))
            extra = {"balance": history[-1]["balance"]}
            say(job.comm, "last epoch: " + format_balance(extra["balance"], per_rank=False))
        watch.finish(history)
    finally:
        watch.close_history()

    def finish() -> dict | None:
        comm = job.comm  # elastic: the survivors
        dp.check_replicas()  # a mismatch is a failed run: every rank raises, nothing is written
        scores = {name: dp.evaluate(shard.X, shard.y).scores  # the figures in full, at the end
                  for name, shard in (("val", data.val), ("test", data.test))
                  if shard is not None and shard.n_total}
        timings = gather_timings(comm, dp.timer)
        if comm.rank != 0:
            return None
        undecided = dp.sync.undecided() if args.sync == "auto" else None
        if undecided:
            print(f"mpidp: {undecided}", file=sys.stderr, flush=True)
        planned.apply("write")
        lost = last_run(dp)
        return job.finish(
            dp.model, data, "bit-identical (checked)", history, dp.global_step, timings, scores,
            skipped_steps=dp.skipped_steps + extra.get("async", {}).get("skipped", 0),
            sync=args.sync, **extra,
            **({"auto": dp.sync.report or undecided} if args.sync == "auto" else {}),
            bytes_sent_per_step=dp.sync.bytes_sent / max(dp.global_step, 1),
            **({"lost_ranks": job.lost + lost.losses} if lost is not None else {}))

    return _surviving(last_run(dp), finish)


def _surviving(elastic, finish):
    """``finish()``, the collective end of a run; an elastic run's survivors do it again
    over fewer ranks when one is lost during it, unless the outputs were written."""
    if elastic is None:
        return finish()
    metrics = None
    while True:
        try:
            metrics = metrics or finish()
            C.barrier(elastic.comm)  # the outputs are written: every survivor knows it
            break
        except Exception as exc:
            elastic.recover(exc)  # anything but a lost rank: raised again
            if C.allreduce_max(elastic.comm, [metrics is not None])[0]:
                break
    elastic.finished()
    return metrics


def _held_out(data: D.Data):
    return data.test if data.val is None else {"val": data.val, "test": data.test}


def _regroup(job: Job, watch: Watch, data: D.Data, comm: C.Comm):
    """Elastic runs: the survivors' communicator for the job's outputs, and their rows of
    the data sets, read again over ``comm`` (a lost rank's rows, a lost root's role)."""
    for holder in (job, watch, job.stop, job.report):
        holder.comm = comm
    again = load_data(comm, job.args, server=None)
    data.train, data.test, data.val = again.train, again.test, again.val
    return again.train, _held_out(again)


def _fit_async(job: Job, dp: DataParallel, data: D.Data, spec: RunSpec) -> tuple[list, dict]:
    """``--sync async-ps``: train asynchronously, then evaluate; one history entry per epoch
    (the workers' training loss as the server received it) and the server's summary."""
    t0 = time.perf_counter()
    ps = AsyncPS(dp.model, dp.optimizer, dp.loss, job.comm, job.args.max_staleness,
                 job.args.on_nonfinite, dp.timer)
    stats = fit_async(ps, data.train, spec=spec)
    history = epoch_history(stats)
    if data.test.n_total:
        ev = dp.evaluate(data.test.X, data.test.y)
        history[-1].update(test_loss=ev.loss,
                           test_accuracy=ev.accuracy if data.classification else None)
    history[-1]["seconds"] = time.perf_counter() - t0
    job.report(history[-1])  # made by job.spec
    return history, {"balance": None, "async": stats.summary()}


def _train_model_parallel(job: Job) -> dict | None:
    """``--parallel pipeline|hybrid``: every rank loads the whole training set (the first
    stage needs the inputs, the last the targets), as local rows so that the ranks of a node
    share one mapped copy (unless ``--copy-data``), and builds only its own stage."""
    args, comm = job.args, job.comm
    with job.loading():
        data = C.run_agreed(comm, D.load, C.self_comm(), args.dataset, distribute="local",
                            **load_settings(args))
    C.run_agreed(comm, check_fits, args, data, 1.0 / max(comm.size // 2, 1),
                 C.local_ranks(comm))
    layers, loss = C.run_agreed(comm, build_layers, args, data)
    check_inputs(comm, args, layers, data)
    pipe = make_trainer(args.parallel, layers, data.sample_shape,
                        optimizer_factory(args, data.train.n_total)(), loss, comm, dtype=args.dtype,
                        micro_batches=args.micro_batches, schedule=args.schedule,
                        on_nonfinite=args.on_nonfinite)
    pipe.init_(np.random.default_rng(args.seed))  # the same initial model as --parallel data
    if args.standardize and pipe.first:  # every rank holds the whole training set
        pipe.model.layers[0].fit_(*moments(data.train.X))
    pipe.timer.slowdown = args.slowdown.get(comm.rank, 1.0)
    whole = lambda: whole_model(pipe, lambda: build_layers(args, data)[0])  # noqa: E731
    watch = job.watch(pipe.timer, data, whole, f"{pipe.n_stages} stages x {pipe.n_replicas} "
                      f"replicas, {args.micro_batches} micro-batches, {args.schedule}; stage "
                      f"bounds (layers) {pipe.plan.bounds}")
    resume = job.resume(lambda: pipe.restore(args.checkpoint_dir), watch)
    try:
        held = {name: (shard.X, shard.y) for name, shard in
                (("val", data.val), ("test", data.test)) if shard is not None}
        history = fit_pipeline(pipe, (data.train.X, data.train.y), test=held,
                               spec=job.spec(watch, resume=resume))
        watch.finish(history)
        pipe.check_replicas()
    finally:
        watch.close_history()
    model = whole()
    scores, memory_per_rank = figures(pipe, {"val": data.val, "test": data.test})
    timings = gather_timings(comm, pipe.timer)
    if comm.rank != 0:
        return None
    same = "bit-identical (checked)" if pipe.n_replicas > 1 else "one replica (nothing to compare)"
    return job.finish(model, data, same, history, pipe.global_step, timings, scores,
                      parallel=args.parallel, stages=pipe.n_stages, replicas=pipe.n_replicas,
                      stage_bounds=pipe.plan.bounds, skipped_steps=pipe.policy.skipped,
                      memory_per_rank=memory_per_rank)
