"""benchmarks/_hlo_sources.py names the source lines each fusion kernel of a compiled program runs."""

import inspect
import os

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def hlo_sources(load_benchmark):
    return load_benchmark("_hlo_sources")


def _rms_gelu(x, w, g):
    h = x @ w
    normed = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g  # line NORM
    return jnp.sum(jax.nn.gelu(normed) + x)  # line GELU


def _line(marker: str) -> int:
    source, first = inspect.getsourcelines(_rms_gelu)
    return first + next(i for i, line in enumerate(source) if line.rstrip().endswith(marker))


@pytest.fixture(scope="module")
def compiled_text():
    x, w, g = jnp.ones((64, 128)), jnp.ones((128, 128)), jnp.ones((128,))
    return jax.jit(jax.grad(_rms_gelu, argnums=1)).lower(x, w, g).compile().as_text()


def test_kernel_names_follow_xla(hlo_sources):
    assert hlo_sources.kernel_name("loop_add_fusion.1") == "loop_add_fusion_1"
    assert hlo_sources.kernel_name("input_reduce_fusion.98") == "input_reduce_fusion_98"


def test_every_fusion_names_the_lines_it_runs(hlo_sources, compiled_text):
    here = os.path.dirname(os.path.abspath(__file__))
    sources = hlo_sources.kernel_sources(compiled_text, root=here)
    fusions = [line.split(" = ")[0].split()[-1].lstrip("%") for line in compiled_text.splitlines() if " fusion(" in line]
    assert fusions and set(sources) == {hlo_sources.kernel_name(f) for f in fusions}
    norm, gelu = (f"test_hlo_sources.py:{_line(m)} (_rms_gelu)" for m in ("# line NORM", "# line GELU"))
    named = {entry.rsplit(" x", 1)[0] for entries in sources.values() for entry in entries}
    assert norm in named and gelu in named
    # counts are instructions per line, most first
    for entries in sources.values():
        counts = [int(entry.rsplit(" x", 1)[1]) for entry in entries]
        assert counts == sorted(counts, reverse=True) and all(c > 0 for c in counts)


def test_attribute_adds_sources_to_known_fusions_only(hlo_sources, compiled_text):
    sources = hlo_sources.kernel_sources(compiled_text)
    fusion = next(name for name, entries in sources.items() if entries)
    top = [{"name": fusion, "ms": 1.0}, {"name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "ms": 2.0}]
    attributed = hlo_sources.attribute(top, compiled_text)
    assert attributed[0]["sources"] == sources[fusion] and "sources" not in attributed[1]
    assert "sources" not in top[0]  # the input is left as it was


def test_installed_packages_inside_the_root_are_not_the_project(hlo_sources):
    """A frame in a virtual environment under the root (optax's, say) gives way to the project frame that called it."""
    tables = {
        "FileNames": {1: '"/repo/.venv/lib/python3.12/site-packages/optax/clip.py"', 2: '"/repo/gem_jax/train/step.py"'},
        "FunctionNames": {1: '"clip_fn"', 2: '"train_step"'},
        "FileLocations": {1: "{file_name_id=1 function_name_id=1 line=105}", 2: "{file_name_id=2 function_name_id=2 line=60}"},
        "StackFrames": {1: "{file_location_id=2 parent_frame_id=0}", 2: "{file_location_id=1 parent_frame_id=1}"},
    }
    sources = hlo_sources._frame_sources(tables, "/repo")
    assert sources == {1: "gem_jax/train/step.py:60 (train_step)", 2: "gem_jax/train/step.py:60 (train_step)"}
    del tables["StackFrames"][1]  # no project frame on the stack: the package's own line, named from the package
    assert hlo_sources._frame_sources(tables, "/repo")[2] == "optax/clip.py:105 (clip_fn)"
