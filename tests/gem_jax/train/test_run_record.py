"""A workdir remembers what produced its run: restarts with other settings refuse, load_params restores it."""

import dataclasses
import json

import numpy as np
import pytest

import gem_jax
from gem_jax.model.remat import RematConfig, RematPolicy
from gem_jax.train import run_record
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
    assert record["spec"]["num_items"] > 0
    assert set(record["version"]) == {"gem_jax", "commit", "jax"}


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
        np.testing.assert_allclose(metrics[key], summary[key], rtol=1e-6, err_msg=key)
    model = run.model()  # a plain module with the restored parameters
    assert isinstance(model, gem_jax.GEMModel)


def test_load_params_names_what_is_missing(tmp_path, finished_run):
    with pytest.raises(FileNotFoundError, match="run.json not found"):
        load_params(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 999 .*steps: \["):
        load_params(finished_run[0], step=999)
