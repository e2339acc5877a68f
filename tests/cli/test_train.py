"""End-to-end: ``mpiexec -n P python -m mpidp train`` as a user runs it."""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
from helpers import ROOT, main_here, parser_refusal, run_here, run_mpi

from mpidp import nn
from mpidp.data.partition import train_test_split
from mpidp.data.sources import open_source

CONTRACT = ["--dataset", "--model", "--hidden", "--epochs", "--batch-size", "--lr", "--optimizer",
            "--seed", "--dtype", "--distribute", "--init-sync", "--out"]


def test_help_explains_every_contract_option(capsys):
    """In this process: --help is printed before MPI starts, alike on every rank."""
    r = run_here(capsys, "train", "--help")
    assert r.returncode == 0
    for opt in CONTRACT:
        assert opt in r.stdout, opt
    for choice in ("linear,logreg,mlp", "sgd,momentum,adam", "float32,float64", "scatter,local",
                   "bcast,seed"):
        assert choice in r.stdout, choice


def test_info_reports_mpi_and_blas():
    r = run_mpi(2, "info")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)  # rank 0 alone prints: one JSON document
    assert info["mpi"]["world_size"] == 2 and info["mpi"]["vendor"]
    assert info["numpy"] == np.__version__
    assert info["blas"], "BLAS configuration missing"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One job with the exact arguments of ``make demo`` (read from the Makefile): 2 ranks,
    digits, an MLP 64-128-64-10, 20 epochs; the tests below read its outputs."""
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("DEMO_ARGS"))
    args = line.split("=", 1)[1].split()
    out = tmp_path_factory.mktemp("run") / "demo"
    args[args.index("--out") + 1] = str(out)
    r = run_mpi(2, *args)
    assert r.returncode == 0, r.stderr
    return r, out


def test_train_writes_metrics_and_model(demo_run):
    r, out = demo_run
    m = json.loads((out / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["epochs"] == 20 and len(m["history"]) == 20
    assert m["test_accuracy"] >= 0.9 and m["params_in_sync"] is True
    assert m["final_loss"] == m["history"][-1]["loss"] < m["history"][0]["loss"]
    assert [t["rank"] for t in m["timings"]] == [0, 1]
    assert sum(t["samples"] for t in m["timings"]) == 20 * 1438  # every sample, every epoch
    assert all(t["compute_s"] > 0 and t["comm_s"] > 0 for t in m["timings"])
    assert r.stdout.count("final:") == 1, "only rank 0 prints"
    assert "on 2 rank(s)" in r.stdout and ("MPICH" in r.stdout or "Open MPI" in r.stdout)


def test_saved_model_rebuilds_and_reproduces_test_accuracy(demo_run):
    _, out = demo_run
    saved = np.load(out / "model.npz")
    model = nn.from_spec(json.loads(str(saved["spec"])), str(saved["dtype"]))
    model.params[...] = saved["params"]
    assert model.n_params == saved["params"].size == 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    src = open_source("digits")  # independent evaluation: the same seeded split, one process
    _, test_rows = train_test_split(src.n_samples, 0.2, 0)
    X, y = src.read(test_rows)
    acc = np.mean(model.forward(X.astype(model.dtype)).argmax(1) == y)
    metrics = json.loads((out / "metrics.json").read_text())
    assert acc == pytest.approx(metrics["test_accuracy"], abs=1e-12)


def test_make_demo_arguments_reach_the_accuracy_target(demo_run):
    r, out = demo_run
    m = json.loads((out / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["test_accuracy"] >= 0.95, m["test_accuracy"]
    assert "per rank, whole run" in r.stdout and r.stdout.count("epoch ") >= 20


def _npz(tmp_path, name="d.npz", n=90, d=5, seed=0, **override):
    rng = np.random.default_rng(seed)
    arrays = {"X": rng.standard_normal((n, d)), "y": rng.integers(0, 3, n)}
    arrays.update(override)
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


def _params(out):
    return np.load(os.path.join(out, "model.npz"))["params"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The arguments of a small float64 run and its parameters from one process (this one)."""
    folder = tmp_path_factory.mktemp("one")
    args = ["train", "--dataset", _npz(folder), "--epochs", "2", "--batch-size", "16",
            "--dtype", "float64", "--hidden", "8", "--optimizer", "adam", "--lr", "0.01",
            "--no-progress"]
    assert main_here(*args, "--out", str(folder / "o1")) == 0
    return args, _params(folder / "o1")


