"""A workdir remembers what produced its run: restarts with other settings refuse, load_params restores it."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

import gem_jax
from gem_jax.model.remat import RematConfig, RematPolicy
from gem_jax.train import legacy_runs, run_record
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.config import load_config
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.restore import load_params
from gem_jax.train.setup import setup_training


@pytest.fixture(scope="module")
def tiny_config(repo_root):
    return load_config(repo_root / "configs" / "movielens_tiny.py")


@pytest.fixture(scope="module")
def finished_run(tiny_config, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("finished")
    return workdir, train_and_evaluate(tiny_config, workdir)


def test_the_workdir_records_config_data_and_code(finished_run, tiny_config):
    workdir, _ = finished_run
    record = json.loads((workdir / "run.json").read_text())
    assert record["config"]["model"]["embed_dim"] == tiny_config.model.embed_dim
    assert record["config"]["data"]["source"] == "ML_LATEST_SMALL"
    assert record["data"]["num_train_examples"] > 0 and len(record["data"]["fingerprint"]) == 64
    assert record["spec"]["num_items"] > 0 and record["spec"]["tasks"] == ["like", "love"]
    assert set(record["version"]) == {"gem_jax", "commit", "jax", *run_record.device_record(), "computed_with"}
    assert record["version"]["computed_with"]["model.norm_implementation"] is None  # the default
    assert record["version"]["devices"] == f"{jax.device_count()} x {jax.devices()[0].device_kind} ({jax.default_backend()})"


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda c: dataclasses.replace(c, optim=dataclasses.replace(c.optim, learning_rate=0.5)), "config.optim.learning_rate"),
        (lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, embed_dim=16)), "config.model.embed_dim"),
        (lambda c: dataclasses.replace(c, data=dataclasses.replace(c.data, batch_size=32)), "config.data.batch_size"),
        (lambda c: dataclasses.replace(c, data=dataclasses.replace(c.data, seed=3)), "config.data.seed"),
    ],
)
def test_a_restart_with_another_config_refuses_naming_the_field(finished_run, tiny_config, change, field):
    workdir, _ = finished_run
    before = {p.name: p.stat().st_mtime_ns for p in workdir.rglob("*")}
    with pytest.raises(run_record.RunMismatchError, match=field.replace(".", r"\.")) as error:
        train_and_evaluate(change(tiny_config), workdir)
    assert "--force-new" in str(error.value)
    assert {p.name: p.stat().st_mtime_ns for p in workdir.rglob("*")} == before  # nothing touched


def test_observation_settings_may_change(finished_run, tiny_config):
    workdir, first = finished_run
    relaxed = dataclasses.replace(
        tiny_config,
        loop=dataclasses.replace(tiny_config.loop, log_every=3),
        model=dataclasses.replace(tiny_config.model, remat=RematConfig(policies=(("seq*", RematPolicy.SAVE_NOTHING),))),
    )
    again = train_and_evaluate(relaxed, workdir)  # finished: re-reports the same run
    assert again["auc_like"] == first["auc_like"]


def test_another_data_set_refuses(tiny_config, tmp_path, repo_root):
    copy = tmp_path / "ml"
    copy.mkdir()
    for f in (repo_root / "data" / "ml-latest-small").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    config = dataclasses.replace(tiny_config, data=dataclasses.replace(tiny_config.data, path=str(copy)))
    config = dataclasses.replace(config, loop=dataclasses.replace(config.loop, num_steps=1))
    train_and_evaluate(config, tmp_path / "run")
    ratings = copy / "ratings.csv"
    ratings.write_text(ratings.read_text().replace("\n1,1,4.0,", "\n1,1,3.5,", 1))
    with pytest.raises(run_record.RunMismatchError, match=r"data\.fingerprint"):
        train_and_evaluate(config, tmp_path / "run")


def test_force_new_moves_the_old_run_aside(tiny_config, tmp_path):
    config = dataclasses.replace(tiny_config, loop=dataclasses.replace(tiny_config.loop, num_steps=1))
    train_and_evaluate(config, tmp_path)
    other = dataclasses.replace(config, optim=dataclasses.replace(config.optim, learning_rate=0.03))
    train_and_evaluate(other, tmp_path, force_new=True)
    (archived,) = (tmp_path / run_record.ARCHIVE_DIR).iterdir()
    assert json.loads((archived / "run.json").read_text())["config"]["optim"]["learning_rate"] == config.optim.learning_rate
    assert json.loads((tmp_path / "run.json").read_text())["config"]["optim"]["learning_rate"] == 0.03


def test_load_params_reproduces_the_runs_eval(finished_run):
    workdir, summary = finished_run
    run = load_params(workdir)
    assert run.step == summary["step"]
    training, _ = setup_training(run.config, init_state=False)
    metrics = training.evaluate(run.params)
    for key in ("auc_like", "auc_love", "ne_like"):
        np.testing.assert_allclose(metrics[key], summary[key], rtol=1e-6, err_msg=key)  # the same eval, recomputed: float32 u
    model = run.model()  # a plain module with the restored parameters
    assert isinstance(model, gem_jax.GEMModel)


def test_load_params_names_what_is_missing(tmp_path, finished_run):
    with pytest.raises(FileNotFoundError, match="run.json not found"):
        load_params(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 999 .*steps: \["):
        load_params(finished_run[0], step=999)
    with pytest.raises(TypeError, match=r"load_params: step must be an int .*, got '6'"):
        load_params(finished_run[0], step="6")


@pytest.fixture(scope="module")
def legacy_run(finished_run, tiny_config, tmp_path_factory):
    """The finished run as the fixed MovieLens layout wrote runs: its spec in run.json, user tables
    `embed/user/0..3` and the genre layer `embed/genres` in its checkpoint."""
    workdir, summary = finished_run
    legacy = tmp_path_factory.mktemp("legacy")
    record = json.loads((workdir / "run.json").read_text())
    spec = record["spec"]
    sizes = {f["name"]: f["vocab_size"] for f in spec["user_features"]}
    record["spec"] = {
        "num_items": spec["num_items"], "num_users": sizes["user"], "num_actions": spec["num_actions"],
        "num_time_buckets": spec["num_time_buckets"], "num_genres": spec["item_features"][0]["vocab_size"] - 1,
        "num_ages": sizes["age"], "num_genders": sizes["gender"], "num_occupations": sizes["occupation"], "max_seq_len": spec["max_seq_len"],
    }  # fmt: skip
    run_record.write_record(legacy, record)
    training, _ = setup_training(tiny_config, init_state=False)
    old = Checkpointer(workdir / "checkpoints", tiny_config.checkpoint, read_only=True)
    state = old.restore_state(summary["step"], training.state.abstract)
    old.close()
    saver = Checkpointer(legacy / "checkpoints", tiny_config.checkpoint)
    saver.save(summary["step"], legacy_runs.legacy_names(state), training.dataset.train_iterator(), force=True)
    saver.close()
    return legacy


def test_load_params_reads_a_run_written_before_the_feature_schema(legacy_run, finished_run):
    run, legacy = load_params(finished_run[0]), load_params(legacy_run)
    assert legacy.spec == run.spec
    np.testing.assert_equal(jax.tree.map(np.asarray, legacy.params), jax.tree.map(np.asarray, run.params))


def test_resuming_a_run_written_before_the_feature_schema_is_refused(legacy_run, finished_run):
    record = json.loads((finished_run[0] / "run.json").read_text())
    with pytest.raises(run_record.RunMismatchError, match=r"a run of a gem-jax before the feature schema .*embed/user/0..3 .*--force-new"):
        run_record.check_run(legacy_run, record, has_checkpoints=True, write=False)


def test_a_differing_feature_spec_is_a_mismatch():
    old = {"config": {"seed": 0}, "data": {"source": "X"}, "spec": {"tasks": ["like", "love"], "num_items": 5}}
    new = {"config": {"seed": 0}, "data": {"source": "X"}, "spec": {"tasks": ["like"], "num_items": 5}}
    assert run_record.mismatches(old, new) == [("spec.tasks", ["like", "love"], ["like"])]


def test_a_record_written_before_history_item_features_reads_as_without(tmp_path):
    """A run recorded before `data.history_item_features` (config and spec) had none: its record reads as
    False in both places, so a restart with the default is no mismatch and one with True is."""
    old = {"config": {"data": {"source": "EVENTS"}, "optim": {}}, "data": {}, "spec": {"tasks": ["click"], "num_items": 5}}
    (tmp_path / run_record.RUN_FILE).write_text(json.dumps(old))
    record = run_record.read_record(tmp_path)
    assert record["config"]["data"]["history_item_features"] is False and record["spec"]["history_item_features"] is False
    new = json.loads(json.dumps(record))
    assert run_record.mismatches(record, new) == []
    new["config"]["data"]["history_item_features"] = new["spec"]["history_item_features"] = True
    assert {field for field, _, _ in run_record.mismatches(record, new)} == {"config.data.history_item_features", "spec.history_item_features"}


def test_a_record_written_before_the_norm_setting_reads_as_flax_norms(tmp_path, tiny_config):
    """A run recorded before `model.norm_implementation` ran flax's norms, which "xla" computes bit for bit: its
    record reads as "xla". The setting may change on a restart (the same function and parameters), so neither the
    default nor the kernels is a mismatch, while a trained value still is."""
    record = run_record.make_record(tiny_config, {}, None)
    del record["config"]["model"]["norm_implementation"]
    run_record.write_record(tmp_path, record)
    assert run_record.read_record(tmp_path)["config"]["model"]["norm_implementation"] == "XLA"
    assert run_record.check_run(tmp_path, run_record.make_record(tiny_config, {}, None), has_checkpoints=True, write=False)
    kernels = dataclasses.replace(tiny_config, model=dataclasses.replace(tiny_config.model, norm_implementation="pallas"))
    assert run_record.check_run(tmp_path, run_record.make_record(kernels, {}, None), has_checkpoints=True, write=False)
    wider = dataclasses.replace(kernels, model=dataclasses.replace(kernels.model, embed_dim=2 * kernels.model.embed_dim))
    with pytest.raises(run_record.RunMismatchError, match=r"config.model.embed_dim: recorded"):
        run_record.check_run(tmp_path, run_record.make_record(wider, {}, None), has_checkpoints=True, write=False)


def test_a_record_written_before_kept_bf16_weights_reads_as_casting_and_may_restart_with_them(tmp_path, tiny_config):
    """Before `optim.keep_compute_params` every forward cast the float32 weights: such a record reads as False, and a
    restart that keeps the bfloat16 weights (the default) continues it (the same values)."""
    record = run_record.make_record(tiny_config, {}, None)
    del record["config"]["optim"]["keep_compute_params"]
    run_record.write_record(tmp_path, record)
    assert run_record.read_record(tmp_path)["config"]["optim"]["keep_compute_params"] is False
    assert run_record.check_run(tmp_path, run_record.make_record(tiny_config, {}, None), has_checkpoints=True, write=False)


def test_a_restart_under_another_norm_implementation_or_remat_budget_is_noted_once(tmp_path, tiny_config):
    """The settings that change how values are computed (`COMPUTED_WITH`) may change on a restart; each start's are in
    its `version`, so the change is appended to `resumed_with` once, and the first start's stay in `version`."""
    run_record.check_run(tmp_path, run_record.make_record(tiny_config, {}, None), has_checkpoints=False)
    first = run_record.read_record(tmp_path)["version"]["computed_with"]
    assert first["model.norm_implementation"] == tiny_config.model.norm_implementation  # None: the default
    assert all(path in ("model.norm_implementation", "model.mlp_implementation", "optim.keep_compute_params") or path.startswith("model.remat.") for path in first)
    assert first["optim.keep_compute_params"] is True and first["model.mlp_implementation"] == "XLA"
    assert len(first) > 1  # the remat budget's leaves too
    kernels = dataclasses.replace(tiny_config, model=dataclasses.replace(tiny_config.model, norm_implementation="pallas"))
    for _ in range(2):
        run_record.check_run(tmp_path, run_record.make_record(kernels, {}, None), has_checkpoints=True)
    record = run_record.read_record(tmp_path)
    assert [v["computed_with"]["model.norm_implementation"] for v in record["resumed_with"]] == ["PALLAS"]
    assert record["version"]["computed_with"] == first
    assert record["config"]["model"]["norm_implementation"] == first["model.norm_implementation"]  # the first start's


