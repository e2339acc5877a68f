"""mpidp plot: runs read from metrics.json or (killed) history.jsonl, labelled from their
configurations, drawn into a non-trivial PNG; bad folders are clear errors; no MPI; the
command line (:func:`mpidp.cli.main.plot`) apart from the drawing (:mod:`mpidp.observe.plot`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
from helpers import ROOT

from mpidp.cli import build_parser
from mpidp.cli import main as cli_main
from mpidp.cli.main import plot as run_plot
from mpidp.observe import plot as P
from mpidp.observe.history import History


def _metrics(folder, sync, P_, losses, seconds=0.5, lr=0.05):
    folder.mkdir(parents=True)
    hist = [{"epoch": i + 1, "loss": v, "accuracy": 1 - v / 3, "seconds": seconds,
             "test_loss": v * 1.1, "test_accuracy": 1 - v / 2.5} for i, v in enumerate(losses)]
    config = {"command": "train", "sync": sync, "world_size": P_, "parallel": "data",
              "lr": lr, "dataset": "digits", "out": str(folder)}
    (folder / "metrics.json").write_text(json.dumps(
        {"world_size": P_, "sync": sync, "history": hist, "config": config}))
    return folder


def _parse(argv):
    return build_parser().parse_args(argv)


@pytest.fixture
def runs(tmp_path):
    a = _metrics(tmp_path / "a", "allreduce", 2, [1.2, 0.6, 0.3, 0.2])
    b = _metrics(tmp_path / "b", "ps", 2, [1.3, 0.7, 0.4, 0.25], seconds=0.8)
    killed = tmp_path / "c"
    with History(str(killed / "history.jsonl")) as h:
        h.config({"sync": "local-sgd", "world_size": 4, "parallel": "data", "lr": 0.05,
                  "dataset": "digits"})
        h.epoch({"epoch": 1, "loss": 1.5, "accuracy": 0.4, "seconds": 0.3, "elapsed_s": 0.4})
        h.epoch({"epoch": 2, "loss": 0.9, "accuracy": 0.6, "seconds": 0.3, "elapsed_s": 0.7})
    with open(killed / "history.jsonl", "a") as f:
        f.write('{"kind":"epoch","epo')  # the line the kill cut short
    return a, b, killed


def test_labels_come_from_the_configs(runs):
    a, b, killed = runs
    loaded = [P.load_run(str(x)) for x in runs]
    assert P.labels(loaded[:2]) == ["sync=allreduce P=2", "sync=ps P=2"]
    assert P.labels(loaded) == ["sync=allreduce P=2", "sync=ps P=2", "sync=local-sgd P=4 (killed)"]
    # same configuration twice: the folder names tell them apart
    assert P.labels([loaded[0], loaded[0]]) == ["sync=allreduce P=2 [a]"] * 2
    pipe = dict(loaded[0], config={"parallel": "pipeline", "world_size": 2, "sync": "allreduce"})
    assert P.labels([loaded[0], pipe]) == ["parallel=data P=2", "parallel=pipeline P=2"]


def test_elapsed_sums_epoch_seconds_unless_recorded(runs):
    a, _, killed = runs
    assert P.elapsed(P.load_run(str(a))["epochs"]) == [0.5, 1.0, 1.5, 2.0]
    assert P.elapsed(P.load_run(str(killed))["epochs"]) == [0.4, 0.7]


def test_plot_draws_every_run_into_a_png(runs, tmp_path):
    a, b, killed = runs
    out = tmp_path / "figs" / "runs.png"
    legend = P.draw([P.load_run(str(x)) for x in runs], str(out))
    assert legend == ["sync=allreduce P=2, train", "sync=allreduce P=2, test",
                      "sync=ps P=2, train", "sync=ps P=2, test",
                      "sync=local-sgd P=4 (killed), train"]
    import matplotlib.image as mpimg
    img = mpimg.imread(str(out))
    assert img.shape[0] > 400 and img.shape[1] > 800
    assert img[..., :3].std() > 0.05  # curves, axes and text, not a blank canvas
    assert out.stat().st_size > 20_000


def test_main_reads_args_and_one_axis(runs, tmp_path, capsys):
    out = tmp_path / "one.png"
    args = _parse(["plot", *map(str, runs[:2]), "--out", str(out), "--x", "seconds"])
    assert (args.runs, args.out, args.x, args.title) == ([str(runs[0]), str(runs[1])],
                                                         str(out), "seconds", None)
    assert run_plot(args) == 0
    assert out.exists() and capsys.readouterr().out == f"wrote {out} (2 runs)\n"


def test_the_command_line_draws_like_the_functions(runs, tmp_path, capsys):
    one, two = tmp_path / "cli.png", tmp_path / "lib.png"
    assert cli_main(["plot", str(runs[2]), "--out", str(one), "--x", "epochs", "--title",
                     "t"]) == 0
    assert capsys.readouterr().out == f"wrote {one} (1 run)\n"
    P.need_matplotlib()
    P.draw([P.load_run(str(runs[2]))], str(two), "epochs", "t")
    import matplotlib.image as mpimg
    assert (mpimg.imread(str(one)) == mpimg.imread(str(two))).all()


def test_plot_options_and_defaults():
    args = _parse(["plot", "r", "--out", "f.png"])
    assert (args.command, args.runs, args.out, args.x, args.title) == ("plot", ["r"], "f.png",
                                                                       "both", None)
    with pytest.raises(SystemExit):
        _parse(["plot", "r"])  # --out is required
    with pytest.raises(SystemExit):
        _parse(["plot", "--out", "f.png"])  # at least one run folder
    with pytest.raises(SystemExit):
        _parse(["plot", "r", "--out", "f.png", "--x", "steps"])


def test_the_drawing_module_takes_no_namespace():
    tree = ast.parse((ROOT / "mpidp" / "observe" / "plot.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "argparse" not in imported and "sys" not in imported
    assert not hasattr(P, "main") and not hasattr(P, "add_parser")


def test_folder_without_results_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "no metrics.json or history.jsonl" in err and "--out" in err
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_is_a_clear_error(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = _parse(["plot", str(runs[0]), "--out", str(tmp_path / "x.png")])
    assert run_plot(args) == 2
    assert capsys.readouterr().err == f"mpidp: error: {P.NEED_MATPLOTLIB}\n"
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(ImportError, match="pip install"):
        P.need_matplotlib()


def test_plot_needs_no_mpi(runs, tmp_path):
    code = ("import sys; from mpidp.cli import main; "
            f"rc = main(['plot', {str(runs[0])!r}, '--out', {str(tmp_path / 'n.png')!r}]); "
            "assert rc == 0 and 'mpi4py' not in sys.modules, rc")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def _timeline():
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot_timeline",
                                                  ROOT / "benchmarks" / "plot_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace_doc():
    """2 ranks x 3 steps; step 1 is slow on rank 1 (rank 0 waits for it)."""
    from mpidp.observe.trace import build
    parts = []
    for rank in (0, 1):
        ev, t = [], 0.0
        for step in range(3):
            c = 0.030 if (rank == 1 and step == 1) else 0.010
            w = 0.020 if (rank == 0 and step == 1) else 0.0
            ev.append(("forward/backward", "compute", "compute", t, t + c, step, 0, None, None))
            ev.append(("wait", "comm", "wait", t + c, t + c + w, step, 0, None, None))
            ev.append(("allreduce", "comm", "comm", t + c + w, t + c + w + 0.002, step, 0,
                       None, {"bytes": 64}))
            t += 0.040
        parts.append({"rank": rank, "host": "h", "offset": 0.0, "uncertainty": 0.0,
                      "events": ev})
    return build(parts)


def test_timeline_picks_steps_and_draws_one(tmp_path):
    tl = _timeline()
    doc = _trace_doc()
    steps = tl.spans_by_step(doc)
    assert sorted(steps) == [0, 1, 2] and all(len(v) == 6 for v in steps.values())
    assert tl.pick_step(steps, None, slowest=True) == 1
    assert tl.pick_step(steps, 2, slowest=False) == 2
    with pytest.raises(SystemExit, match="not in the trace"):
        tl.pick_step(steps, 7, slowest=False)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "tl.png"
    assert tl.main([str(path), "--out", str(out), "--slowest"]) == 0
    assert out.stat().st_size > 10_000


def test_timeline_reads_the_planner_layout():
    tl = _timeline()
    ev = [{"name": n, "ph": "X", "pid": 0, "tid": r, "ts": 10.0 * i + r, "dur": 5.0}
          for i, n in enumerate(["compute", "wait", "comm", "compute", "comm"]) for r in (0, 1)]
    steps = tl.spans_by_step({"traceEvents": ev})
    assert {k: len(v) for k, v in steps.items()} == {0: 6, 1: 4}


@pytest.mark.parametrize("metrics, message", [
    ({"history": 5}, "its history is int, not a list of epochs"),
    ({"history": [3]}, "epoch record 1 is int, not an object"),
    ({"history": [{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": "x"}]},
     "epoch record 2 has loss = 'x', not a number"),
])
def test_damaged_metrics_are_one_line_errors(tmp_path, capsys, metrics, message):
    """They used to end in a TypeError traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(metrics))
    assert cli_main(["plot", str(run), "--out", str(tmp_path / "p.png")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
