"""Every fenced code block of README.md runs, so that no example in it goes stale.

`python` blocks are executed as they stand, in a temporary folder where `configs/` is the
repository's, so relative paths resolve and outputs (`runs/...`) land in the temporary folder;
`runs/demo`, the Quick start's run, is made first by a one-step tiny run.

`bash` blocks are split into commands (one a line, `&&` between them), each checked by the rule
of its program, cheaply and without leaving the test:

- `python3.X -m venv`: X is the version of `.python-version`;
- `.venv/bin/pip install -e '.[extras]'`: the repository is installed and its extras exist in
  pyproject.toml;
- `.venv/bin/gem-train`: `--help` runs; otherwise gem-train runs with the block's arguments up to
  the point where it would train (arguments parsed, config file loaded, overrides applied,
  attention paths chosen) and must then train the README's config in the README's workdir; the
  data set of an own event log (`Source.EVENTS`, converted by the block's `gem-data` commands) loads;
- `.venv/bin/pytest`: pytest accepts the arguments (collecting one small file, not the suite).

A program without a rule, or a block in another language (`text` is for what is not code),
fails the test: add a rule for it here.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import gem_jax.train.loop
from gem_jax import data_cli
from gem_jax.cli import train_main
from gem_jax.data.pipeline import Source, load_dataset
from gem_jax.train import config_tree
from gem_jax.train.config import load_config

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
VENV_BIN = ".venv/bin/"


def readme_blocks() -> list[tuple[str, str, int]]:
    """(language, code, line of the opening fence) of every fenced block of the README."""
    text = README.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def block_id(block) -> str:
    language, code, line = block
    return f"{language}:line{line}:{code.splitlines()[0][:40]}"


BLOCKS = readme_blocks()
PYTHON = [b for b in BLOCKS if b[0] == "python"]
BASH = [b for b in BLOCKS if b[0] == "bash"]


def test_every_block_has_a_language_this_test_knows():
    assert PYTHON and BASH
    unknown = [(language or "(none)", line) for language, _, line in BLOCKS if language not in ("python", "bash", "text")]
    assert not unknown, f"README blocks of a language tests/test_readme.py does not run: {unknown}"


@pytest.fixture(scope="module")
def readme_cwd(tmp_path_factory) -> Path:
    """A folder standing in for a fresh clone's root: `configs/` is the repository's."""
    root = tmp_path_factory.mktemp("readme")
    (root / "configs").symlink_to(REPO / "configs")
    return root


@pytest.fixture(scope="module")
def demo_run(readme_cwd) -> Path:
    """`runs/demo` of the Quick start, from a one-step tiny run in `readme_cwd`.

    It trains the research snippet's model (`configs/movielens_tiny.py` at `model.embed_dim=16`),
    so that the snippet finds its train and eval steps in the suite's compilation cache.
    """
    workdir = readme_cwd / "runs" / "demo"
    overrides = ["loop.num_steps=1", "model.embed_dim=16"]
    train_main(["--config", "configs/movielens_tiny.py", "--workdir", str(workdir), "--no-progress", "--set", *overrides])
    return workdir


@pytest.mark.parametrize("block", PYTHON, ids=block_id)
def test_python_block_runs(block, readme_cwd, request, monkeypatch):
    _, code, line = block
    if '"runs/demo"' in code:
        request.getfixturevalue("demo_run")
    monkeypatch.chdir(readme_cwd)
    exec(compile(code, f"{README}:{line}", "exec"), {"__name__": "__readme__"})  # noqa: S102 - the README's own code


def commands(code: str) -> list[list[str]]:
    """The block's commands, each as its words: one a line (`\\` continues one), `&&` between them."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        command = []
        for word in shlex.split(line, comments=True) + ["&&"]:
            if word != "&&":
                command.append(word)
            elif command:
                out.append(command)
                command = []
    return out


def check_venv(args, monkeypatch):
    version = (REPO / ".python-version").read_text().strip()
    assert args[0] == f"python{version}" and args[1:3] == ["-m", "venv"], f"expected python{version} -m venv, got {args}"


def check_pip(args, monkeypatch):
    assert args[1:3] == ["install", "-e"], f"expected pip install -e, got {args}"
    match = re.fullmatch(r"\.(?:\[([\w,]+)\])?", args[3])
    assert match, f"expected the repository ('.' or '.[extras]'), got {args[3]!r}"
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    missing = set((match.group(1) or "").split(",")) - extras - {""}
    assert not missing, f"pyproject.toml has no extra {sorted(missing)}"


def check_gem_train(args, monkeypatch):
    if "--help" in args:
        with pytest.raises(SystemExit) as done:
            train_main(args[1:])
        assert done.value.code == 0
        return
    trained = []
    monkeypatch.setattr(gem_jax.train.loop, "train_and_evaluate", lambda config, workdir, **_: trained.append((config, workdir)) or {"finished": True})
    train_main(args[1:])
    (config, workdir), = trained
    assert workdir == args[args.index("--workdir") + 1]
    after_set = args[args.index("--set") + 1 :] if "--set" in args else []
    overrides = list(itertools.takewhile(lambda word: not word.startswith("--"), after_set))
    assert config == config_tree.apply_overrides(load_config(args[args.index("--config") + 1]), overrides)
    if config.data.source is Source.EVENTS:
        load_dataset(config.data)


def check_gem_data(args, monkeypatch):
    """gem-data runs for real; `events/` (when a command reads it and it is absent) is a small
    log with the columns the README's commands name."""
    if "events/" in args and not Path("events").exists():
        Path("events").mkdir()
        rows = [f"u{k % 7},i{k % 5},{1700000000 + k},{k % 2},{k % 3 == 0},c{k % 4},{['fr', 'de'][k % 7 % 2]}" for k in range(120)]
        Path("events/log.csv").write_text("user_id,item_id,ts,click,purchase,category,country\n" + "\n".join(rows) + "\n")
    data_cli.main(args[1:])


def check_pytest(args, monkeypatch):
    command = [sys.executable, "-m", "pytest", *args[1:], "--collect-only", "-p", "no:cacheprovider", "tests/test_scripts.py"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"pytest refuses {args[1:]}: {done.stdout[-2000:]}{done.stderr[-2000:]}"


RULES = {
    "python": check_venv,
    VENV_BIN + "pip": check_pip,
    VENV_BIN + "gem-train": check_gem_train,
    VENV_BIN + "pytest": check_pytest,
    VENV_BIN + "gem-data": check_gem_data,
}


def rule(program: str):
    key = "python" if re.fullmatch(r"python3(\.\d+)?", program) else program
    assert key in RULES, f"no rule in tests/test_readme.py for README commands of {program!r}"
    return RULES[key]


@pytest.mark.parametrize("block", BASH, ids=block_id)
def test_bash_block_is_valid(block, readme_cwd, monkeypatch):
    _, code, _ = block
    monkeypatch.chdir(readme_cwd)
    for args in commands(code):
        rule(args[0])(args, monkeypatch)

