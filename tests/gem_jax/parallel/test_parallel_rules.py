"""Logical-axis rules: shape-aware specs, table placements, and the golden sharding table of configs/gem_sharded.py.

Regenerate the golden table after an intended change with
`GEM_UPDATE_GOLDEN=1 pytest tests/gem_jax/parallel/test_parallel_rules.py`.
"""

import json
import os
from pathlib import Path

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gem_jax.train.config import load_config
from gem_jax.data.sources.synthetic import synthetic_spec
from gem_jax.model.gem import GEMModel
from gem_jax.nn.embeddings import Generation, TableSharding, padded_table_rows, place_table
from gem_jax.mesh import EXPERT, GPU, NODE, ZONE
from gem_jax.parallel.rules import DATA_PARALLEL_RULES, HSDP_RULES, Fp8Gather, ShardingRules, fp8_gather, logical_to_spec, plan_sharding

GOLDEN = Path(__file__).parent / "golden" / "gem_sharded_params.json"
SIZES = {ZONE: 2, NODE: 2, EXPERT: 2, GPU: 4}
LARGE_BYTES = 1 << 20  # a replicated parameter above 1 MiB is a mistake


def test_logical_to_spec_takes_divisible_prefixes_and_uses_each_axis_once():
    rules = HSDP_RULES
    assert logical_to_spec(("embed", "mlp"), rules, (64, 128), SIZES) == P((NODE, EXPERT, GPU), None)
    # 12 is not a multiple of 16: the longest dividing prefix (node, expert) = 4; gpu goes to the next dim.
    assert logical_to_spec(("embed", "mlp"), rules, (12, 128), SIZES) == P((NODE, EXPERT), GPU)
    assert logical_to_spec(("expert", "embed", "mlp"), rules, (4, 64, 32), SIZES) == P(EXPERT, (NODE, GPU), None)
    assert logical_to_spec(("norm",), rules, (64,), SIZES) == P(None)
    assert logical_to_spec(("embed",), rules, (3,), SIZES) == P(None)
    assert logical_to_spec(("embed", "mlp"), rules, (64, 128), {ZONE: 1, NODE: 1, EXPERT: 1, GPU: 1}) == P(None, None)


def test_padded_rows_and_placement_fallbacks():
    assert [padded_table_rows(n) for n in (1, 3, 11, 1024, 1025, 9743)] == [1, 4, 16, 1024, 2048, 10240]
    gen2 = place_table("t", 11, 16, TableSharding(Generation.GROUP), SIZES)
    assert gen2.row_axes == (NODE, EXPERT, GPU) and gen2.sync_axes == (ZONE,) and gen2.rows_per_shard == 1
    assert place_table("t", 20, 32, TableSharding(Generation.GLOBAL), SIZES).generation is Generation.GLOBAL
    assert place_table("t", 11, 16, TableSharding(Generation.GLOBAL), SIZES).generation is Generation.REPLICATED
    small = place_table("t", 3, 4, TableSharding(Generation.GROUP), SIZES)
    assert small.generation is Generation.REPLICATED and small.row_axes == ()  # 4 rows do not divide over 16 owners
    one = place_table("t", 100, 128, TableSharding(Generation.GLOBAL), {ZONE: 1, NODE: 1, EXPERT: 1, GPU: 1})
    assert one.generation is Generation.REPLICATED


@pytest.fixture(scope="module")
def gem_sharded(repo_root):
    config = load_config(repo_root / "configs" / "gem_sharded.py")
    spec = synthetic_spec(config.data.synthetic, config.data.max_seq_len, config.data.num_time_buckets)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GEMModel(spec, config.model, rngs=nnx.Rngs(0)))
    return config, model


def test_golden_parameter_shardings_of_the_default_sharded_config(gem_sharded):
    config, model = gem_sharded
    plan = plan_sharding(model, config.topology.axis_sizes, config.rules)
    rows = plan.table_rows(nnx.to_pure_dict(nnx.split(model)[1]))
    got = {
        "config": "configs/gem_sharded.py",
        "mesh": config.topology.axis_sizes,
        "tables": {k: p.generation.name for k, p in sorted(plan.tables.items())},
        "params": rows,
    }
    if os.environ.get("GEM_UPDATE_GOLDEN"):
        header = {k: v for k, v in got.items() if k != "params"}
        lines = ",\n".join("  " + json.dumps(r) for r in rows)
        GOLDEN.write_text(json.dumps(header, indent=1)[:-2] + ',\n "params": [\n' + lines + "\n ]\n}\n")
    assert got == json.loads(GOLDEN.read_text())


