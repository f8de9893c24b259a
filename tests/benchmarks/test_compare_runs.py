"""benchmarks/compare_runs.py: relative changes against the reference run, and runs without a final eval."""

import json
import sys

import pytest


@pytest.fixture(scope="module")
def compare_runs(load_benchmark):
    return load_benchmark("compare_runs")


@pytest.fixture(scope="module")
def compare_main(compare_runs):
    return compare_runs.main


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


def test_an_undefined_ne_is_left_out_of_the_train_mean_and_has_no_change(compare_main, monkeypatch, tmp_path, capsys):
    """gem-train logs NE as null where a window's (or the eval set's) examples of a task are of one class."""
    reference = _write_run(tmp_path / "ref", [3.0, 2.0, 1.0], [1.0, None, 0.8], eval_ne=0.8)
    other = _write_run(tmp_path / "other", [3.0, 2.0, 1.0], [None, None, None])
    with open(other / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 30, "kind": "eval", "ne_primary": None, "bce_primary": 0.4}) + "\n")
    summary = _compare(compare_main, monkeypatch, tmp_path, [("ref", reference), ("other", other)], window=3)
    printed = capsys.readouterr().out
    assert summary["final_train_ne"] == {"ref": {"primary": pytest.approx(0.9)}, "other": {"primary": None}}
    assert "run 'ref': ne_primary is undefined (null: one class) in 1 of the last 3 train records; the mean is over the others" in printed
    assert "run 'other': ne_primary is undefined (null: one class) in 3 of the last 3 train records; no mean" in printed
    assert summary["train_ne_relative_change_vs_reference"]["other"] == {"primary": None}
    assert summary["ne_relative_change_vs_reference"]["other"] == {"primary": None}
    assert (tmp_path / "ne.png").stat().st_size > 0


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


def test_planted_runs_are_placed_between_the_item_mean_baseline_and_the_oracle(compare_runs, compare_main, monkeypatch, tmp_path, capsys):
    planted = tmp_path / "planted"
    planted.mkdir()
    oracle = {
        "split": "time quantile 0.9", "eval_events": 100, "eval_positive_rate": 0.4, "oracle": {"auc": 0.8, "ne": 0.8},
        "item_mean": {"auc": 0.6, "ne": 1.0}, "no_history": {"auc": 0.62, "ne": 0.99},
    }
    (planted / "oracle.json").write_text(json.dumps(oracle))
    runs = []
    for name, auc, ne in (("small", 0.65, 0.95), ("gem", 0.75, 0.85)):
        directory = _write_run(tmp_path / name, [1.0, 0.9], [1.0, 0.9], eval_ne=ne)
        records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        records[-1] |= {"auc_primary": auc, "eval_examples": 100, "eval_positives_primary": 40}
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
    # the reference predictors the report holds, in order (no long-range row: this report has none)
    assert [v["name"] for v in compare_runs.planted_levels(oracle)] == ["item-mean", "no history", "oracle"]
    assert "| no history | | 0.6200 | 0.9900 | 0.1 | 0.05 |" in printed

    # an oracle of another log (or seed, or split): its eval set is not the runs'
    (planted / "oracle.json").write_text(json.dumps(oracle | {"eval_events": 120}))
    with pytest.raises(SystemExit, match=r"run 'small' evaluated 100 examples, 40 positive, at step 20 .*the oracle of --planted .* scored 120 eval events, 48 clicks"):
        compare_main()
    (planted / "oracle.json").unlink()
    with pytest.raises(SystemExit, match="holds no oracle.json"):
        compare_main()


