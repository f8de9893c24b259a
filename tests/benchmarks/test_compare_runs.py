"""benchmarks/compare_runs.py: relative changes against the reference run, and runs without a final eval."""

import json
import sys

import pytest


@pytest.fixture(scope="module")
def compare_main(load_benchmark):
    return load_benchmark("compare_runs").main


def _write_run(directory, losses, ne_primary, eval_ne=None, eval_step=None):
    directory.mkdir()
    records = [
        {"step": 10 * (i + 1), "kind": "train", "loss": loss, "ne_primary": ne, "bce_primary": loss / 2}
        for i, (loss, ne) in enumerate(zip(losses, ne_primary))
    ]
    if eval_ne is not None:
        step = 10 * len(losses) if eval_step is None else eval_step
        records.append({"step": step, "kind": "eval", "ne_primary": eval_ne, "bce_primary": eval_ne / 2})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _compare(compare_main, monkeypatch, tmp_path, runs, window=2):
    out = tmp_path / "summary.json"
    argv = ["compare_runs.py", *(f"--run={name}={path}" for name, path in runs), f"--out={out}", f"--figure={tmp_path / 'ne.png'}", f"--loss-window={window}"]
    monkeypatch.setattr(sys, "argv", argv)
    compare_main()
    return json.loads(out.read_text())


def test_changes_against_the_reference_run(compare_main, monkeypatch, tmp_path):
    reference = _write_run(tmp_path / "ref", [3.0, 2.0, 1.0], [1.0, 0.9, 0.8], eval_ne=0.8)
    other = _write_run(tmp_path / "other", [3.0, 2.2, 1.1], [1.0, 0.9, 0.9], eval_ne=0.84)
    summary = _compare(compare_main, monkeypatch, tmp_path, [("ref", reference), ("other", other)])
    assert summary["runs_without_eval"] == []
    assert summary["final_train_loss"] == {"ref": 1.5, "other": pytest.approx(1.65)}
    assert summary["train_loss_relative_change_vs_reference"]["other"] == pytest.approx(0.1)
    assert summary["train_ne_relative_change_vs_reference"]["other"]["primary"] == pytest.approx(0.9 / 0.85 - 1)
    assert summary["ne_relative_change_vs_reference"]["other"]["primary"] == pytest.approx(0.05)
    assert summary["eval_bce_relative_change_vs_reference"]["other"]["primary"] == pytest.approx(0.05)
    assert (tmp_path / "ne.png").stat().st_size > 0


def test_a_run_without_its_final_eval_is_compared_on_train_metrics(compare_main, monkeypatch, tmp_path, capsys):
    reference = _write_run(tmp_path / "ref", [2.0, 1.0], [0.9, 0.8])  # stopped before its final eval
    other = _write_run(tmp_path / "other", [2.0, 0.5], [0.9, 0.4], eval_ne=0.5)
    summary = _compare(compare_main, monkeypatch, tmp_path, [("ref", reference), ("other", other)], window=1)
    printed = capsys.readouterr().out
    assert "no final eval record in ref" in printed and "the reference run 'ref' has no final eval: no eval comparison" in printed
    assert summary["runs_without_eval"] == ["ref"]
    assert summary["ne_relative_change_vs_reference"] == {}
    assert summary["final_eval"]["other"]["ne_primary"] == 0.5
    assert summary["train_loss_relative_change_vs_reference"]["other"] == pytest.approx(-0.5)


def test_a_run_that_logged_no_train_step_is_refused(compare_main, monkeypatch, tmp_path):
    reference = _write_run(tmp_path / "ref", [2.0], [0.9])
    empty = _write_run(tmp_path / "empty", [], [])
    with pytest.raises(SystemExit, match=r"run 'empty' logged no train step \(.*empty/metrics.jsonl\)"):
        _compare(compare_main, monkeypatch, tmp_path, [("ref", reference), ("empty", empty)])


def test_an_eval_before_the_last_train_step_is_not_a_final_eval(compare_main, monkeypatch, tmp_path):
    reference = _write_run(tmp_path / "ref", [2.0, 1.0], [0.9, 0.8], eval_ne=0.8)
    stopped = _write_run(tmp_path / "stopped", [2.0, 1.0], [0.9, 0.8], eval_ne=0.7, eval_step=10)  # its step-20 eval is missing
    summary = _compare(compare_main, monkeypatch, tmp_path, [("ref", reference), ("stopped", stopped)])
    assert summary["runs_without_eval"] == ["stopped"]
    assert list(summary["ne_relative_change_vs_reference"]) == ["ref"]


