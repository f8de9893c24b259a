"""benchmarks/switch_table.py: every switch's overrides build configs/planted_sharded.py's config, the call plan, and what `train` runs and exports."""

import json
import subprocess
import tarfile

import pytest

from gem_jax.model.config import Fp8Region, SequenceAttention
from gem_jax.train.config import load_config
from gem_jax.train.config_tree import apply_overrides
from pallas_kernels import Implementation


@pytest.fixture(scope="module")
def switch_table(repo_root):
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(repo_root))
        from benchmarks import switch_table

    return switch_table


@pytest.fixture(scope="module")
def planted_sharded(repo_root):
    return load_config(repo_root / "configs" / "planted_sharded.py")


EXPECTED = {  # switch -> the model or optimizer fields its overrides set (every other field stays the reference's)
    "bf16": {},
    "fp8_32": {"fp8": True, "fp8_block": 32},
    "fp8_128": {"fp8": True, "fp8_block": 128},
    "fp8_hadamard": {"fp8": True, "fp8_block": 128, "fp8_hadamard": True},
    "fp8_dhen": {"fp8": True, "fp8_block": 32, "fp8_regions": (Fp8Region.SEQ_ATTENTION, Fp8Region.SEQ_MLP, Fp8Region.POOLED, Fp8Region.CROSS)},
    "fp8_saved": {"fp8_saved_activations": True},
    "sliding_256": {"sequence_attention": SequenceAttention.SLIDING_WINDOW, "attention_window": 256},
    "block_local_64": {"sequence_attention": SequenceAttention.BLOCK_LOCAL, "attention_block_size": 64},
    "bf16_moments": {"optim.moments_dtype": "bfloat16"},
    "bf16_weights": {"optim.weights_dtype": "bfloat16"},
}


def test_planted_sharded_is_the_gem_sharded_model_in_bf16(repo_root, planted_sharded):
    sharded = load_config(repo_root / "configs" / "gem_sharded.py").model
    model = planted_sharded.model
    assert (model.embed_dim, model.num_heads, model.num_seq_layers, model.num_dhen_layers) == (256, 2, 2, 2)
    assert model == sharded and model.compute_dtype == "bfloat16" and model.sequence_attention == SequenceAttention.FULL and not model.fp8
    assert planted_sharded.data.max_seq_len == 1024 and planted_sharded.topology.num_devices == 1


@pytest.mark.parametrize("switch", sorted(EXPECTED))
def test_every_switch_parses_and_sets_only_its_model_or_optimizer_fields(switch_table, planted_sharded, switch):
    assert set(switch_table.SWITCHES) == set(EXPECTED)
    config = apply_overrides(planted_sharded, switch_table.run_overrides(f"{switch}_seed2"))

    def fields(c):  # every model field by name, every optimizer field as "optim.<name>"
        return {**vars(c.model), **{f"optim.{f}": v for f, v in vars(c.optim).items()}}

    changed = {name: fields(config)[name] for name in EXPECTED[switch]}
    assert changed == EXPECTED[switch]
    assert config.model.norm_implementation is Implementation.XLA  # the table's one numerics (`TABLE_OVERRIDES`)
    rest = {f: v for f, v in fields(config).items() if f not in {*EXPECTED[switch], "norm_implementation"}}
    assert rest == {f: fields(planted_sharded)[f] for f in rest}
    assert (config.loop.seed, config.data.seed) == (2, 2)
    assert config.data.path == planted_sharded.data.path


def test_bad_run_names_are_refused(switch_table):
    with pytest.raises(ValueError, match=r"run 'fp8_64_seed0': not <switch>_seed<k> with a switch of"):
        switch_table.run_overrides("fp8_64_seed0")
    with pytest.raises(ValueError, match=r"run 'bf16': not <switch>_seed<k>"):
        switch_table.run_overrides("bf16")


