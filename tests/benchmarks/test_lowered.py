"""benchmarks/_lowered.collectives counts a collective once per run of the computation that holds it."""

import pytest


@pytest.fixture(scope="module")
def collectives(load_benchmark):
    return load_benchmark("_lowered").collectives


# A kernel call lowered once (shared_lowering) and called from two sites, once nested, and from a loop body.
HLO = """HloModule jit_step, entry_computation_layout={(bf16[4,8]{1,0})->bf16[16,8]{1,0}}

gather_kernel.1 {
  Arg_0.1 = bf16[4,8]{1,0} parameter(0)
  ROOT all-gather.1 = bf16[16,8]{1,0} all-gather(Arg_0.1), channel_id=1, replica_groups=mesh[x=4] {'x'}, dimensions={0}
}

layer.2 {
  Arg_0.2 = bf16[4,8]{1,0} parameter(0)
  ROOT jit_gather.1 = bf16[16,8]{1,0} call(Arg_0.2), to_apply=gather_kernel.1
}

loop_body.6 {
  Arg_0.6 = bf16[4,8]{1,0} parameter(0)
  jit_gather.3 = bf16[16,8]{1,0} call(Arg_0.6), to_apply=gather_kernel.1
  ROOT slice.1 = bf16[4,8]{1,0} slice(jit_gather.3), slice={[0:4], [0:8]}
}

ENTRY main.3 {
  x.1 = bf16[4,8]{1,0} parameter(0)
  jit_gather.2 = bf16[16,8]{1,0} call(x.1), to_apply=gather_kernel.1
  jit_layer.1 = bf16[16,8]{1,0} call(x.1), to_apply=layer.2
  while.1 = bf16[4,8]{1,0} while(x.1), condition=loop_cond.7, body=loop_body.6
  all-reduce.1 = bf16[16,8]{1,0} all-reduce(jit_layer.1), channel_id=2, replica_groups=mesh[x=4] {'x'}, to_apply=add.4
  ROOT add.5 = bf16[16,8]{1,0} add(jit_gather.2, all-reduce.1)
}
"""


def test_collectives_in_called_computations_count_per_call(collectives):
    found = collectives(HLO)
    gathers = [c for c in found if c["op"] == "all-gather"]
    assert len(gathers) == 3  # one per call site, the nested one included; the loop body's once
    assert all(c["axes"] == ["x"] and c["bytes"] == 16 * 8 * 2 for c in gathers)
    assert [c["op"] for c in found].count("all-reduce") == 1