def _write_planted_run(directory, seed, eval_ne, eval_auc, eval_step=20):
    """A run as the trainer writes one on a converted planted log: task "click", run.json with the config's seeds."""
    directory.mkdir()
    records = [
        {"step": 10, "kind": "train", "loss": 0.7, "ne_click": 1.0, "bce_click": 0.7},
        {"step": 20, "kind": "train", "loss": 0.6, "ne_click": 0.9, "bce_click": 0.6},
        {"step": eval_step, "kind": "eval", "ne_click": eval_ne, "bce_click": eval_ne / 2, "auc_click": eval_auc, "baseline_auc_click": 0.6},
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_json = {"config": {"loop": {"seed": seed}, "data": {"seed": seed}}, "spec": {"tasks": ["click"]}}
    (directory / "run.json").write_text(json.dumps(run_json))
    return directory


SWITCH_RUNS = {  # name: (eval NE, eval AUC)
    "bf16_seed0": (0.80, 0.70), "bf16_seed1": (0.81, 0.71), "bf16_seed2": (0.82, 0.69),
    "fp8_32_seed0": (0.83, 0.70),
    "sliding_256_seed0": (0.90, 0.65),
    "fp8_128_seed0": (0.812, 0.70), "fp8_128_seed1": (0.811, 0.70), "fp8_128_seed2": (0.810, 0.70),
}


def _switch_table(compare_main, monkeypatch, tmp_path, runs, records=(), reruns=()):
    planted = tmp_path / "planted"
    planted.mkdir(exist_ok=True)
    oracle = {"split": "time quantile 0.9", "eval_events": 100, "oracle": {"auc": 0.8, "ne": 0.8}, "item_mean": {"auc": 0.6, "ne": 1.0}}
    (planted / "oracle.json").write_text(json.dumps(oracle))
    out = tmp_path / "table.json"
    argv = [
        "compare_runs.py", "--switch-table", f"--planted={planted}", *(f"--run={n}={p}" for n, p in runs), *(f"--record={r}" for r in records),
        *(f"--rerun={n}" for n in reruns), f"--out={out}", f"--figure={tmp_path / 'table.png'}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    compare_main()
    return json.loads(out.read_text())


def test_the_switch_table_against_hand_computed_spreads_and_flags(compare_main, monkeypatch, tmp_path, capsys):
    runs = [(name, _write_planted_run(tmp_path / name, int(name[-1]), ne, auc)) for name, (ne, auc) in SWITCH_RUNS.items()]
    runs.append(("block_local_64_seed0", _write_planted_run(tmp_path / "block_local_64_seed0", 0, 0.85, 0.7, eval_step=10)))  # no final eval
    table = _switch_table(compare_main, monkeypatch, tmp_path, runs)
    ref = table["reference"]
    assert ref["seeds"] == [0, 1, 2]
    assert ref["ne_mean"] == pytest.approx(0.81) and ref["auc_mean"] == pytest.approx(0.70)
    assert ref["ne_spread"] == pytest.approx(0.02) and ref["ne_std"] == pytest.approx(0.01)  # sample std of 0.80, 0.81, 0.82
    assert ref["ne_spread_pct"] == pytest.approx(100 * 0.02 / 0.81)
    assert ref["auc_spread"] == pytest.approx(0.02) and ref["auc_std"] == pytest.approx(0.01)
    rows = {r["switch"]: r for r in table["switches"]}
    assert [r["switch"] for r in table["switches"]] == ["bf16", "fp8_128", "fp8_32", "sliding_256"]
    fp8_32 = rows["fp8_32"]
    assert fp8_32["ne_change_pct"] == pytest.approx(100 * (0.83 / 0.81 - 1))  # +2.47%: |0.02| <= 2 x 0.02
    assert fp8_32["ne_paired_change_pct"] == pytest.approx(100 * (0.83 / 0.80 - 1))  # against bf16_seed0
    assert fp8_32["auc_change_pct"] == pytest.approx(0.0)
    assert (fp8_32["within_two_spreads"], fp8_32["ne_within_tolerance"]) == (True, False)
    assert fp8_32["ne_lift_fraction"] == pytest.approx((0.83 - 1.0) / (0.8 - 1.0)) and fp8_32["auc_lift_fraction"] == pytest.approx(0.5)
    fp8_128 = rows["fp8_128"]
    assert fp8_128["ne_mean"] == pytest.approx(0.811) and fp8_128["ne_change_pct"] == pytest.approx(100 * (0.811 / 0.81 - 1))
    assert fp8_128["ne_paired_change_pct"] == pytest.approx(100 / 3 * (0.812 / 0.80 + 0.811 / 0.81 + 0.810 / 0.82 - 3))
    assert (fp8_128["within_two_spreads"], fp8_128["ne_within_tolerance"]) == (True, True)
    assert (rows["sliding_256"]["within_two_spreads"], rows["sliding_256"]["ne_within_tolerance"]) == (False, False)  # 0.09 > 0.04
    assert rows["bf16"]["ne_change_pct"] == pytest.approx(0.0) and rows["bf16"]["ne_lift_fraction"] == pytest.approx(0.95)
    assert table["needs_more_seeds"] == ["fp8_32"]  # fp8_128 already has 3 seeds; sliding_256 is outside
    assert table["runs_without_eval"] == ["block_local_64_seed0"]
    printed = capsys.readouterr().out
    assert "| fp8_32 | 0 | 0.8300 | +2.47% | +3.75% | 0.7000 | +0.00% | 0.850 | yes | **no** |" in printed
    assert "spread (max - min) 0.0200 (2.47%), std 0.0100" in printed and "fewer than 3 seeds: fp8_32" in printed
    assert (tmp_path / "table.png").stat().st_size > 0


def test_one_reference_seed_gives_no_spread_flags(compare_main, monkeypatch, tmp_path):
    runs = [(name, _write_planted_run(tmp_path / name, 0, *SWITCH_RUNS[name])) for name in ("bf16_seed0", "fp8_32_seed0")]
    table = _switch_table(compare_main, monkeypatch, tmp_path, runs)
    fp8_32 = table["switches"][1]
    assert fp8_32["within_two_spreads"] is None and fp8_32["ne_within_tolerance"] is False  # 0.83 / 0.80: +3.75%
    assert table["needs_more_seeds"] == []


def test_switch_table_inputs_are_refused_with_the_run_named(compare_main, monkeypatch, tmp_path):
    good = _write_planted_run(tmp_path / "bf16_seed0", 0, 0.8, 0.7)
    with pytest.raises(SystemExit, match=r"run 'fp8' is not named <switch>_seed<k>"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed0", good), ("fp8", good)])
    with pytest.raises(SystemExit, match=r"run 'bf16_seed1' was trained with loop.seed=0, not 1 \(.*run.json\)"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed1", good)])
    with pytest.raises(SystemExit, match=r"no run of the reference switch 'bf16' with a final eval"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("fp8_32_seed0", _write_planted_run(tmp_path / "fp8", 0, 0.8, 0.7))])
    no_auc = _write_planted_run(tmp_path / "no_auc", 0, 0.8, None)  # logged NaN: null in metrics.jsonl
    with pytest.raises(SystemExit, match=r"run 'bf16_seed0', eval record of step 20 lacks \['auc_click'\]"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed0", no_auc)])
    monkeypatch.setattr(sys, "argv", ["compare_runs.py", "--switch-table", f"--run=bf16_seed0={good}", "--out=x", "--figure=y"])
    with pytest.raises(SystemExit, match="--switch-table needs --planted DIR"):
        compare_main()


def _write_runs_record(path, runs):
    """A runs record (benchmarks/results/switch_table_*_runs_*.json) of `runs`: name -> (NE, AUC) at step 1200, after a step-600 eval."""
    record = {"gpu": "one test GPU", "runs": {
        name: {"evals": [{"step": 600, "auc_click": 0.5, "ne_click": 0.99}, {"step": 1200, "auc_click": auc, "ne_click": ne}], "wall_s": 1.0}
        for name, (ne, auc) in runs.items()
    }}
    path.write_text(json.dumps(record))
    return path


def test_runs_from_a_runs_record_join_the_table_at_their_last_eval(compare_main, monkeypatch, tmp_path):
    folders = {n: SWITCH_RUNS[n] for n in ("bf16_seed0", "fp8_128_seed1", "fp8_128_seed2")}
    recorded = {n: v for n, v in SWITCH_RUNS.items() if n not in folders}
    runs = [(name, _write_planted_run(tmp_path / name, int(name[-1]), ne, auc)) for name, (ne, auc) in folders.items()]
    record = _write_runs_record(tmp_path / "runs_record.json", recorded)
    table = _switch_table(compare_main, monkeypatch, tmp_path, runs, records=[record])
    all_folders = tmp_path / "all"
    all_folders.mkdir()
    everything = _switch_table(compare_main, monkeypatch, all_folders, [
        (name, _write_planted_run(all_folders / name, int(name[-1]), ne, auc)) for name, (ne, auc) in SWITCH_RUNS.items()
    ])
    assert table["switches"] == everything["switches"] and table["reference"] == everything["reference"]  # the last eval, not step 600
    assert table["runs"]["bf16_seed1"] == f"{record} (runs record)" and table["runs"]["bf16_seed0"] == str(tmp_path / "bf16_seed0")
    only_records = _switch_table(compare_main, monkeypatch, tmp_path, [], records=[_write_runs_record(tmp_path / "all_runs.json", SWITCH_RUNS)])
    assert only_records["switches"] == everything["switches"]


def test_a_recorded_run_whose_last_eval_is_early_is_left_out_as_without_final_eval(compare_main, monkeypatch, tmp_path):
    record = _write_runs_record(tmp_path / "runs_record.json", SWITCH_RUNS)
    stopped = json.loads(record.read_text())
    stopped["runs"]["fp8_32_seed0"]["evals"].pop()  # killed after its step-600 eval
    record.write_text(json.dumps(stopped))
    table = _switch_table(compare_main, monkeypatch, tmp_path, [], records=[record])
    assert table["runs_without_eval"] == ["fp8_32_seed0"] and "fp8_32" not in [r["switch"] for r in table["switches"]]


def test_a_rerun_named_so_replaces_its_records_entry_and_nothing_else(compare_main, monkeypatch, tmp_path):
    record = _write_runs_record(tmp_path / "runs_record.json", SWITCH_RUNS)
    rerun = _write_planted_run(tmp_path / "bf16_seed1", 1, 0.8, 0.71)  # bf16 seed 1 trained again: NE 0.71, not the record's
    table = _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed1", rerun)], records=[record], reruns=["bf16_seed1"])
    assert table["runs"]["bf16_seed1"] == str(rerun) and table["runs"]["bf16_seed0"] == f"{record} (runs record)"
    reference = next(r for r in table["switches"] if r["switch"] == "bf16")
    assert reference["seeds"] == [0, 1, 2] and reference["ne"][1] == pytest.approx(0.8)
    # A recorded run without its final eval is replaced too; a rerun that is no folder, or in no record, is refused.
    stopped = json.loads(record.read_text())
    stopped["runs"]["bf16_seed1"]["evals"].pop()
    record.write_text(json.dumps(stopped))
    table = _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed1", rerun)], records=[record], reruns=["bf16_seed1"])
    assert table["runs_without_eval"] == [] and table["runs"]["bf16_seed1"] == str(rerun)
    with pytest.raises(SystemExit, match=r"--rerun bf16_seed2: no --run folder of that name"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed1", rerun)], records=[record], reruns=["bf16_seed1", "bf16_seed2"])
    other = _write_runs_record(tmp_path / "other.json", {"fp8_32_seed0": (0.8, 0.7)})
    with pytest.raises(SystemExit, match=r"--rerun bf16_seed1: in no --record"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed1", rerun)], records=[other], reruns=["bf16_seed1"])
    second = _write_runs_record(tmp_path / "second.json", {"bf16_seed1": (0.81, 0.71)})
    with pytest.raises(SystemExit, match=rf"--rerun bf16_seed1: in two records \({record} and {second}\)"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed1", rerun)], records=[record, second], reruns=["bf16_seed1"])
    # A rerun folder without its final eval would drop the record's finished run: refused.
    (tmp_path / "killed").mkdir()
    killed = _write_planted_run(tmp_path / "killed" / "bf16_seed1", 1, 0.8, 0.71, eval_step=10)
    with pytest.raises(SystemExit, match=rf"--rerun bf16_seed1: the folder has no final eval \({killed}\)"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed1", killed)], records=[_write_runs_record(tmp_path / "r.json", SWITCH_RUNS)],
                      reruns=["bf16_seed1"])


def _bad_record(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_runs_records_are_refused_with_the_file_and_run_named(compare_main, monkeypatch, tmp_path):
    good = _write_planted_run(tmp_path / "bf16_seed0", 0, 0.8, 0.7)
    twice = _write_runs_record(tmp_path / "twice.json", {"bf16_seed0": (0.8, 0.7)})
    with pytest.raises(SystemExit, match=rf"run 'bf16_seed0' is both {good} and in --record {twice}"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed0", good)], records=[twice])
    killed = _write_planted_run(tmp_path / "fp8_32_seed0", 0, 0.8, 0.7, eval_step=10)  # a folder without its final eval
    same_name = _write_runs_record(tmp_path / "same_name.json", {"fp8_32_seed0": (0.8, 0.7)})
    with pytest.raises(SystemExit, match=rf"run 'fp8_32_seed0' is both {killed} and in --record {same_name}"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed0", good), ("fp8_32_seed0", killed)], records=[same_name])
    other_name = _write_runs_record(tmp_path / "other_name.json", {"bf16_seed00": (0.8, 0.7)})  # seed 0 again, under another name
    with pytest.raises(SystemExit, match=rf"two runs of switch 'bf16' with seed 0 \({good / 'metrics.jsonl'} and {other_name}\)"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed0", good)], records=[other_name])
    cases = {  # file name: (content, what the message says after the file's name)
        "missing.json": (None, ": cannot be read as JSON"),
        "not_json.json": ("{runs: ", ": cannot be read as JSON"),
        "a_list.json": ([1, 2], " holds no `runs`"),
        "no_runs.json": ({"gpu": "x"}, " holds no `runs`"),
        "run_not_a_dict.json": ({"runs": {"fp8_32_seed0": [1]}}, ", run 'fp8_32_seed0': no list of eval records under `evals`"),
        "evals_a_dict.json": ({"runs": {"fp8_32_seed0": {"evals": {"step": 9}}}}, ", run 'fp8_32_seed0': no list of eval records"),
        "no_evals.json": ({"runs": {"fp8_32_seed0": {"evals": []}}}, ", run 'fp8_32_seed0': no list of eval records"),
        "two_tasks.json": (
            {"runs": {"fp8_32_seed0": {"evals": [{"step": 9, "ne_click": 0.8, "auc_click": 0.7, "ne_buy": 0.9, "auc_buy": 0.6}]}}},
            ", run 'fp8_32_seed0', eval of step 9: want the NE and AUC of one task, found tasks \\['buy', 'click'\\]",
        ),
        "null_ne.json": (
            {"runs": {"fp8_32_seed0": {"evals": [{"step": 9, "ne_click": None, "auc_click": 0.7}]}}},
            ", run 'fp8_32_seed0', eval of step 9 lacks \\['ne_click'\\]",
        ),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name if content is None else _bad_record(tmp_path, name, content)
        with pytest.raises(SystemExit, match=rf"--record {path}{message}"):
            _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed0", good)], records=[path])
    badly_named = _write_runs_record(tmp_path / "badly_named.json", {"fp8": (0.8, 0.7)})
    with pytest.raises(SystemExit, match=rf"run 'fp8' is not named <switch>_seed<k> \({badly_named}\)"):
        _switch_table(compare_main, monkeypatch, tmp_path, [("bf16_seed0", good)], records=[badly_named])
    monkeypatch.setattr(sys, "argv", ["compare_runs.py", f"--record={twice}", f"--run=bf16_seed0={good}", "--out=x", "--figure=y"])
    with pytest.raises(SystemExit, match="--record is read only with --switch-table"):
        compare_main()
    monkeypatch.setattr(sys, "argv", ["compare_runs.py", "--out=x", "--figure=y"])
    with pytest.raises(SystemExit, match="name the runs to compare with --run"):
        compare_main()


def test_usage_mistakes_are_named_without_a_traceback(compare_main, monkeypatch, tmp_path):
    run = _write_run(tmp_path / "ref", [2.0, 1.0], [0.9, 0.8], eval_ne=0.8)
    out, figure = f"--out={tmp_path / 'summary.json'}", f"--figure={tmp_path / 'ne.png'}"
    cases = {
        (f"--run={run}", out, figure): rf"--run '{run}': expected name=workdir",
        ("--run=a=" + str(run), "--run=a=" + str(tmp_path), out, figure): r"--run names 'a' twice",
        (f"--run=a={tmp_path / 'nope'}", out, figure): r"nope holds no metrics.jsonl",
        (f"--run=a={run}", f"--out={tmp_path / 'nodir' / 'x.json'}", figure): r"x.json: its folder .*nodir does not exist",
    }
    for argv, message in cases.items():
        monkeypatch.setattr(sys, "argv", ["compare_runs.py", *argv])
        with pytest.raises(SystemExit, match=message):
            compare_main()
