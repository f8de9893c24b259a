"""`EventWriter`'s files read back by TensorBoard's own reader, and the purge step of a resumed run."""

import os
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gem_jax.train.tensorboard_events import EventWriter


def _scalars(logdir, tag):
    events = EventAccumulator(str(logdir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_scalars_read_back_and_a_purge_step_replaces_the_later_steps(tmp_path):
    first = EventWriter(tmp_path)
    for step in range(1, 7):
        first.add_scalar("train/loss", 10.0 + step, step)
    first.add_scalar("eval/auc", 0.75, 6)
    first.close()
    assert _scalars(tmp_path, "train/loss") == [(s, 10.0 + s) for s in range(1, 7)]
    resumed = EventWriter(tmp_path, purge_step=5)  # a start resumed from its step-4 checkpoint
    for step in (5, 6):
        resumed.add_scalar("train/loss", 20.0 + step, step)
    resumed.close()
    assert resumed.path != first.path
    assert _scalars(tmp_path, "train/loss") == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0)]
    assert _scalars(tmp_path, "eval/auc") == []  # step 6's eval was purged with the rest


def test_flushed_scalars_survive_a_killed_process(tmp_path):
    code = (
        "import os; from gem_jax.train.tensorboard_events import EventWriter\n"
        f"w = EventWriter({str(tmp_path)!r}); w.add_scalar('train/loss', 0.5, 3); w.flush(); os._exit(9)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 9
    assert _scalars(tmp_path, "train/loss") == [(3, 0.5)]


def test_the_trainer_imports_neither_torch_nor_tensorflow(tmp_path):
    # tensorboardX imports torch whenever it is installed: ~6 s of start-up on the GPU host. Empty
    # stand-ins make both importable here, so any import of them shows in sys.modules.
    for name in ("torch", "tensorflow"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    code = (
        "import sys, gem_jax.train.loop, gem_jax.train.metric_log\n"
        "print(sorted(m for m in ('torch', 'tensorflow', 'tensorboardX') if m in sys.modules))"
    )
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path})
    assert out.stdout.strip() == "[]"
