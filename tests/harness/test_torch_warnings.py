"""torch's "Failed to initialize NumPy" warning, once per session as in a plain session.

torch warns once in each process that imports it without numpy. A session showed it once in
its warnings summary (the test module's `import torch`) and again from each process of the
harness's own: the fork server's output in the first failing test's report, each spawned
rank's start-up in its test's captured stderr, and every launched rank's configure, raw.
The failing test comes first: its report shows what the ranks' start-up printed. Each test
hides numpy behind a package that fails to import, as a CPU wheel without numpy is.
"""

from __future__ import annotations

import os

import pytest

from tests.harness.test_torchrun import torchrun

pytestmark = pytest.mark.slow

NOTICE = "Failed to initialize NumPy"

TESTS = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.ranks(2)
def test_fails_on_rank_1(rank):
    if rank == 1:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))


@pytest.mark.ranks(2)
def test_passes(rank):
    dist.all_reduce(torch.ones(1))
"""


def _without_numpy(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    hidden = pytester.mkdir("hidden")
    (hidden / "numpy").mkdir()
    (hidden / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy' (hidden)\", name='numpy')\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{hidden}:{pytester.path}")
    pytester.makepyfile(test_noise=TESTS)


@pytest.mark.parametrize(
    "args",
    [(), ("-n", "2"), ("--rank-start-method", "spawn")],
    ids=["forkserver", "xdist", "spawn"],
)
def test_a_session_shows_it_once_in_its_warnings_summary(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    _without_numpy(pytester, monkeypatch)
    result = pytester.runpytest_subprocess("-p", "harness", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str() + result.stderr.str()
    assert out.count(NOTICE) == 1, out
    assert out.index(NOTICE) > out.index("warnings summary"), out


def test_launched_ranks_show_it_once_in_rank_0s_warnings_summary(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_numpy(pytester, monkeypatch)
    result = torchrun(pytester.path, 2, extra_env={"PYTHONPATH": os.environ["PYTHONPATH"]})
    result_summary = result.output.split("warnings summary", 1)[1].split("-- Docs")[0]
    assert NOTICE in result_summary, result.output[-6000:]
    # and once more from torchrun's own process, which imports torch before any rank starts
    # (its stderr follows every stdout line here): the ranks print no copy of their own
    assert result.output.count(NOTICE) == 2, result.output[-6000:]