def test_no_large_parameter_is_replicated_and_hsdp_shards_inside_a_zone(gem_sharded):
    config, model = gem_sharded
    plan = plan_sharding(model, config.topology.axis_sizes, config.rules)
    rows = plan.table_rows(nnx.to_pure_dict(nnx.split(model)[1]))
    replicated = [r["path"] for r in rows if r["bytes"] >= LARGE_BYTES and r["bytes_per_device"] == r["bytes"]]
    assert replicated == []
    for r in rows:
        axes = [a for e in r["spec"] if e for a in ([e] if isinstance(e, str) else e)]
        assert ZONE not in axes or r["path"].endswith("embedding"), r  # dense weights replicate across zones (HSDP)
    experts = [r for r in rows if "mlp_expert" in r["path"]]
    assert experts and all(r["spec"][0] == EXPERT for r in experts)
    item = next(r for r in rows if r["path"] == "embed/item/embedding")
    assert item["spec"][0] == [NODE, EXPERT, GPU] and plan.tables["embed/item"].generation is Generation.NODE_SPLIT


def test_data_parallel_rules_replicate_dense_and_shard_tables_globally(gem_sharded):
    config, model = gem_sharded
    plan = plan_sharding(model, config.topology.axis_sizes, DATA_PARALLEL_RULES)
    rows = {r["path"]: r for r in plan.table_rows(nnx.to_pure_dict(nnx.split(model)[1]))}
    assert rows["embed/item/embedding"]["spec"][0] == [ZONE, NODE, EXPERT, GPU]
    assert all(e is None for e in rows["cross_tower/dhen/0/mix/kernel"]["spec"])
    custom = ShardingRules(default_table=TableSharding(Generation.REPLICATED))
    assert plan_sharding(model, config.topology.axis_sizes, custom).tables["embed/item"].row_axes == ()


def test_fp8_kernels_are_gathered_in_8_bits_over_the_outer_axes_whose_chunks_hold_whole_blocks():
    group = P((NODE, EXPERT, GPU), None)
    assert fp8_gather(group, (1024, 256), 32, SIZES) == Fp8Gather(0, (NODE, EXPERT, GPU))  # 64 rows per GPU
    assert fp8_gather(group, (256, 768), 32, SIZES) == Fp8Gather(0, (NODE, EXPERT))  # 16 per GPU: gpu in bf16 first
    assert fp8_gather(group, (256, 768), 128, SIZES) == Fp8Gather(0, (NODE,))
    assert fp8_gather(P(None, (NODE, EXPERT, GPU)), (96, 1024), 32, SIZES) == Fp8Gather(1, (NODE, EXPERT, GPU))
    assert fp8_gather(P((NODE, EXPERT), GPU), (128, 128), 32, SIZES) == Fp8Gather(0, (NODE, EXPERT))  # a tie: the first dimension
    assert fp8_gather(P((NODE,), (EXPERT, GPU)), (64, 256), 32, SIZES) == Fp8Gather(1, (EXPERT, GPU))  # the dimension over more devices
    assert fp8_gather(group, (48, 64), 32, SIZES) is None  # no chunk holds whole blocks
    assert fp8_gather(P(None, None), (1024, 1024), 32, SIZES) is None


def test_the_fp8_model_plans_every_sharded_fp8_kernel(gem_sharded):
    import dataclasses

    config, plain = gem_sharded
    spec = synthetic_spec(config.data.synthetic, config.data.max_seq_len, config.data.num_time_buckets)
    fp8 = dataclasses.replace(config.model, fp8=True)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GEMModel(spec, fp8, rngs=nnx.Rngs(0)))
    plan = plan_sharding(model, config.topology.axis_sizes, config.rules)
    assert plan.fp8["sequence_tower/blocks/0/qkv"] == Fp8Gather(0, (NODE, EXPERT))  # d = 256 over 16 GPUs: 16 rows
    assert plan.fp8["sequence_tower/blocks/0/mlp/down"] == Fp8Gather(0, (NODE, EXPERT, GPU))  # 1024 over 16: 64 rows
    assert len(plan.fp8) == sum(1 for _, m in nnx.iter_modules(model) if type(m).__name__ == "Fp8Linear")
    assert plan_sharding(plain, config.topology.axis_sizes, config.rules).fp8 == {}  # no FP8 layers


def test_rules_naming_a_table_the_model_lacks_are_refused(gem_sharded):
    _, model = gem_sharded
    rules = ShardingRules(tables=(("embed/user/0", TableSharding(Generation.REPLICATED)),))
    with pytest.raises(ValueError, match=r"ShardingRules.tables names \['embed/user/0'\], not embedding tables of this model; its tables are \[.*'embed/user/user'"):
        plan_sharding(model, SIZES, rules)
