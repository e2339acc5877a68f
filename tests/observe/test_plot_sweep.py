"""``mpidp plot`` on a sweep's folder: the metric against each setting the trials vary,
numbers on a linear or log axis, anything else (or a setting left unset) as categories."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from mpidp.cli.main import main  # noqa: E402
from mpidp.observe.plot import sweep_series  # noqa: E402


def _trial(i, settings, status="ok", **result):
    return {"index": i, "status": status, "settings": settings, "result": result or None,
            "seconds": 1.0, "folder": f"s/trial-{i:03d}", "ranks": [0, 0],
            **({"error": "diverged"} if status != "ok" else {})}


SUMMARY = {"select": "val_loss", "best": {"trial": 1, "folder": "s/trial-001", "val_loss": 0.2},
           "trials": [
               _trial(1, {"lr": 0.1, "optimizer": "adam", "seed": 0}, val_loss=0.2),
               _trial(0, {"lr": 0.001, "optimizer": "sgd", "seed": 0}, val_loss=0.5),
               _trial(2, {"lr": 0.01, "optimizer": "adam", "seed": 0}, val_loss=0.3),
               _trial(3, {"lr": 1.0, "seed": 0}, "failed"),
               _trial(4, {"lr": 0.01, "optimizer": "sgd", "seed": 0}, val_loss=float("nan")),
           ]}


def test_series_one_per_varied_setting_from_the_finished_trials():
    lr, opt = sweep_series(SUMMARY)  # seed does not vary: no panel
    assert lr == {"setting": "lr", "axis": "log", "x": [0.001, 0.1, 0.01], "y": [0.5, 0.2, 0.3],
                  "trials": [0, 1, 2], "categories": None}
    assert opt["axis"] == "category" and opt["x"] == ["sgd", "adam", "adam"]
    assert opt["categories"] == ["sgd", "adam", "(not set)"]  # trial 3 leaves it unset
    assert [s["setting"] for s in sweep_series({**SUMMARY, "trials": SUMMARY["trials"][:1]})] \
        == ["lr", "optimizer", "seed"]  # nothing varies: every setting


def test_linear_axis_within_a_factor_of_20_and_lists_as_categories():
    trials = [_trial(0, {"lr": 0.03, "hidden": [64, 32]}, acc=0.9),
              _trial(1, {"lr": 0.1, "hidden": [128]}, acc=0.8)]
    lr, hidden = sweep_series({"select": "acc", "trials": trials})
    assert lr["axis"] == "linear" and hidden["x"] == ["64,32", "128"]


def test_plot_writes_the_image_and_names_the_panels(tmp_path, capsys):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "sweep.json").write_text(json.dumps(SUMMARY))
    assert main(["plot", str(tmp_path / "s"), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "val_loss of 3 trials against lr, optimizer" in capsys.readouterr().out


@pytest.mark.parametrize("files,said", [
    ({"sweep-plan.json": "{}"}, "the sweep has not finished"),
    ({"sweep.json": "{"}, "not valid JSON"),
    ({"sweep.json": '{"trials": 3}'}, "not the summary of a sweep"),
    ({"sweep.json": json.dumps({**SUMMARY, "trials": SUMMARY["trials"][3:4]})},
     "no finished trial with val_loss"),
])
def test_refusals(tmp_path, capsys, files, said):
    (tmp_path / "s").mkdir()
    for name, text in files.items():
        (tmp_path / "s" / name).write_text(text)
    assert main(["plot", str(tmp_path / "s"), "--out", str(tmp_path / "p.png")]) == 2
    assert said in capsys.readouterr().err and not (tmp_path / "p.png").exists()


def test_a_sweep_with_other_folders_is_refused(tmp_path, capsys):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "sweep.json").write_text(json.dumps(SUMMARY))
    assert main(["plot", str(tmp_path / "s"), str(tmp_path), "--out",
                 str(tmp_path / "p.png")]) == 2
    assert "give one sweep folder alone" in capsys.readouterr().err