def test_bad_inputs_are_refused_with_the_run_and_step_named(compare_main, monkeypatch, tmp_path):
    reference = _write_run(tmp_path / "ref", [2.0, 1.0], [0.9, 0.8])
    with pytest.raises(SystemExit, match="--loss-window must be >= 1, got 0"):
        _compare(compare_main, monkeypatch, tmp_path, [("ref", reference)], window=0)
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"step": 10, "kind": "train", "loss": 1.0, "ne_secondary": 0.9}) + "\n")
    with pytest.raises(SystemExit, match=r"run 'other', train record of step 10 lacks \['ne_primary', 'bce_primary'\] \(.*other/metrics.jsonl\)"):
        _compare(compare_main, monkeypatch, tmp_path, [("ref", reference), ("other", other)])


def test_tasks_are_compared_by_position_across_task_names(compare_main, monkeypatch, tmp_path):
    """A run logged before named tasks ("primary", "secondary") against one whose run.json names them."""
    reference = _write_run(tmp_path / "ref", [2.0, 1.0], [0.9, 0.8], eval_ne=0.8)
    named = tmp_path / "named"
    named.mkdir()
    records = [
        {"step": 10, "kind": "train", "loss": 2.0, "ne_like": 0.9, "bce_like": 1.0, "ne_love": 0.7, "bce_love": 0.5},
        {"step": 20, "kind": "train", "loss": 1.0, "ne_like": 0.6, "bce_like": 0.5, "ne_love": 0.7, "bce_love": 0.5},
        {"step": 20, "kind": "eval", "ne_like": 0.88, "bce_like": 0.44, "ne_love": 0.7, "bce_love": 0.5},
    ]
    (named / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (named / "run.json").write_text(json.dumps({"config": {}, "spec": {"tasks": ["like", "love"]}}))
    summary = _compare(compare_main, monkeypatch, tmp_path, [("ref", reference), ("named", named)])
    assert summary["ne_relative_change_vs_reference"]["named"] == {"primary": pytest.approx(0.1)}
    assert summary["final_train_ne"]["named"] == {"primary": pytest.approx(0.75)}
    with pytest.raises(SystemExit, match=r"run 'ref', train record of step 10 lacks \['ne_secondary', 'bce_secondary'\]"):
        _compare(compare_main, monkeypatch, tmp_path, [("named", named), ("ref", reference)])  # the reference's second task, "love"


def test_planted_runs_are_placed_between_the_item_mean_baseline_and_the_oracle(compare_main, monkeypatch, tmp_path, capsys):
    planted = tmp_path / "planted"
    planted.mkdir()
    oracle = {"split": "time quantile 0.9", "eval_events": 100, "oracle": {"auc": 0.8, "ne": 0.8}, "item_mean": {"auc": 0.6, "ne": 1.0}}
    (planted / "oracle.json").write_text(json.dumps(oracle))
    runs = []
    for name, auc, ne in (("small", 0.65, 0.95), ("gem", 0.75, 0.85)):
        directory = _write_run(tmp_path / name, [1.0, 0.9], [1.0, 0.9], eval_ne=ne)
        records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        records[-1]["auc_primary"] = auc
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs.append((name, directory))
    out = tmp_path / "summary.json"
    argv = ["compare_runs.py", *(f"--run={name}={path}" for name, path in runs), f"--out={out}", f"--figure={tmp_path / 'ne.png'}", f"--planted={planted}"]
    monkeypatch.setattr(sys, "argv", argv)
    compare_main()
    rows = json.loads(out.read_text())["planted"]["evals"]
    assert [(r["run"], r["step"]) for r in rows] == [("small", 20), ("gem", 20)]
    assert [r["auc_lift_fraction"] for r in rows] == [pytest.approx(0.25), pytest.approx(0.75)]
    assert [r["ne_lift_fraction"] for r in rows] == [pytest.approx(0.25), pytest.approx(0.75)]
    printed = capsys.readouterr().out
    assert "| gem | 20 | 0.7500 | 0.8500 | 0.750 | 0.750 |" in printed and "| oracle | | 0.8000 | 0.8000 | 1 | 1 |" in printed

    (planted / "oracle.json").unlink()
    with pytest.raises(SystemExit, match="holds no oracle.json"):
        compare_main()