def test_the_first_pass_is_three_calls_a_preset(switch_table):
    # the reference's three seeds and every switch's seed 0, five runs a call
    switches = [s for s in switch_table.SWITCHES if s != "bf16"]
    calls = switch_table.plan(["long-range", "short-range"], switches, [0], [0, 1, 2], 5)
    assert [(preset, len(names)) for preset, names in calls] == [("long-range", 5), ("long-range", 5), ("long-range", 2),
                                                                 ("short-range", 5), ("short-range", 5), ("short-range", 2)]
    assert calls[0][1] == ["bf16_seed0", "bf16_seed1", "bf16_seed2", "fp8_32_seed0", "fp8_128_seed0"]
    assert calls[1][1] == ["fp8_hadamard_seed0", "fp8_dhen_seed0", "fp8_saved_seed0", "sliding_256_seed0", "block_local_64_seed0"]
    assert calls[2][1] == ["bf16_moments_seed0", "bf16_weights_seed0"]
    assert switch_table.plan(["short-range"], ["fp8_32", "fp8_saved"], [1, 2], [], 5) == [
        ("short-range", ["fp8_32_seed1", "fp8_32_seed2", "fp8_saved_seed1", "fp8_saved_seed2"])
    ]


def test_plan_prints_one_train_command_a_call_with_the_export_folder(switch_table, capsys):
    assert switch_table.main(["plan", "--presets", "short-range", "--switches", "fp8_32", "--seeds", "1", "2", "--reference-seeds", "--export", "$OUT"]) == 0
    assert capsys.readouterr().out == 'python3 benchmarks/switch_table.py train --preset short-range fp8_32_seed1 fp8_32_seed2 --export "$OUT"\n'


def test_train_runs_quality_runs_and_exports_the_tables_inputs(switch_table, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    where = switch_table.paths("short-range")
    for file in (where["log"] / "oracle.json", where["log"] / "planted.json", where["converted"] / "manifest.json",
                 where["runs"] / "bf16_seed0" / "metrics.jsonl", where["runs"] / "bf16_seed0.log"):
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("{}")
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: calls.append((command, kw)) or subprocess.CompletedProcess(command, 1))
    monkeypatch.delenv("GEM_MEM_FRACTION", raising=False)
    status = switch_table.train("short-range", ["bf16_seed0", "fp8_32_seed0"], tmp_path / "out")
    (command, kw), = calls  # the log is there: no planting, no converting
    assert status == 1
    assert command == [
        "bash", "benchmarks/quality_runs.sh", "switch_table_short_range", "configs/planted_sharded.py", "data.path=runs/planted/short-range/converted",
        "bf16_seed0=model.norm_implementation=xla loop.seed=0 data.seed=0",
        "fp8_32_seed0=model.norm_implementation=xla model.fp8=True model.fp8_block=32 loop.seed=0 data.seed=0",
    ]
    assert kw["env"]["GEM_COMPARE"] == "0" and kw["env"]["GEM_MEM_FRACTION"] == "0.30"  # two runs: the most a run takes
    with tarfile.open(tmp_path / "out" / "switch_table_short_range.tar.gz") as archive:
        exported = sorted(archive.getnames())
    assert exported == [
        "runs/planted/short-range/log/oracle.json", "runs/planted/short-range/log/planted.json",
        "runs/quality/switch_table_short_range/bf16_seed0.log", "runs/quality/switch_table_short_range/bf16_seed0/metrics.jsonl",
    ]  # what the failed fp8_32 run left: nothing
    monkeypatch.setenv("GEM_MEM_FRACTION", "0.3")
    with pytest.raises(ValueError, match=r"4 runs at GEM_MEM_FRACTION=0.3 each ask for more than the GPU's memory"):
        switch_table.train("short-range", ["bf16_seed0", "bf16_seed1", "bf16_seed2", "fp8_32_seed0"], None)


def test_the_memory_share_splits_nine_tenths_over_the_runs_at_most_three_tenths_each(switch_table):
    assert [switch_table.mem_fraction(n) for n in (1, 3, 4, 5, 6, 7)] == ["0.30", "0.30", "0.22", "0.18", "0.15", "0.12"]


def test_the_second_pass_wants_the_missing_seeds_of_switches_within_two_spreads(switch_table):
    result = {
        "switches": [{"switch": "bf16", "seeds": [0, 1, 2]}, {"switch": "fp8_32", "seeds": [0]}, {"switch": "fp8_saved", "seeds": [0, 2]}],
        "needs_more_seeds": ["fp8_32", "fp8_saved"],
    }
    assert switch_table.more_seeds(result) == ["fp8_32_seed1", "fp8_32_seed2", "fp8_saved_seed1"]


