"""What a plain `pip install rankwise` gives: the built wheel, in a bare venv holding only the
pinned torch and pytest (no numpy, no transformers), runs the README's library snippets and a
multi-rank collective. A dependency used but not declared fails here, not on a user's machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
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
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and wheel `python -m build` makes from a copy of this checkout, in dist/."""
    where = tmp_path_factory.mktemp("wheel")
    source = where / "source"  # a copy: building in the checkout would leave build/ there
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(where / "dist"),
         str(source)],
        where, INSTALL_BOUND_S,
    )  # fmt: skip
    return where / "dist"


@pytest.fixture(scope="module")
def bare_venv(built: Path) -> Path:
    """A venv with the wheel built from this checkout, torch and pytest pinned, nothing else."""
    where = built.parent
    (wheel,) = built.glob("rankwise-*.whl")
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


@pytest.mark.slow
def test_the_release_files_pass_twine_check(built: Path) -> None:
    """What CONTRIBUTING's release steps check before an upload: both files' metadata and
    the README as PyPI renders it."""
    files = sorted(str(f) for f in built.iterdir())
    assert sorted(Path(f).suffix for f in files) == [".gz", ".whl"], files
    _run([sys.executable, "-m", "twine", "check", "--strict", *files], built, RUN_BOUND_S)


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_its_metadata(built: Path) -> None:
    """pyproject lists the packages by hand: a new subpackage left out of the list would be
    missing from the wheel while every test of the checkout passes."""
    (wheel,) = built.glob("rankwise-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    sources = {
        path.relative_to(base).as_posix()
        for base, package in ((ROOT / "lib", "rankwise"), (ROOT, "harness"))
        for path in (base / package).rglob("*")
        if path.suffix in (".py", ".typed") and "__pycache__" not in path.parts
    }
    assert sources - names == set(), "in the checkout, missing from the wheel"
    assert {n.split("/")[0] for n in names} == {"rankwise", "harness", info.split("/")[0]}
    assert "[pytest11]\nharness = harness" in entry_points
    assert "Requires-Dist: torch>=2.13" in metadata
    # `pip install "rankwise[pytest]"` brings the harness's pytest; the license is an SPDX
    # expression (setuptools' license table is deprecated).
    assert "Provides-Extra: pytest" in metadata
    assert 'Requires-Dist: pytest>=8.0; extra == "pytest"' in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Python: >=3.10" in metadata
    assert f"Version: {version('rankwise')}" in metadata
