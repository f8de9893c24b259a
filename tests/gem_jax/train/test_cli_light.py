"""`gem-train --help` answers without importing jax or the train stack; running out of device memory is a message and exit status 5;
the device memory share gem-train takes, the peak it reports and the note on split free memory (gem_jax/device_memory.py)."""

import os
import subprocess
import sys

PROGRAM = """
import sys
from gem_jax.cli import train_main
try:
    train_main(["--help"])
except SystemExit:
    pass
print("HEAVY " + " ".join(sorted(m for m in ("jax", "flax", "orbax", "grain", "gem_jax.train") if m in sys.modules)))
"""


class FakeDevice:
    """A jax device as `gem_jax.device_memory` reads it: `memory_stats()` returns `stats` (None: the CPU's
    answer), or raises it when it is an exception."""

    def __init__(self, stats, local_hardware_id=0):
        self.stats, self.local_hardware_id = stats, local_hardware_id

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_help_imports_neither_jax_nor_the_train_stack(repo_root):
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True).stdout
    assert out.rsplit("HEAVY", 1)[1].split() == []


def test_running_out_of_device_memory_says_what_and_exits_5(repo_root, tmp_path, monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED from the run is a message naming the allocation, the process's share of the
    device and what to change, with exit status 5, not a traceback; other runtime errors pass through."""
    import jax
    import pytest

    from gem_jax import cli
    from gem_jax.train import loop

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 27.81GiB with allocator GPU_0_bfc on device 0.\nmore"
        )

    monkeypatch.setattr(loop, "train_and_evaluate", out_of_memory)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    argv = ["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path), "--no-progress"]
    with pytest.raises(SystemExit) as exited:
        cli.train_main(argv)
    assert exited.value.code == cli.OUT_OF_MEMORY_EXIT_CODE == 5
    err = capsys.readouterr().err
    assert "gem-train: the device ran out of memory (Out of memory while trying to allocate 27.81GiB" in err
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.3" in err and "model.remat.budget_gb" in err and "more" not in err.split("GPU_0_bfc")[1][:40]
    assert "(optim.moments_dtype=bfloat16, optim.weights_dtype=bfloat16; with a remat budget, lower it by what they save" in " ".join(err.split())

    def other_error(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(loop, "train_and_evaluate", other_error)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        cli.train_main(argv)


def test_gem_train_takes_90_percent_of_the_gpu_unless_told_otherwise(repo_root, tmp_path, monkeypatch, capsys):
    """Unset under both names, XLA_CLIENT_MEM_FRACTION becomes 0.9 before jax's client starts (jax's own 75% left
    the GEM-width planted run out of memory); a value set under either name is kept, and the other name stays
    unset (jaxlib refuses the two together); the out-of-memory message names the share in force."""
    import jax
    import pytest

    from gem_jax import cli, device_memory
    from gem_jax.train import loop

    new, deprecated = device_memory.MEMORY_FRACTION_VARIABLES
    assert (new, deprecated) == ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    for name, other in ((new, deprecated), (deprecated, new)):
        monkeypatch.setenv(name, "0.25")
        monkeypatch.delenv(other, raising=False)
        device_memory.claim_device_memory()
        assert os.environ[name] == "0.25" and other not in os.environ
        assert device_memory.device_memory_share() == f"{name}=0.25"

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")

    monkeypatch.setattr(loop, "train_and_evaluate", out_of_memory)
    monkeypatch.delenv(new, raising=False)
    monkeypatch.delenv(deprecated, raising=False)
    assert device_memory.device_memory_share() == "jax's default share, 75%,"
    with pytest.raises(SystemExit):
        cli.train_main(["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path), "--no-progress"])
    assert os.environ[new] == "0.9" and deprecated not in os.environ
    assert "This process's allocator may take XLA_CLIENT_MEM_FRACTION=0.9 of the device's memory" in capsys.readouterr().err


def test_an_events_config_without_a_path_is_refused_before_anything_is_written(repo_root, tmp_path, capsys):
    import pytest

    from gem_jax import cli

    with pytest.raises(SystemExit) as exited:
        cli.train_main(["--config", str(repo_root / "configs" / "events_tiny.py"), "--workdir", str(tmp_path / "run"), "--no-progress"])
    assert exited.value.code == 2
    assert "set DataConfig.path to that directory (e.g. --set data.path=data/mylog)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_peak_of_device_memory_is_the_largest_devices_with_its_limit():
    """`peak_memory_gb` reads each device's memory statistics (GB of 1e9 bytes); a device without them (the CPU)
    gives nothing to report rather than a made-up zero."""
    from gem_jax.device_memory import peak_memory_gb

    gpus = [FakeDevice({"peak_bytes_in_use": 12_500_000_000, "bytes_limit": 21_000_000_000}),
            FakeDevice({"peak_bytes_in_use": 30_000_000_000, "bytes_limit": 127_000_000_000})]
    assert peak_memory_gb(gpus) == {"device_peak_gb": 30.0, "device_limit_gb": 127.0}
    assert peak_memory_gb([*gpus, FakeDevice(None)]) == {} and peak_memory_gb([FakeDevice({"bytes_in_use": 1})]) == {}
    assert peak_memory_gb([]) == {}


def test_a_multi_process_run_reports_the_busiest_device_of_any_process(monkeypatch):
    """Every process gathers the others' peaks (one all-gather) and reports the largest with its device's limit."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from gem_jax.train import loop

    monkeypatch.setattr(loop, "peak_memory_gb", lambda devices: {"device_peak_gb": 30.0, "device_limit_gb": 127.0})
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    others = np.array([[30.0, 127.0], [41.5, 127.0]])  # this process's row, then the other's
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: others)
    assert loop.peak_device_memory() == {"device_peak_gb": 41.5, "device_limit_gb": 127.0}
    monkeypatch.setattr(loop, "peak_memory_gb", lambda devices: {})  # the CPU: nothing to gather
    assert loop.peak_device_memory() == {}