def test_a_runs_devices_and_commit_come_from_its_run_record_or_its_log(switch_table, tmp_path):
    run = tmp_path / "bf16_seed0"
    run.mkdir()
    (tmp_path / "bf16_seed0.log").write_text(
        "gem-train: compilation cache x\ngem-train: 1 x NVIDIA H200 (gpu), jax 0.11.2; XLA_CLIENT_MEM_FRACTION=0.15 of each GPU's memory\n"
    )
    (run / "run.json").write_text(json.dumps({"version": {"commit": "6c37ccd7d218799f0e67e98d5479f81e118c5447", "jax": "0.11.2"}}))
    assert switch_table.trained_on(run) == "1 x NVIDIA H200 (gpu), jax 0.11.2; XLA_CLIENT_MEM_FRACTION=0.15 of each GPU's memory; commit 6c37ccd7d218"
    (run / "run.json").write_text(json.dumps({"version": {"commit": "6c37ccd7d218799f0e67e98d5479f81e118c5447+modified"}}))
    assert switch_table.trained_on(run).endswith("; commit 6c37ccd7d218+modified")
    # A run.json that records its devices is read first; the log is only for runs recorded before.
    recorded = {"commit": "682d161aa2b74175c9efd37f0af49dfd7606dc18", "jax": "0.11.2", "devices": "2 x NVIDIA H200 (gpu)",
                "memory_share": "XLA_CLIENT_MEM_FRACTION=0.15"}
    (run / "run.json").write_text(json.dumps({"version": recorded}))
    assert switch_table.trained_on(run) == "2 x NVIDIA H200 (gpu), jax 0.11.2; XLA_CLIENT_MEM_FRACTION=0.15 of each GPU's memory; commit 682d161aa2b7"
    bare = tmp_path / "fp8_32_seed0"
    bare.mkdir()
    assert switch_table.trained_on(bare) == "unknown; commit unknown"


def test_a_recorded_runs_device_is_its_runs_records(switch_table, tmp_path):
    record = tmp_path / "switch_table_long_range_runs.json"
    record.write_text(json.dumps({"gpu": "one NVIDIA H200 (141 GB), jax 0.11.2", "runs": {"bf16_seed0": {}, "fp8_32_seed0": {}}}))
    where = f"one NVIDIA H200 (141 GB), jax 0.11.2 (runs record {record})"
    assert switch_table.recorded_on(record) == {"bf16_seed0": where, "fp8_32_seed0": where}
    record.write_text(json.dumps({"runs": {"bf16_seed0": {}}}))
    assert switch_table.recorded_on(record) == {"bf16_seed0": f"unknown (runs record {record})"}


def test_table_forwards_records_and_reruns_names_another_view_and_keeps_a_rerun_folders_place(switch_table, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = switch_table.paths("long-range")["runs"] / "bf16_seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "run.json").write_text(json.dumps({"version": {"commit": "be94c30a8e31eef5", "jax": "0.11.2", "devices": "1 x NVIDIA H100 (gpu)"}}))
    record = tmp_path / "first_pass.json"
    record.write_text(json.dumps({"gpu": "one NVIDIA H200", "runs": {"bf16_seed0": {}, "fp8_32_seed0": {}}}))
    commands = []

    def compare_runs(command, **kwargs):  # stands in for the compare_runs subprocess: writes an empty table
        commands.append(command)
        out = tmp_path / command[command.index("--out") + 1]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"switches": [], "needs_more_seeds": []}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(switch_table.subprocess, "run", compare_runs)
    assert switch_table.table("long-range", [record], ["bf16_seed0"], name="reference_rerun", title="retrained") == 0
    command = commands[0]
    assert f"--record={record}" in command and "--rerun=bf16_seed0" in command and f"--run=bf16_seed0={run}" in command
    assert command[command.index("--title") + 1] == "retrained"
    assert command[command.index("--out") + 1] == "benchmarks/results/switch_table_long_range_reference_rerun.json"
    assert command[command.index("--figure") + 1] == "benchmarks/figures/switch_table_long_range_reference_rerun.png"
    trained_on = json.loads((tmp_path / "benchmarks/results/switch_table_long_range_reference_rerun.json").read_text())["trained_on"]
    assert trained_on["bf16_seed0"].startswith("1 x NVIDIA H100 (gpu), jax 0.11.2") and trained_on["bf16_seed0"].endswith("commit be94c30a8e31")
    assert trained_on["fp8_32_seed0"] == f"one NVIDIA H200 (runs record {record})"
