"""``mpidp train --model FILE``: a model file the data refuses is one line that names the
file once, as the option, exit 2, before any step."""

from __future__ import annotations

import pytest
from helpers import run_mpi


@pytest.mark.parametrize("layers, message", [
    ("[[layers]]\ntype = 'SparseDense'\nn_out = 4\n[[layers]]\ntype = 'Dense'\n",
     "its first layer, SparseDense, takes sparse (CSR) rows, and the dataset's rows are dense"),
    ("[[layers]]\ntype = 'Flatten'\n[[layers]]\ntype = 'Dense'\nn_out = 3\n",
     "the model gives outputs of shape (3,) per sample, but the data needs 10"),
])
def test_a_model_file_the_data_refuses_is_named_once(tmp_path, layers, message):
    _refused(tmp_path, layers, [], f"--model m.toml: {message}")


def test_a_refusal_of_another_option_is_not_put_under_the_model_file(tmp_path):
    """Not '--model m.toml: --standardize does not apply to this model'."""
    _refused(tmp_path, "[[layers]]\ntype = 'Embedding'\nn_tokens = 20\ndim = 4\n"
             "[[layers]]\ntype = 'Flatten'\n[[layers]]\ntype = 'Dense'\n", ["--standardize"],
             "--standardize does not apply to this model: its first layer Embedding(20, 4)")


def _refused(tmp_path, layers: str, extra: list[str], said: str) -> None:
    (tmp_path / "m.toml").write_text(layers)
    r = run_mpi(1, "train", "--dataset", "digits", "--epochs", "1", "--model", "m.toml",
                *extra, "--out", "o", "-q", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"mpidp: error: {said}"), lines
