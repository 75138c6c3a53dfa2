"""What a plain `pip install rankwise` gives: the built wheel, in a bare venv holding only the
pinned torch and pytest (no numpy, no transformers), runs the README's library snippets and a
multi-rank collective. A dependency used but not declared fails here, not on a user's machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import SCRIPTS

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "ci" / "constraints.txt"
# Installing torch from this machine's disk and building the wheel take a minute or two; a
# safety net far above that, never the expected time.
INSTALL_BOUND_S = 1800
RUN_BOUND_S = 600
_NOT_SOURCE = (".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", "out")

MULTI_RANK_TEST = """
import pytest, torch
import rankwise as rw


@pytest.mark.ranks(2)
def test_collectives_in_the_installed_wheel(rank):
    assert rw.all_reduce("sum", lambda: rank + 1, sum) == 3
    assert rw.broadcast_from("cfg", lambda: {"lr": 0.1, "t": torch.ones(2)}, src=1)["lr"] == 0.1
    states = list(rw.gather_state_dicts({"w": torch.full((2,), float(rank))}, dst=0))
    if rank == 0:
        assert [s["w"].tolist() for s in states] == [[0.0, 0.0], [1.0, 1.0]]
"""


def _run(args: list[str], cwd: Path, bound: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=bound, check=False
    )
    assert result.returncode == 0, f"{args}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel built from this checkout, torch and pytest pinned, nothing else."""
    where = tmp_path_factory.mktemp("wheel")
    source = where / "source"  # a copy: building in the checkout would leave build/ there
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(where / "dist"), str(source)],
        where, INSTALL_BOUND_S,
    )  # fmt: skip
    (wheel,) = (where / "dist").glob("rankwise-*.whl")
    _run([sys.executable, "-m", "venv", str(where / "venv")], where, INSTALL_BOUND_S)
    python = where / "venv" / "bin" / "python"
    _run(
        [str(python), "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS), str(wheel),
         "pytest"],
        where, INSTALL_BOUND_S,
    )  # fmt: skip
    return python


def _library_scripts() -> list[str]:
    """The README's scripts that use the library and need nothing the wheel does not declare
    (the FSDP2 one builds a transformers model: transformers is the user's, not ours)."""
    return [s for s in SCRIPTS if "import rankwise" in s and "transformers" not in s]


@pytest.mark.slow
def test_the_wheel_declares_what_it_imports(bare_venv: Path, tmp_path: Path) -> None:
    found = _run(
        [str(bare_venv), "-c", "import importlib.util as u; print(u.find_spec('numpy'))"],
        tmp_path, RUN_BOUND_S,
    )  # fmt: skip
    assert found.stdout.strip() == "None"  # the bare venv is what a plain install gives
    scripts = _library_scripts()
    assert len(scripts) >= 3
    for script in scripts:
        _run([str(bare_venv), "-c", script], tmp_path, RUN_BOUND_S)


@pytest.mark.slow
def test_a_multi_rank_collective_runs_from_the_wheel(bare_venv: Path, tmp_path: Path) -> None:
    (tmp_path / "test_installed.py").write_text(MULTI_RANK_TEST)
    result = _run(
        [str(bare_venv), "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_installed.py"],
        tmp_path, RUN_BOUND_S,
    )  # fmt: skip
    assert "1 passed" in result.stdout, result.stdout
