"""``make bench-data`` in a tiny configuration: every cell of its table is a measured
number, and the report states the command, commit and machine."""

from __future__ import annotations

import json
import math
from pathlib import Path

from helpers import mpiexec


def _load():
    from benchmarks import bench_data
    return bench_data


def test_tiny_bench_data_measures_every_cell(tmp_path):
    bench = _load()
    out = tmp_path / "data"
    assert bench.main(["--sizes-mb", "1", "--ranks", "1,2", "--repeats", "1",
                       "--formats", "npy,npz,h5,sparse", "--out", str(out),
                       "--data-dir", str(tmp_path), "--job-timeout", "300",
                       "--mpiexec", mpiexec()]) == 0  # the MPI of this interpreter
    results = json.loads(Path(str(out) + ".json").read_text())
    formats = {c["format"] for c in results["cells"]}
    assert {"npy", "npz", "sparse (bow)"} <= formats
    assert {c["P"] for c in results["cells"]} == {1, 2}
    for cell in results["cells"]:
        expected = {"scatter", "local"} | ({"hand-scatter", "local-copy", "hand-local"}
                                           if cell["size_mb"] is not None else set())
        assert expected <= set(cell["results"]), cell
        for mode, res in cell["results"].items():
            assert res["seconds"] > 0 and math.isfinite(res["seconds"]), (cell, mode)
            assert len(res["peak_anon_mib"]) == cell["P"]
            assert all(math.isfinite(m) for m in res["peak_anon_mib"])
            if mode in ("scatter", "local", "local-copy"):
                assert all(math.isfinite(v) and v >= 0 for v in res["phases"].values())
                assert res["phases"]["read"] > 0 and len(res["shard_mib"]) == cell["P"]
    assert any(t["limit"] is not None for t in results["targets"])
    text = Path(str(out) + ".md").read_text()
    m = results["machine"]
    assert m["commit"] and m["nproc"] >= 1 and m["cpu"] and m["commit"] in text
    assert Path(str(out) + ".png").stat().st_size > 0
    assert not list(tmp_path.glob("mpidp-bench-data-*"))  # generated data sets removed