def test_cli_float64_same_parameters_for_1_and_3_ranks(tmp_path, one_process):
    """--distribute local with --init-sync seed on 3 ranks: the parameters of one process."""
    args, params = one_process
    r3 = run_mpi(3, *args, "--distribute", "local", "--init-sync", "seed",
                 "--out", str(tmp_path / "o3"))
    assert r3.returncode == 0, r3.stderr
    np.testing.assert_allclose(_params(tmp_path / "o3"), params, rtol=1e-9, atol=1e-11)


def test_mapped_local_rows_train_like_one_process_and_like_copied_rows(tmp_path):
    """--test-fraction 0 on a float64 folder: each rank maps its own rows of X.npy (the
    one-process reference is run in this process)."""
    folder, rng = tmp_path / "d", np.random.default_rng(6)
    folder.mkdir()
    np.save(folder / "X.npy", rng.standard_normal((90, 5)))
    np.save(folder / "y.npy", rng.integers(0, 3, 90))
    args = ["train", "--dataset", str(folder), "--test-fraction", "0", "--epochs", "3",
            "--batch-size", "16", "--dtype", "float64", "--hidden", "8", "--no-progress"]
    assert main_here(*args, "--out", str(tmp_path / "o1")) == 0
    r2 = run_mpi(2, *args, "--distribute", "local", "--out", str(tmp_path / "o2"))
    r3 = run_mpi(2, *args, "--distribute", "local", "--copy-data", "--out", str(tmp_path / "o3"))
    assert r2.returncode == r3.returncode == 0, r2.stderr + r3.stderr
    np.testing.assert_allclose(_params(tmp_path / "o2"), _params(tmp_path / "o1"), rtol=1e-9,
                               atol=1e-11)
    assert np.array_equal(_params(tmp_path / "o3"), _params(tmp_path / "o2"))


