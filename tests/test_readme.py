"""Every Python snippet in README.md and the docs/ pages runs as written.

Snippets that define tests run under pytest with the harness, all in one run; the others run
each in a fresh single process (no launch), in a scratch directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
_LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def _snippets() -> list[str]:
    return [textwrap.dedent(body) for page in PAGES for _, body in _BLOCK.findall(page.read_text())]


def _is_test_file(code: str) -> bool:
    return re.search(r"^def test_", code, re.MULTILINE) is not None


SCRIPTS = [code for code in _snippets() if not _is_test_file(code)]
TEST_FILES = [code for code in _snippets() if _is_test_file(code)]


def _env() -> dict[str, str]:
    """This environment (so the ranks import this checkout), minus any launch variables."""
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}


def _passes(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run `python *args` in `cwd` (bounded); its stdout, once it exited 0."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    return result.stdout


def test_the_readme_has_both_kinds_of_snippet() -> None:
    assert len(SCRIPTS) >= 4 and len(TEST_FILES) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("code", SCRIPTS, ids=[f"script{i}" for i in range(len(SCRIPTS))])
def test_a_readme_script_runs_as_written(code: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{code}\n--- stderr ---\n{result.stderr[-3000:]}"


@pytest.mark.slow
def test_the_readme_tests_pass_as_written(tmp_path: Path) -> None:
    for i, code in enumerate(TEST_FILES):
        (tmp_path / f"test_readme_{i}.py").write_text(code)
    out = _passes(tmp_path, "-m", "pytest", "-p", "harness", "-p", "no:cacheprovider", "-q")
    assert " failed" not in out and " error" not in out


@pytest.mark.slow
def test_the_first_tests_command_prints_what_the_readme_shows(tmp_path: Path) -> None:
    """The first test, run with the command under it, prints the lines the README shows:
    the command and the test agree on how many ranks run."""
    text = README.read_text()
    first = textwrap.dedent(_BLOCK.findall(text)[0][1])
    command = re.search(r"```bash\n(pytest [^\n]*)\n```", text)
    shown = re.search(r"```text\n(test_sum\.py::.*?)```", text, re.DOTALL)
    assert command is not None and shown is not None
    args = command.group(1).split()[1:]
    (tmp_path / "test_sum.py").write_text(first)
    out = _passes(tmp_path, "-m", "pytest", "-p", "no:cacheprovider", *args)
    printed = [line.split(" [")[0].rstrip() for line in out.splitlines()]
    for line in shown.group(1).strip().splitlines():
        assert line in printed, f"{line!r} not printed:\n{out}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_library_snippet_runs_on_several_cpu_ranks_under_torchrun(
    world: int, tmp_path: Path
) -> None:
    """The README says its library snippet runs under `torchrun --nproc-per-node 2` on CPU
    ranks: each rank reports its place, and the collectives' checks hold on every rank."""
    snippet = next(code for code in SCRIPTS if code.startswith("# lib_snippet.py"))
    assert "torchrun --nproc-per-node 2 lib_snippet.py" in README.read_text()
    (tmp_path / "lib_snippet.py").write_text(snippet)
    env = {**_env(), "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "logs"  # each rank's stdout in a file of its own: lines not interleaved
    command = ["--standalone", "--nproc-per-node", str(world), "--log-dir", str(logs)]
    command += ["--redirects", "1", "lib_snippet.py"]
    _passes(tmp_path, "-m", "torch.distributed.run", *command, env=env)
    printed = {int(f.parent.name): f.read_text() for f in logs.glob("*/attempt_0/*/stdout.log")}
    assert sorted(printed) == list(range(world)), printed
    assert printed[0] == f"True 0 {world} True\n"
    for other in range(1, world):
        assert printed[other] == f"True {other} {world} False\n", printed


def test_every_launch_block_of_docs_clusters_is_run_by_the_cluster_lane() -> None:
    """docs/clusters.md's shell blocks each carry a cluster-lane marker, and a test of
    tests/cluster/test_docs.py runs each as written (`make test-cluster`)."""
    from tests.cluster.test_docs import PAGE, RUN_HERE, blocks

    assert len(blocks()) == PAGE.read_text().count("```bash"), "a block without its marker"
    assert set(blocks()) == set(RUN_HERE)
