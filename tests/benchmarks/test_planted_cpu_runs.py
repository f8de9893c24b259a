"""benchmarks/planted_cpu_runs.py: a run's name sets its width and seed, and every override builds the tiny config."""

from gem_jax.train.config import load_config
from gem_jax.train.config_tree import apply_overrides


def test_a_runs_name_sets_its_width_and_seed_and_the_recipe_builds(load_benchmark, repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))  # the script imports benchmarks.compare_runs
    runs = load_benchmark("planted_cpu_runs")
    assert runs.name_overrides("on_d32_seed2") == [
        "model.embed_dim=32", "model.num_seq_layers=2", "model.num_pooled_queries=2", "model.head_hidden=64", "loop.seed=2", "data.seed=2",
    ]
    assert runs.name_overrides("on_d128")[3] == "model.head_hidden=128" and runs.name_overrides("off") == []
    config = apply_overrides(load_config(repo_root / "configs" / "events_tiny.py"), [*runs.RECIPE, *runs.name_overrides("on_d32_seed1"), "data.history_item_features=True"])
    assert (config.model.embed_dim, config.loop.seed, config.optim.embedding_initial_accumulator, config.data.history_item_features) == (32, 1, 0.0, True)
    assert (runs.PLANTED.num_users, runs.PLANTED.num_items, runs.PLANTED.num_categories) == (300, 200, 20)