@pytest.mark.parametrize("value", ["float32", "bfloat16"])
def test_a_run_recorded_with_a_removed_option_restarts_and_loads(finished_run, tiny_config, tmp_path, value):
    """`optim.gradient_dtype` (recorded by earlier versions, either value) is dropped on reading:
    the same config restarts without a mismatch, and load_params reads the run."""
    workdir = tmp_path / "run"
    shutil.copytree(finished_run[0], workdir)
    record = json.loads((workdir / run_record.RUN_FILE).read_text())
    record["config"]["optim"]["gradient_dtype"] = value
    (workdir / run_record.RUN_FILE).write_text(json.dumps(record))
    read = run_record.read_record(workdir)
    assert "gradient_dtype" not in read["config"]["optim"]
    now = run_record.make_record(tiny_config, read["data"], None)
    assert [row for row in run_record.mismatches(read, now) if row[0].startswith("config.")] == []
    assert load_params(workdir).step == finished_run[1]["step"]


def test_a_restart_notes_each_change_of_code_or_devices_once(tmp_path):
    """`resumed_with` gets an entry when a start's version differs from the one the run last started with: a
    record from before `devices` existed gains one, not one a restart, and a restart at another memory share
    is noted once, not again by the restarts after it."""
    config = {"config": {"seed": 0}, "data": {"source": "X"}, "spec": None}
    first = {"gem_jax": "0.1", "commit": "abc", "jax": "0.11.2"}  # written before the record held the devices
    (tmp_path / run_record.RUN_FILE).write_text(json.dumps({**config, "version": first}))
    gpu = {**first, "devices": "1 x NVIDIA H200 (gpu)", "memory_share": "XLA_CLIENT_MEM_FRACTION=0.9"}
    for _ in range(2):
        run_record.check_run(tmp_path, {**config, "version": gpu}, has_checkpoints=True)
    assert run_record.read_record(tmp_path)["resumed_with"] == [gpu]
    shared = {**gpu, "memory_share": "XLA_CLIENT_MEM_FRACTION=0.15"}
    for _ in range(2):
        run_record.check_run(tmp_path, {**config, "version": shared}, has_checkpoints=True)
    assert run_record.read_record(tmp_path)["resumed_with"] == [gpu, shared]
    run_record.check_run(tmp_path, {**config, "version": {**shared, "commit": "def"}}, has_checkpoints=True)
    assert [v["commit"] for v in run_record.read_record(tmp_path)["resumed_with"]] == ["abc", "abc", "def"]
    assert run_record.read_record(tmp_path)["version"] == first  # the first start's, kept
