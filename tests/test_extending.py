"""docs/extending.md shows examples/custom_layer.py as it is, and the example keeps the
promise: a user's layer, optimizer and stopping callback train the same model at 1 and 3
ranks, and the saved model reloads and predicts the same labels."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ROOT, run_mpi

EXAMPLE = ROOT / "examples" / "custom_layer.py"


def test_the_page_shows_the_example_as_it_is():
    page = (ROOT / "docs" / "extending.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in page


@pytest.mark.slow
def test_the_example_gives_the_same_model_at_one_and_three_ranks(tmp_path):
    lines, params = {}, {}
    for n in (1, 3):
        out = tmp_path / f"p{n}.npz"
        r = run_mpi(n, str(EXAMPLE), str(out), module=False, cwd=tmp_path, timeout=180)
        assert r.returncode == 0, r.stderr
        lines[n] = r.stdout.strip().splitlines()[-1]
        assert lines[n].endswith("reloaded model agrees: True"), r.stdout
        with np.load(out) as f:
            params[n] = f["params"]
    assert lines[1].split("epochs")[1] == lines[3].split("epochs")[1], lines  # same stop
    assert np.allclose(params[1], params[3], rtol=1e-10, atol=1e-12)