def test_main_runs_where_stderr_has_no_file_descriptor(tmp_path, monkeypatch):
    """As in a notebook: ``mpidp.cli.main`` called (in this process) with ``sys.stderr`` a
    Python object. Nothing in mpidp reads sys.stderr when it is imported."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    rc = main_here("train", "--dataset", "digits", "--epochs", "1", "--no-progress",
                   "--out", str(tmp_path / "o"))
    assert rc == 0, sys.stderr.getvalue()[-2000:]
    assert (tmp_path / "o" / "model.npz").exists()


BAD = {
    "missing file": (lambda t: ["--dataset", str(t / "nope.npz")], "dataset not found"),
    "unreadable file": (lambda t: ["--dataset", str(_garbage(t))], "cannot read dataset"),
    "lengths disagree": (lambda t: ["--dataset", _npz(t, y=np.zeros(89, np.int64))],
                         "X has 90 rows but y has 89"),
    "empty dataset": (lambda t: ["--dataset", _npz(t, X=np.zeros((0, 5)), y=np.zeros(0, np.int64))],
                      "empty"),
    "NaN": (lambda t: ["--dataset", _npz(t, X=np.where(np.arange(450).reshape(90, 5) == 447, np.nan,
                                                       1.0))], "NaN or Inf (first at row 89)"),
    "labels out of range": (lambda t: ["--dataset", _npz(t), "--n-classes", "2"],
                            "out of range for 2 classes"),
    "negative labels": (lambda t: ["--dataset", _npz(t, y=-np.ones(90, np.int64))], "must be >= 0"),
    "X not 2-D": (lambda t: ["--dataset", _npz(t, X=np.zeros(90))],
                  "X must be (n_samples, *sample_shape) with at least 2 dimensions"),
    "classes of a regression": (lambda t: ["--dataset", _npz(t, y=np.ones(90)), "--model", "linear",
                                           "--n-classes", "3"],
                                "--n-classes 3 does not apply: its targets are real"),
    "logreg on regression": (lambda t: ["--dataset", _npz(t, y=np.ones(90)), "--model", "logreg"],
                             "needs integer class labels"),
}
# refused whatever the data: by the parser, or once the job knows its size and its folder
OPTIONS_BAD = {
    "unknown option value": (lambda t: ["--model", "resnet"], "'resnet' is neither a preset"),
    "bad hidden": (lambda t: ["--hidden", "12,x"], "comma-separated"),
    "huge slowdown": (lambda t: ["--slowdown", "0:1e308"], "FACTOR from 1 to 1e6"),
    "non-positive batch": (lambda t: ["--batch-size", "0"], "must be an integer >= 1, got 0"),
}
JOB_BAD = {
    "slowdown beyond the job": (lambda t: ["--slowdown", "1:2,5:3,3:2"],
                                "--slowdown names ranks 3, 5 but there are 3 ranks"),
    "out is a file": (lambda t: ["--out", str(_garbage(t))], "is not a folder"),
}


def _garbage(t):
    path = t / "garbage.npz"
    path.write_bytes(b"not a zip file at all")
    return path


def _refused(tmp_path, make_args, message, *more, capsys=None):
    """A refusal, nothing written: with ``capsys`` in this process, else by a job of 3 ranks
    that all exit 2 with rank 0 alone speaking."""
    out = tmp_path / "out"
    args = ["train", *make_args(tmp_path), *more, "--no-progress"]
    if "--out" not in args:
        args += ["--out", str(out)]
    r = run_mpi(3, *args, timeout=60) if capsys is None else run_here(capsys, *args)
    code, err = r.returncode, r.stderr
    assert code == 2, (code, err[-2000:])
    assert err.count(message) == 1, err[-2000:]  # said once: by rank 0 only
    assert "Traceback" not in err
    assert not out.exists(), "nothing may be written on error"


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_bad_input_clear_error_nothing_written(tmp_path, capsys, case, distribute):
    _refused(tmp_path, *BAD[case], "--distribute", distribute, capsys=capsys)


# a file refused before it is read, by its header, by its values: each ends every rank of a job
@pytest.mark.parametrize("case", ["missing file", "lengths disagree", "NaN"])
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_bad_input_ends_every_rank_of_the_job(tmp_path, case, distribute):
    _refused(tmp_path, *BAD[case], "--distribute", distribute)


@pytest.mark.parametrize("case", sorted(JOB_BAD))
def test_bad_settings_clear_error_every_rank_nothing_written(tmp_path, capsys, case):
    """The slowdown by a job of 3 ranks; a file as --out whatever the ranks (in this process)."""
    _refused(tmp_path, *JOB_BAD[case], capsys=capsys if case == "out is a file" else None)


@pytest.mark.parametrize("case", sorted(OPTIONS_BAD))
def test_bad_option_values_are_refused_by_the_parser(tmp_path, capsys, case):
    make_args, message = OPTIONS_BAD[case]
    err = parser_refusal(capsys, "train", *make_args(tmp_path), "--out", str(tmp_path / "out"))
    assert err is not None and err.count(message) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_exception_on_one_rank_aborts_the_whole_job_promptly(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import mpidp\nimport numpy as np\nfrom mpi4py import MPI\nfrom mpidp import nn\n"
        "comm = MPI.COMM_WORLD\n"
        "model = nn.mlp(4, (8,), 2).init_(0)\n"
        "dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)\n"
        "if comm.rank == 1:\n    raise RuntimeError('user code failed on purpose')\n"
        "X, y = np.ones((4, 4), np.float32), np.zeros(4, np.int64)\n"
        "for _ in range(10**6):\n    dp.step(X, y)  # the other ranks would wait here forever\n")
    r = run_mpi(3, str(script), module=False, timeout=60)
    assert r.returncode != 0
    assert "rank 1/3 failed" in r.stderr and "user code failed on purpose" in r.stderr


def test_readme_example_is_the_tested_script_and_is_exact(tmp_path):
    """The example writes nothing; a wrapper saves its parameters to compare 1 and 4 ranks."""
    code = (ROOT / "examples" / "train_mlp.py").read_text()
    assert code.strip() in (ROOT / "README.md").read_text(), "README must show examples/train_mlp.py"
    wrapper = tmp_path / "run_example.py"
    wrapper.write_text("import mpidp\nimport runpy, sys\nimport numpy as np\n"
                       "g = runpy.run_path(sys.argv[1], run_name='__main__')\n"
                       "if g['comm'].rank == 0:\n    np.save('params.npy', g['model'].params)\n")
    runs = {}
    for n in (1, 4):
        cwd = tmp_path / f"p{n}"
        cwd.mkdir()
        r = run_mpi(n, str(wrapper), str(ROOT / "examples" / "train_mlp.py"), cwd=cwd, module=False)
        assert r.returncode == 0, r.stderr
        assert f"ranks {n}  test accuracy" in r.stdout
        runs[n] = np.load(cwd / "params.npy")
        assert sorted(q.name for q in cwd.iterdir()) == ["params.npy"], "the example writes nothing"
    np.testing.assert_allclose(runs[4], runs[1], rtol=1e-9, atol=1e-11)
    assert float(r.stdout.split()[-1]) > 0.8


@pytest.mark.parametrize("sync", [["--sync", "ps", "--ps-placement", "dedicated"],
                                  ["--sync", "sharded-ps"], ["--sync", "overlapped", "--bucket-mb", "0.001"]])
def test_cli_sync_modes_give_single_process_parameters(tmp_path, sync, one_process):
    args, params = one_process
    r3 = run_mpi(3, *args, *sync, "--out", str(tmp_path / "o3"))
    assert r3.returncode == 0, r3.stderr
    np.testing.assert_allclose(_params(tmp_path / "o3"), params, rtol=1e-9, atol=1e-11)
    m = json.loads((tmp_path / "o3" / "metrics.json").read_text())
    assert m["sync"] == sync[1] and m["bytes_sent_per_step"] > 0


def test_cli_ps_transports_give_the_same_bits(tmp_path):
    """--ps-transport shared (sums and parameters through shared memory) and mpi
    (Reduce_scatter + Gatherv, Bcast): at 2 ranks every sum is one addition, so the two
    must agree to the last bit, and both match one process (this one)."""
    data = _npz(tmp_path)
    args = ["train", "--dataset", data, "--epochs", "2", "--batch-size", "16", "--dtype", "float32",
            "--hidden", "8", "--optimizer", "momentum", "--lr", "0.05", "--no-progress",
            "--sync", "ps"]
    runs = {t: run_mpi(2, *args, "--ps-transport", t, "--out", str(tmp_path / t)) for t in ("shared", "mpi")}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr for r in runs.values()]
    np.testing.assert_array_equal(_params(tmp_path / "shared"), _params(tmp_path / "mpi"))
    assert main_here(*args[:-2], "--out", str(tmp_path / "one")) == 0
    np.testing.assert_allclose(_params(tmp_path / "shared"), _params(tmp_path / "one"), rtol=1e-4, atol=1e-6)


def test_cli_async_ps_reports_staleness(tmp_path, capsys):
    # plain SGD: stale momentum makes asynchronous runs erratic (seen: 0.70 to 0.96)
    r = run_mpi(3, "train", "--dataset", "digits", "--epochs", "5", "--lr", "0.1",
                "--optimizer", "sgd", "--sync", "async-ps", "--slowdown", "2:3",
                "--max-staleness", "4", "--no-progress", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    t = {d["rank"]: d for d in m["timings"]}  # rank 2 computes 3x slower than rank 1
    assert t[1]["steps"] == t[2]["steps"] > 0 and t[2]["compute_s"] > 2 * t[1]["compute_s"]
    a = m["async"]
    assert a["applied"] + a["dropped"] > 0 and 0 <= a["staleness_max"]
    assert m["test_accuracy"] > 0.7 and m["params_in_sync"] is True  # chance is 0.1
    r = run_here(capsys, "train", "--sync", "async-ps", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "needs at least 2 ranks" in r.stderr  # a job of one rank
    small = ["train", "--dataset", "synthetic", "--n-samples", "300", "--n-features", "8",
             "--checkpoint-dir", str(tmp_path / "ck")]
    r = run_mpi(2, *small, "--epochs", "1", "--out", str(tmp_path / "y"))
    assert r.returncode == 0, r.stderr  # a synchronous run's checkpoints...
    r = run_mpi(2, *small, "--epochs", "2", "--resume", "--sync", "async-ps", "--out",
                str(tmp_path / "z"))  # ...are not resumed asynchronously
    assert r.returncode == 2 and "async-ps resumes only its own checkpoints" in r.stderr
    assert not (tmp_path / "z" / "model.npz").exists()


@pytest.mark.parametrize("first", [
    ["--sync", "compressed", "--compress", "int8"],
    ["--sync", "overlapped", "--overlap-progress", "thread"],
    ["--sync", "overlapped", "--overlap-finish", "forward", "--on-nonfinite", "ignore"],
    ["--sync", "allreduce", "--node-aware", "on"],
], ids=["int8", "thread", "forward", "node-aware"])
def test_a_run_resumed_under_another_sync_leaves_the_old_modes_settings(tmp_path, first):
    """The checkpoint's settings of the mode it was trained with (a codec, a progress) do
    not follow the run into the mode it resumes with."""
    args = ["train", "--dataset", "synthetic", "--n-samples", "400", "--model", "logreg",
            "--batch-size", "64", "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")]
    r = run_mpi(2, *args, "--epochs", "2", "--checkpoint-every", "1", *first,
                "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-1500:]
    r = run_mpi(2, *args, "--epochs", "3", "--sync", "per-layer", "--resume",
                "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-1500:]
    m = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert len(m["history"]) == 3 and m["config"]["sync"] == "per-layer"
