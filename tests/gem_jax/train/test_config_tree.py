"""Configs round-trip through JSON; command-line overrides parse to the field's type or name what is wrong;
`--help-config` gives every field's meaning from its class's docstring."""

import dataclasses
import json
import typing

import pytest

from gem_jax.cli import train_main
from gem_jax.data.config import DataConfig, Source
from gem_jax.train import config_tree
from gem_jax.train.config import ConfigFileError, TrainConfig, load_config
from pallas_kernels import Implementation

CONFIGS = ["movielens.py", "movielens_tiny.py", "movielens_fp8.py", "gem_sharded.py", "gem_sharded_tiny.py", "gem_h200_fp8.py", "gem_h200_wide.py", "events.py", "events_tiny.py", "movielens_gem.py", "planted_gem.py", "planted_sharded.py", "planted_small.py"]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_round_trips_through_json(repo_root, name):
    config = load_config(repo_root / "configs" / name)
    tree = json.loads(json.dumps(config_tree.to_tree(config)))
    assert config_tree.from_tree(TrainConfig, tree) == config


def test_overrides_parse_to_the_field_types(repo_root):
    config = load_config(repo_root / "configs" / "movielens.py")
    out = config_tree.apply_overrides(
        config,
        [
            "loop.num_steps=3",
            "model.embed_dim=128",
            "optim.learning_rate=3e-3",
            "data.source=ML_100K",
            "model.attention_implementation=xla",
            "data.capacity_step=1.05",
            "checkpoint.async_save=false",
            "data.path=None",
        ],
    )
    assert out.loop.num_steps == 3 and out.model.embed_dim == 128 and out.optim.learning_rate == 3e-3
    assert out.data.source is Source.ML_100K and out.model.attention_implementation is Implementation.XLA
    assert out.data.capacity_step == 1.05 and out.checkpoint.async_save is False and out.data.path is None
    assert config_tree.diff(config_tree.to_tree(config), config_tree.to_tree(out))[0][0] == "checkpoint.async_save"


def test_overrides_of_one_config_apply_together_and_later_values_win(repo_root):
    """Fields that must agree change in one step (each alone would be refused: 18 with 2 heads gives an odd head
    size, 3 heads do not divide 16); the config is then checked once, naming every override that made it; a later
    value of a field replaces an earlier one, and a whole part given after edits inside it replaces them."""
    config = load_config(repo_root / "configs" / "movielens_tiny.py")
    out = config_tree.apply_overrides(config, ["model.embed_dim=18", "model.num_heads=3"])
    assert (out.model.embed_dim, out.model.num_heads) == (18, 3)
    assert config_tree.apply_overrides(config, ["model.num_heads=3", "loop.num_steps=5", "model.embed_dim=18"]).model.head_dim == 6
    assert config_tree.apply_overrides(config, ["loop.num_steps=5", "loop.num_steps=7"]).loop.num_steps == 7
    with pytest.raises(config_tree.ConfigError, match=r"^overrides 'model.embed_dim=20', 'model.num_heads=3': ModelConfig.embed_dim 20 is not a multiple"):
        config_tree.apply_overrides(config, ["model.embed_dim=20", "model.num_heads=3", "loop.num_steps=5"])

    @dataclasses.dataclass(frozen=True)
    class Part:
        size: int = 1
        name: str = "a"

    @dataclasses.dataclass(frozen=True)
    class Whole:
        part: Part | None = None

    assert config_tree.apply_overrides(Whole(), ["part.size=4", "part.name=b"]).part == Part(4, "b")  # turned on
    assert config_tree.apply_overrides(Whole(), ["part.size=4", "part=None"]).part is None
    assert config_tree.apply_overrides(Whole(), ["part=None", "part.size=4"]).part == Part(4, "a")