def test_a_workdir_that_is_a_file_is_refused_naming_workdir(repo_root, tmp_path, capsys):
    """Checked before --compile-cache, whose default lies under the workdir: the message names --workdir, exit 2."""
    import pytest

    from gem_jax import cli

    (tmp_path / "afile").write_text("")
    (tmp_path / "broken").symlink_to(tmp_path / "gone")
    config = str(repo_root / "configs" / "movielens_tiny.py")
    for workdir, what in (
        (tmp_path / "afile", f"--workdir {tmp_path / 'afile'}: a file of that name exists; it must be a directory (or not exist yet)"),
        (tmp_path / "afile" / "run", f"--workdir {tmp_path / 'afile' / 'run'}: {tmp_path / 'afile'} is a file, so no directory can be made under it"),
        (tmp_path / "broken", f"--workdir {tmp_path / 'broken'}: a symbolic link to a missing target ({tmp_path / 'gone'})"),
        ("", "--workdir is empty: name a directory"),  # an unset shell variable: not the current directory
    ):
        with pytest.raises(SystemExit) as exited:
            cli.train_main(["--config", config, "--workdir", str(workdir), "--dry-run"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == f"gem-train: error: {what}"
        assert "--compile-cache" not in err.splitlines()[-1] and "Traceback" not in err


def test_gem_data_out_under_a_file_is_refused_naming_out(tmp_path, capsys):
    import pytest

    from gem_jax import data_cli

    (tmp_path / "afile").write_text("")
    for argv, what in (
        (["plant", "--out", str(tmp_path / "afile" / "log"), "--small"], f"{tmp_path / 'afile'} is a file, so no directory can be made under it"),
        (["plant", "--out", str(tmp_path / "afile"), "--small"], "a file of that name exists; it must be a directory (or not exist yet)"),
        (["convert", "x.csv", "--user", "u", "--item", "i", "--time", "t", "--label", "c", "--out", str(tmp_path / "afile")], "a file of that name exists"),
        (["plant", "--out", "/proc/gem-log", "--small"], "nothing can be created in /proc ("),  # a pseudo filesystem: found before the work
    ):
        with pytest.raises(SystemExit) as exited:
            data_cli.main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith(f"gem-data: error: --out {argv[argv.index('--out') + 1]}: {what}"), err
    assert (tmp_path / "afile").read_text() == ""


def test_stop_after_steps_below_one_is_refused_at_parsing(repo_root, tmp_path, capsys):
    import pytest

    from gem_jax import cli

    for value, what in (("0", "must be >= 1, got 0"), ("-3", "must be >= 1, got -3"), ("two", "expected an int, got 'two'")):
        with pytest.raises(SystemExit) as exited:
            cli.train_main(["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path / "run"), "--stop-after-steps", value])
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"gem-train: error: argument --stop-after-steps: {what}"
    assert not (tmp_path / "run").exists()


def test_a_stop_under_force_new_says_to_resume_without_it(repo_root, tmp_path, monkeypatch, capsys):
    """Run again with --force-new, a stopped run would be moved aside and start over: the stop message (by
    --stop-after-steps or by a signal) says to drop the flag; without the flag it says to run the same command."""
    import pytest

    from gem_jax import cli
    from gem_jax.train import loop
    from gem_jax.train.preemption import PREEMPTED_EXIT_CODE, Preempted

    argv = ["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path), "--no-progress", "--stop-after-steps", "2"]
    monkeypatch.setattr(loop, "train_and_evaluate", lambda *args, **kwargs: {"finished": False, "step": 2})
    for flags, resume in (([], "run the same command again to resume"), (["--force-new"], cli.RESUME_WITHOUT_FORCE_NEW)):
        with pytest.raises(SystemExit) as exited:
            cli.train_main(argv + flags)
        assert exited.value.code == PREEMPTED_EXIT_CODE == 75
        assert capsys.readouterr().err.splitlines()[-1] == f"gem-train: stopped after step 2 of 6 (--stop-after-steps); {resume}"
    assert cli.RESUME_WITHOUT_FORCE_NEW == "run the same command without --force-new to resume (with it, the run would start over)"

    def preempted(*args, **kwargs):
        raise Preempted(3, "SIGTERM", "step 3 (x/checkpoints/3)")

    monkeypatch.setattr(loop, "train_and_evaluate", preempted)
    for flags, resume in (([], "run the same command again to resume"), (["--force-new"], cli.RESUME_WITHOUT_FORCE_NEW)):
        with pytest.raises(SystemExit) as exited:
            cli.train_main(argv + flags)
        assert exited.value.code == 75
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"gem-train: stopped on SIGTERM after step 3; newest checkpoint: step 3 (x/checkpoints/3); {resume}"
        )


def test_out_of_memory_in_split_free_memory_says_so_and_by_how_much_to_lower_the_budget(repo_root, tmp_path, monkeypatch, capsys):
    """When the free memory would hold the request but its largest piece would not (the GEM-width planted job with
    bfloat16 weights: 31.32 GiB asked, about 55 GiB free in two pieces), the message says so with the sizes and how
    much lower a remat budget must be, from the statistics of the device the message names; with one piece large
    enough, too little free, no statistics (the CPU) or statistics that cannot be read, it does not."""
    import jax
    import pytest

    from gem_jax import cli, device_memory
    from gem_jax.train import loop

    gib = 2**30
    assert device_memory.requested_bytes("Out of memory while trying to allocate 31.32GiB with allocator") == int(31.32 * gib)
    assert device_memory.requested_bytes("trying to allocate 33634789376 bytes.") == 33634789376
    assert device_memory.requested_bytes("trying to allocate 512.0MiB") == 512 * 2**20
    assert device_memory.requested_bytes("RESOURCE_EXHAUSTED: something else") is None
    assert device_memory.requested_bytes("trying to allocate 123B with") == 123
    assert device_memory.requested_bytes("trying to allocate 1.5.3GiB") is None  # not a number: no note, not an error

    limit = int(71.3 * gib)
    split = {"bytes_limit": limit, "bytes_in_use": int(16 * gib), "largest_free_block_bytes": int(30.6 * gib)}
    devices = [FakeDevice(split)]
    monkeypatch.setattr(jax, "local_devices", lambda: devices)

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 31.32GiB with allocator GPU_0_bfc on device 0.")

    monkeypatch.setattr(loop, "train_and_evaluate", out_of_memory)
    argv = ["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path), "--no-progress"]
    with pytest.raises(SystemExit) as exited:
        cli.train_main(argv)
    assert exited.value.code == cli.OUT_OF_MEMORY_EXIT_CODE
    err = " ".join(capsys.readouterr().err.split())
    free, largest, request = (limit - 16 * gib) / 1e9, 30.6 * gib / 1e9, 31.32 * gib / 1e9
    assert (f"The memory was there but not in one piece: {free:.1f} GB of the {limit / 1e9:.1f} GB the allocator may take are free, "
            f"the largest free piece {largest:.1f} GB, under the {request:.1f} GB (31.32 GiB) asked for") in err
    assert "Where model.remat.budget_gb binds, a budget at least 0.8 GB lower shrinks the step's temporaries" in err

    # one piece holds it; too little free in all; no statistics; the named device without them; statistics that fail;
    # the message names device 0 and device 1 is the split one
    whole = {**split, "largest_free_block_bytes": int(40 * gib)}
    for others in ([whole], [{**split, "bytes_in_use": int(50 * gib)}], [None], [{}, split], [RuntimeError("gone")], [whole, split]):
        devices[:] = [FakeDevice(stats, local_hardware_id=i) for i, stats in enumerate(others)]
        with pytest.raises(SystemExit) as exited:
            cli.train_main(argv)
        assert exited.value.code == cli.OUT_OF_MEMORY_EXIT_CODE
        assert "not in one piece" not in capsys.readouterr().err
    note = device_memory.fragmentation_note
    assert note("trying to allocate 31.32GiB on device 1", devices) and not note("trying to allocate 31.32GiB on device 0", devices)
    assert not note("trying to allocate 31.32GiB on device 7", devices)  # not this process's: no other device's numbers
    with pytest.raises(RuntimeError, match="gone"):  # the message's caller gives no note then (the exit above)
        note("trying to allocate 31.32GiB", [FakeDevice(RuntimeError("gone"))])
    # a request a few MB over the largest piece (its size rounded in the message) still asks for at least 0.1 GB less
    tight = [FakeDevice({**split, "largest_free_block_bytes": int(31.31 * gib)})]
    assert "a budget at least 0.1 GB lower" in note("trying to allocate 31.32GiB", tight)
    assert device_memory.requested_bytes("trying to allocate " + "9" * 400 + " bytes") == int("9" * 400)

    # an error inside the note leaves the clean exit and its message
    monkeypatch.setattr(jax, "local_devices", lambda: 1 / 0)
    with pytest.raises(SystemExit) as exited:
        cli.train_main(argv)
    assert exited.value.code == cli.OUT_OF_MEMORY_EXIT_CODE and "the device ran out of memory" in capsys.readouterr().err
