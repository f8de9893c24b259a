"""The one configuration schema of a training job.

Config files in `configs/` are Python modules with `get_config() -> TrainConfig`. Only the
training entry point sees a whole `TrainConfig`; every module takes its own part.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import traceback
from pathlib import Path

from gem_jax.checks import check_int
from gem_jax.data.config import DataConfig
from gem_jax.model.config import ModelConfig
from gem_jax.mesh import Topology
from gem_jax.parallel.rules import DATA_PARALLEL_RULES, Rules
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.optimizer import OptimConfig, check_weights_dtype


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How long a run trains, how often it logs and evaluates, and its parameter-init seed.

    Attributes:
      num_steps: optimizer steps of the whole run.
      log_every: steps between train-metric records (stdout, JSONL, TensorBoard).
      eval_every: steps between evaluations (0: none before the end); a run that reaches
        `num_steps` always ends with one.
      seed: parameter-init seed (the data order has its own seed in `DataConfig`).
      compile_in_background: start training once the largest token capacity's train step is
        compiled and build the other programs while it trains (`gem_jax.train.programs`):
        start-up falls to one program's compile, but steps whose own capacity is still
        building run at a larger one (more device time, losses not bit-identical to a run
        with it off). Ignored in a multi-process run. False: every program before step 1.
    """

    num_steps: int = 1000
    log_every: int = 25
    eval_every: int = 0
    seed: int = 0
    compile_in_background: bool = False

    def __post_init__(self):
        check_int(self, "num_steps", minimum=1)
        check_int(self, "log_every", minimum=1)
        check_int(self, "eval_every", minimum=0)
        check_int(self, "seed", minimum=0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole training job; `load_config` reads one from a config file.

    Attributes:
      data: the data set and how it is split and batched (`DataConfig`).
      model: the model's dimensions, kernels and precision (`ModelConfig`).
      optim: learning rates, their schedule and the optimizer state (`OptimConfig`).
      checkpoint: when the train state is saved and how it is written and read (`CheckpointConfig`).
      loop: the run's length, its logging and evaluation intervals and init seed (`LoopConfig`).
      topology: the zones, nodes per zone and GPUs per node the job spans (`Topology`).
      rules: how parameters and embedding tables are sharded over the mesh
        (`gem_jax.parallel.rules`; default: dense weights replicated, tables row-sharded
        over every device).
    """

    data: DataConfig
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    loop: LoopConfig = LoopConfig()
    topology: Topology = Topology()
    rules: Rules = DATA_PARALLEL_RULES

    def __post_init__(self):
        # Across two parts, so checked here, when the config is built (`gem-train` refuses it with exit 2).
        check_weights_dtype(self.optim.weights_dtype, self.model.compute_dtype)


class ConfigFileError(ValueError):
    """A config file that does not run: a syntax error, or an exception while executing it."""


def load_config(path: str | Path) -> TrainConfig:
    """Imports a config file and returns its `get_config()`.

    Raises:
      FileNotFoundError: no such file.
      ConfigFileError: the file does not parse, or running it (its module body or
        `get_config()`, including the config classes' field checks) raised; the message names
        the file, the line in it and the error (the original error is the `__cause__`).
      ConfigFileError: also a file that is not a `.py` file.
      TypeError: the file has no `get_config`, or it does not return a `TrainConfig`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    if path.suffix != ".py":
        raise ConfigFileError(f"{path}: a config is a Python file (.py) defining get_config(), e.g. configs/movielens.py")
    spec = importlib.util.spec_from_file_location(f"gem_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        get_config = getattr(module, "get_config", None)
        config = get_config() if callable(get_config) else None
    except Exception as error:  # noqa: BLE001 - whatever the file raises is reported with its line
        raise ConfigFileError(_describe_failure(path, error)) from error
    if not callable(get_config):
        raise TypeError(f"{path}: defines no get_config() (a config file's get_config() returns a gem_jax.train.config.TrainConfig)")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"{path}: get_config() must return a gem_jax.train.config.TrainConfig, got {type(config).__name__}")
    return config


def _describe_failure(path: Path, error: Exception) -> str:
    """`FILE, line N: ErrorType: message`, at the innermost line of `path` the error passed through."""
    if isinstance(error, SyntaxError) and error.filename == str(path):
        text = f": {error.text.strip()}" if error.text and error.text.strip() else ""
        return f"{path}, line {error.lineno}: {type(error).__name__}: {error.msg}{text}"
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == str(path)]
    where = f", line {lines[-1]}" if lines else ""
    return f"{path}{where}: {type(error).__name__}: {error}"