def test_tuple_and_optional_fields():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        sizes: tuple[float, ...] = (1.0,)
        pair: tuple[int, str] = (1, "a")
        limit: int | None = None

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner = Inner()

    out = config_tree.apply_overrides(Outer(), ["inner.sizes=0.5,1", "inner.pair=(2, 'b')", "inner.limit=7"])
    assert out.inner == Inner(sizes=(0.5, 1.0), pair=(2, "b"), limit=7)
    assert config_tree.apply_overrides(Outer(), ["inner.sizes=0.25"]).inner.sizes == (0.25,)  # one bare item
    with pytest.raises(config_tree.ConfigError, match="inner.pair"):  # a fixed-length tuple takes no bare item
        config_tree.apply_overrides(Outer(), ["inner.pair=2"])
    assert config_tree.from_tree(Outer, json.loads(json.dumps(config_tree.to_tree(out)))) == out
    with pytest.raises(config_tree.ConfigError, match=r"inner\.limit: .* fits none of"):
        config_tree.apply_overrides(Outer(), ["inner.limit=x"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("loop.num_stepz=3", "LoopConfig has no field 'num_stepz'; fields: num_steps"),
        ("model.embed_dim=abc", "model.embed_dim: expected an int, got 'abc'"),
        ("model.embed_dim=1.5", "expected an int, got 1.5"),
        ("loop.num_steps", "not of the form path=value"),
        ("data.source=NOPE", "'NOPE' is not a Source"),
        ("model.embed_dim=33", "embed_dim 33 is not a multiple of num_heads"),
        ("loop.seed.x=1", "int has no fields to set"),
        ("model.norm_implementation=CUDNN", "ModelConfig.norm_implementation must be XLA, PALLAS or None, got CUDNN: RMSNorm has no cuDNN"),
        ("model.mlp_implementation=cudnn", "must be XLA, PALLAS or None, got CUDNN: the GELU backward has no cuDNN"),
    ],
)
def test_bad_overrides_name_the_field(repo_root, override, message):
    config = load_config(repo_root / "configs" / "movielens.py")
    with pytest.raises(config_tree.ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config_tree.apply_overrides(config, [override])


@pytest.mark.parametrize(
    "override, message, listed",
    [
        # an optional enum: the members the field accepts (its metadata), as --help-config spells them, and None
        ("model.norm_implementation=FOO", "model.norm_implementation: expected XLA, PALLAS or None, got 'FOO'", "XLA, PALLAS"),
        ("model.mlp_implementation=fast", "model.mlp_implementation: expected XLA, PALLAS or None, got 'fast'", "XLA, PALLAS"),
        ("model.norm_implementation=3", "model.norm_implementation: expected XLA, PALLAS or None, got 3", "XLA, PALLAS"),
        ("model.attention_implementation=FOO", "model.attention_implementation: expected XLA, PALLAS, CUDNN or None, got 'FOO'", "XLA, PALLAS, CUDNN"),
        # a member the enum has but the field does not take: spelled as --help-config writes it, whatever the case given
        ("model.norm_implementation=CUDNN", "ModelConfig.norm_implementation must be XLA, PALLAS or None, got CUDNN: RMSNorm has no cuDNN implementation", "XLA, PALLAS"),
        ("model.norm_implementation=cudnn", "ModelConfig.norm_implementation must be XLA, PALLAS or None, got CUDNN: RMSNorm has no cuDNN implementation", "XLA, PALLAS"),
        ("model.mlp_implementation=Cudnn", "ModelConfig.mlp_implementation must be XLA, PALLAS or None, got CUDNN: the GELU backward has no cuDNN implementation", "XLA, PALLAS"),
        # a plain enum lists its members the same way
        ("model.sequence_attention=FOO", "model.sequence_attention: 'FOO' is not a SequenceAttention (one of FULL, SLIDING_WINDOW, BLOCK_LOCAL, CAUSAL_SILU)", "FULL, SLIDING_WINDOW, BLOCK_LOCAL, CAUSAL_SILU"),
    ],
)
def test_a_bad_enum_value_lists_the_members_as_help_config_writes_them(repo_root, override, message, listed):
    """The refusal names the override, the field, the members it takes (`listed`, as its --help-config line lists
    them) and the value given."""
    config = load_config(repo_root / "configs" / "movielens.py")
    with pytest.raises(config_tree.ConfigError) as error:
        config_tree.apply_overrides(config, [override])
    assert str(error.value) == f"override {override!r}: {message}"
    field = override.split("=")[0]
    (help_line,) = [line for line in config_tree.override_help(TrainConfig) if line.startswith(f"{field}: ")]
    assert help_line.endswith(f"  (one of {listed})")


def test_an_optional_enum_takes_none_and_any_case_of_the_names_help_config_writes(repo_root):
    config = load_config(repo_root / "configs" / "movielens.py")
    for text, member in (("None", None), ("none", None), ("PALLAS", Implementation.PALLAS), ("pallas", Implementation.PALLAS), ("Xla", Implementation.XLA)):
        assert config_tree.apply_overrides(config, [f"model.norm_implementation={text}"]).model.norm_implementation is member


def _help_entries(out: str) -> dict[str, str]:
    """`--help-config` output as {field line: its meaning, unwrapped}, after the heading."""
    entries: dict[str, str] = {}
    field = None
    for line in out.splitlines()[1:]:
        if line.startswith("      "):
            entries[field] = f"{entries[field]} {line.strip()}".strip()
        else:
            field = line.strip()
            entries[field] = ""
    return entries


def test_cli_help_lists_the_fields_and_rejects_bad_overrides(repo_root, monkeypatch, capsys):
    """`--help-config` gives each field's dotted path, type and default, then its docstring entry wrapped to the
    terminal's width (COLUMNS here)."""
    with pytest.raises(SystemExit) as done:
        train_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--set" in out and "--help-config" in out and "--dry-run" in out
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as done:
        train_main(["--help-config"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    entries = _help_entries(out)
    assert entries["loop.eval_every: int = 0"] == "steps between evaluations (0: none before the end); a run that reaches `num_steps` always ends with one."
    assert entries["model.embed_dim: int = 64"] == "width d of every token (history events and feature tokens)."
    assert entries["model.remat.budget_gb: float | None = None"].startswith("the step's device memory budget in GB (1e9 bytes; None: no budget, `policies` decide)")
    assert entries["data.synthetic.num_users: int = 10000"] == "vocabulary sizes including PAD_ID."  # `num_items, num_users: ...`
    assert entries["rules.default_table.out_of_range: OutOfRange = 'ERROR'  (one of ERROR, ZERO, HASH)"].startswith("what a lookup does with an id outside `[0, num_rows)`")
    # an enum field that takes only some of its enum's members lists those (the ones ModelConfig accepts)
    assert "model.attention_implementation: Implementation | None = None  (one of XLA, PALLAS, CUDNN)" in entries
    assert "model.norm_implementation: Implementation | None = None  (one of XLA, PALLAS)" in entries
    assert "model.mlp_implementation: Implementation | None = 'XLA'  (one of XLA, PALLAS)" in entries
    assert "data.capacity_step: float = 1.04\n      ratio of consecutive token capacities near a batch's expected rows," in out
    assert all(meaning and "undocumented" not in meaning for meaning in entries.values())
    assert max(len(line) for line in out.splitlines() if line.startswith("      ")) <= 78  # COLUMNS less argparse's margin of 2
    # one entry per leaf of the config tree, by its dotted path; an optional group that is off (data.bbs) is a leaf,
    # followed by the fields --set may give it (not its workload, a Python callable)
    leaves = list(config_tree.flatten(config_tree.to_tree(TrainConfig(DataConfig()))))
    at = leaves.index("data.bbs") + 1
    assert [field.split(":")[0] for field in entries] == leaves[:at] + ["data.bbs.num_shards", "data.bbs.minibatch_size"] + leaves[at:]
    assert entries["data.bbs.minibatch_size: int = 128"] == "BBS minibatch size, a positive even int (GEM: 128)."
    with pytest.raises(SystemExit) as done:
        train_main(["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", "/nonexistent", "--set", "model.embed_dim=x"])
    assert done.value.code == 2
    assert "model.embed_dim: expected an int" in capsys.readouterr().err


def test_attribute_docs_reads_the_attributes_section_of_a_google_style_docstring():
    doc = """Summary line.

    Text before the section: not an entry.

    Attributes:
      alpha: first line
        continued here.
        Default: a deeper line is text, even in the form of an entry.

        A second paragraph.
      beta, gamma: shared text.
      delta:
        all on the next line.

    Raises:
      ValueError: not a field.
    """
    assert config_tree.attribute_docs(doc) == {
        "alpha": "first line continued here. Default: a deeper line is text, even in the form of an entry. A second paragraph.",
        "beta": "shared text.",
        "gamma": "shared text.",
        "delta": "all on the next line.",
    }
    assert config_tree.attribute_docs("Summary.\n\n    Args:\n      x: an argument, not a field.\n    ") == {}
    assert config_tree.attribute_docs(None) == {}
    # entries level with the header are outside the section: the summary line must not be the header itself
    assert config_tree.attribute_docs("""Attributes:
    steps: not under the header once the docstring is dedented.
    """) == {}
    assert config_tree.override_help(TrainConfig, width=None)[:2] == [
        "data.source: Source = 'ML_LATEST_SMALL'  (one of ML_LATEST_SMALL, ML_100K, AMAZON_BEAUTY, SYNTHETIC, EVENTS)",
        f"    {config_tree.attribute_docs(DataConfig.__doc__)['source']}",
    ]


def _config_classes(tp: typing.Any, found: list[type]) -> list[type]:
    """Every dataclass in type `tp` and, recursively, in its fields' types (through unions and tuples), once each."""
    if isinstance(tp, list):  # a Callable's argument types
        for arg in tp:
            _config_classes(arg, found)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp not in found:
        found.append(tp)
        hints = typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            _config_classes(hints[f.name], found)
    for arg in typing.get_args(tp):
        _config_classes(arg, found)
    return found


def test_every_config_field_has_a_documented_meaning():
    """Each field of every config class reachable from TrainConfig has a non-empty entry in its class's
    `Attributes:` docstring section (what `--help-config` prints), and every entry names a field."""
    classes = _config_classes(TrainConfig, [])
    assert {cls.__name__ for cls in classes} == {
        "TrainConfig", "DataConfig", "SyntheticConfig", "BBSConfig", "ModelConfig", "RematConfig", "OptimConfig",
        "CheckpointConfig", "LoopConfig", "Topology", "ShardingRules", "TableSharding",
    }
    for cls in classes:
        documented = config_tree.attribute_docs(cls.__doc__)
        names = [f.name for f in dataclasses.fields(cls)]
        assert [name for name in names if not documented.get(name)] == [], f"{cls.__qualname__}: fields without an Attributes: entry"
        assert sorted(set(documented) - set(names)) == [], f"{cls.__qualname__}: Attributes: entries that name no field"


def test_an_optional_part_is_turned_on_by_name_or_by_one_of_its_fields(repo_root):
    config = load_config(repo_root / "configs" / "movielens.py")
    assert config.data.bbs is None
    by_name = config_tree.apply_overrides(config, ["data.bbs=BBSConfig"]).data.bbs
    by_field = config_tree.apply_overrides(config, ["data.bbs.minibatch_size=64"]).data.bbs
    assert by_name is not None and by_name.minibatch_size == 128 and by_field.minibatch_size == 64


def test_a_missing_data_set_is_refused_without_a_traceback(repo_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        train_main(
            ["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path), "--no-progress",
             "--set", "data.source=ML_100K", f"data.path={tmp_path / 'nowhere'}"]
        )
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "ML_100K data set not found" in err and "Traceback" not in err


def test_an_implementation_this_machine_lacks_is_refused_at_start_up(repo_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        train_main(
            ["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path), "--no-progress",
             "--set", "model.attention_implementation=pallas"]
        )
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "no Hopper GPU" in err and "Traceback" not in err


BROKEN_CONFIGS = {
    # file text -> (line, what the one error line says)
    "from gem_jax.train.config import TrainConfig\n\ndef get_config(:\n    pass\n": (3, "SyntaxError: invalid syntax: def get_config(:"),
    "import gem_jax.no_such_module\n": (1, "ModuleNotFoundError: No module named 'gem_jax.no_such_module'"),
    "from gem_jax.data.config import DataConfig\nfrom gem_jax.train.config import TrainConfig\n\n\ndef get_config():\n"
    "    return TrainConfig(data=DataConfig(), loop=LoopConfg())\n": (6, "NameError: name 'LoopConfg' is not defined"),
    "from gem_jax.data.config import DataConfig\nfrom gem_jax.train.config import LoopConfig, TrainConfig\n\n\ndef get_config():\n"
    "    return TrainConfig(data=DataConfig(), loop=LoopConfig(num_steps=0))\n": (6, "ValueError: LoopConfig.num_steps must be >= 1, got 0"),
}


@pytest.mark.parametrize("text", BROKEN_CONFIGS, ids=["syntax", "import", "name", "field-check"])
def test_a_config_file_that_does_not_run_is_refused_naming_file_and_line(tmp_path, capsys, text):
    line, what = BROKEN_CONFIGS[text]
    path = tmp_path / "broken.py"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as error:
        load_config(path)
    assert str(error.value) == f"{path}, line {line}: {what}"
    with pytest.raises(SystemExit) as done:
        train_main(["--config", str(path), "--workdir", str(tmp_path / "run")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"gem-train: error: {path}, line {line}: {what}" and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_config_that_is_not_a_python_file_or_defines_no_get_config_is_named(repo_root, tmp_path, capsys):
    readme = repo_root / "README.md"
    with pytest.raises(SystemExit) as done:
        train_main(["--config", str(readme), "--workdir", str(tmp_path / "run")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"gem-train: error: {readme}: a config is a Python file (.py) defining get_config(), e.g. configs/movielens.py"
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(TypeError, match=rf"^{empty}: defines no get_config\(\)"):
        load_config(empty)


def test_repeated_set_options_accumulate_in_order(repo_root, tmp_path, monkeypatch, capsys):
    """Every --set applies, in the order given; a later value for the same field wins, as within one --set."""
    from gem_jax.train import loop

    seen = []
    monkeypatch.setattr(loop, "dry_run", lambda config, workdir, force_new=False: seen.append(config))
    train_main(
        ["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path / "run"), "--dry-run",
         "--set", "optim.learning_rate=0.003", "--set", "loop.num_steps=9", "model.embed_dim=16", "--set", "loop.num_steps=7"]
    )
    (config,) = seen
    assert config.optim.learning_rate == 0.003 and config.model.embed_dim == 16 and config.loop.num_steps == 7
    with pytest.raises(SystemExit) as done:
        train_main(["--help"])
    assert done.value.code == 0
    assert "repeatable: the overrides of every --set apply in order, and a later value for the same field wins" in " ".join(
        capsys.readouterr().out.split()
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.embed_dim=0", "ModelConfig.embed_dim must be >= 1, got 0"),
        ("model.embed_dim=-4", "ModelConfig.embed_dim must be >= 1, got -4"),
        ("model.embed_dim=-1", "ModelConfig.embed_dim must be >= 1, got -1"),
        ("model.num_heads=0", "ModelConfig.num_heads must be >= 1, got 0"),
        ("model.num_seq_layers=-1", "ModelConfig.num_seq_layers must be >= 0, got -1"),
        ("model.mlp_ratio=0", "ModelConfig.mlp_ratio must be >= 1, got 0"),
        ("model.num_pooled_queries=0", "ModelConfig.num_pooled_queries must be >= 1, got 0"),
        ("model.num_dhen_layers=-1", "ModelConfig.num_dhen_layers must be >= 0, got -1"),
        ("model.head_hidden=0", "ModelConfig.head_hidden must be >= 1, got 0"),
        ("model.rope_base=0", "ModelConfig.rope_base must be > 0, got 0.0"),
        ("model.rope_base=-1e4", "ModelConfig.rope_base must be > 0, got -10000.0"),
        ("model.attention_window=-1", "ModelConfig.attention_window must be >= 0, got -1"),
        ("model.attention_block_size=0", "ModelConfig.attention_block_size must be >= 1, got 0"),
        ("model.embed_dim=18", "ModelConfig head_dim = embed_dim // num_heads = 18 // 2 = 9 must be even for RoPE"),
    ],
)
def test_model_sizes_out_of_range_are_refused_naming_the_field(repo_root, tmp_path, capsys, override, message):
    """Each bad size is refused where the config is built (exit 2, the override and field named), not by a
    ZeroDivisionError, a complex-number TypeError or a zero-size checkpoint later."""
    with pytest.raises(SystemExit) as done:
        train_main(["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path / "run"), "--dry-run", "--set", override])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"gem-train: error: override {override!r}: {message}" and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_model_config_checks_types_and_keeps_zero_layer_ablations():
    from gem_jax.model.config import ModelConfig

    with pytest.raises(TypeError, match=r"ModelConfig.embed_dim must be an int, got 64.0 \(float\)"):
        ModelConfig(embed_dim=64.0)
    with pytest.raises(TypeError, match=r"ModelConfig.rope_base must be a number, got '1e4' \(str\)"):
        ModelConfig(rope_base="1e4")
    with pytest.raises(ValueError, match="ModelConfig.rope_base must be finite, got inf"):
        ModelConfig(rope_base=float("inf"))
    # No self-attention blocks or no DHEN layers: ablations that build and train.
    assert ModelConfig(num_seq_layers=0, num_dhen_layers=0).region_names[0] == "history_context"
