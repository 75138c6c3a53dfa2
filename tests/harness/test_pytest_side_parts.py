"""Small parts both sides use, tested directly in this process: how a hung or crashed rank's
stack is trimmed to the test's own frames, where a rank finds a function by name, and the
environment copied and restored cheaply."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.common import environment, stacks
from harness.common.errors import SpecError
from harness.common.expect import raises
from harness.common.outcome import Ending
from harness.plan import packing
from harness.pytest_side.run_on_ranks import WorldOutcome
from tests.harness.conftest import outcome

pytestmark = pytest.mark.unit

HERE = Path(__file__)


def module_level(x: int) -> int:
    return x


RETURN_LINE = module_level.__code__.co_firstlineno + 1  # the line `return x` is on


def test_a_rank_finds_a_module_level_function_by_name_and_nothing_else() -> None:
    target = packing.function_target(module_level)
    assert (target.module, target.qualname) == (__name__, "module_level")
    assert target.file == __file__  # a test file: loaded in the ranks as pytest loads it
    with pytest.raises(SpecError, match=r"needs a module-level function.*move it to the top"):
        packing.function_target(lambda: None)

    def nested() -> None: ...

    with pytest.raises(SpecError, match="module-level"):
        packing.function_target(nested)
    assert packing.function_target(os.getcwd).file is None  # a library's: imported by name
    assert packing.pickles(1) and not packing.pickles(lambda: None)


def test_importlibs_frames_fold_into_one_line_per_run() -> None:
    dump = "\n".join(
        [
            "Thread 0x1 (most recent call first):",
            '  File "/app/test_x.py", line 3 in test_x',
            '  File "<frozen importlib._bootstrap>", line 1 in _load',
            '  File "<frozen importlib._bootstrap_external>", line 2 in exec_module',
            '  File "<frozen importlib._bootstrap>", line 3 in _call',
            '  File "/lib/big.py", line 9 in <module>',
        ]
    )
    folded = stacks.fold_importlib(dump).splitlines()
    assert folded[2] == "  [3 importlib frame(s)]" and folded[3].endswith("in <module>")


def test_a_dump_in_a_launched_process_keeps_the_tests_frames_only(tmp_path: Path) -> None:
    caller = "/site/harness/launched/body.py"
    dump = "\n".join(
        [
            "Current thread 0x1 (most recent call first):",
            '  File "/site/harness/launched/watch.py", line 5 in _fire',
            "",
            "Thread 0x2 (most recent call first):",
            '  File "/site/harness/launched/store.py", line 7 in _beat',
            '  File "/usr/lib/python3.11/threading.py", line 9 in run',
            "",
            "Thread 0x3 (most recent call first):",
            f'  File "{HERE}", line {RETURN_LINE} in module_level',
            f'  File "{caller}", line 40 in run',
            '  File "/site/_pytest/runner.py", line 1 in call',
        ]
    )
    kept = stacks.trim_in_process(dump, caller, quiet=("launched/store.py",))
    assert kept.splitlines() == [
        "Thread 0x3 (most recent call first):",
        f'  File "{HERE}", line {RETURN_LINE} in module_level',
        "    return x",  # the frame's source line, as a traceback shows it
    ]


def test_a_crash_report_is_read_bounded_and_without_its_module_list(tmp_path: Path) -> None:
    report = tmp_path / "rank1.crash"
    assert stacks.crash_stack(report) == ""  # a rank that wrote none
    report.write_text(
        "Fatal Python error: Segmentation fault\n\n"
        "Current thread 0x1 (most recent call first):\n"
        f'  File "{HERE}", line {RETURN_LINE} in module_level\n'
        "\nExtension modules: numpy, torch (total: 2)\n"
    )
    text = stacks.crash_stack(report)
    assert text.startswith("Fatal Python error: Segmentation fault")
    assert "    return x" in text and "Extension modules" not in text


def test_the_environment_is_restored_as_it_was_and_only_changes_are_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANKWISE_TEST_KEPT", "1")
    before = environment.snapshot()
    monkeypatch.setenv("RANKWISE_TEST_KEPT", "2")
    monkeypatch.setenv("RANKWISE_TEST_NEW", "x")
    assert environment.variables()["RANKWISE_TEST_NEW"] == "x"
    environment.restore(before)
    assert os.environ["RANKWISE_TEST_KEPT"] == "1" and "RANKWISE_TEST_NEW" not in os.environ
    assert environment.decoded(environment.encoded({"A": "b"})) == {"A": "b"}
    assert not environment.replaced()


def test_a_world_outcome_gives_values_only_when_every_rank_returned() -> None:
    mro = ("t.E", "builtins.Exception", "builtins.BaseException", "builtins.object")
    fine = WorldOutcome([outcome(r, value_blob=pickle.dumps(r * 10)) for r in range(2)])
    assert fine.values == [0, 10] and fine.report() == "every rank returned"
    assert [o.rank for o in fine] == [0, 1] and len(fine) == 2 and fine[1].value == 10
    broken = WorldOutcome(
        [outcome(0), outcome(1, Ending.RAISED, exc_type="t.E", exc_classes=mro, message="x")]
    )
    assert broken.endings == [Ending.RETURNED, Ending.RAISED]
    with pytest.raises(AssertionError, match=r"^rank 1 failed: raised E: x"):
        _ = broken.values
    broken.expect(rank=1, does=raises(Exception))  # as expected: no error
    with pytest.raises(AssertionError, match=r"expected outcomes not met on rank 0"):
        broken.expect(rank=0, does=raises(Exception), others=raises(Exception))


def test_pytests_private_parts_answer_as_the_harness_reads_them(
    pytestconfig: pytest.Config,
) -> None:
    """The one module reading _pytest: each answer in the form its callers expect, so a
    pytest that moved a part fails here, named, not in a rank."""
    import ast
    import warnings

    from harness.common import pytest_internals as internals

    shown = internals.saferepr("x" * 500, maxsize=20)
    assert len(shown) <= 20 and "..." in shown
    flags = internals.option_flags(pytestconfig)
    assert flags["--rank-timeout"] == "rank_timeout" and flags["--maxfail"] == "maxfail"
    assert internals.parse_warning_filter("error::UserWarning", escape=False)[:1] == ("error",)
    tree = ast.parse("def test_x():\n    assert 1 == 2\n")
    assert internals.rewrite_asserts(tree, b"", "test_x.py")
    assert "@py_assert" in ast.unparse(tree)  # pytest's rewritten form
    assert internals.capture_class("FDCapture").__name__ == "FDCapture"
    assert hasattr(internals.assertion_util(), "assertrepr_compare")
    assert internals.junit_xml_key() is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the writer's devnull, left to gc
        internals.null_terminal_writer().write("nowhere")


class _FakeCoverage:
    """The Coverage measuring this process, as measured.py reads it."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(
            config_file="/p/.coveragerc", source=["pkg"], source_pkgs=[], run_include=None,
            run_omit=["*/tests/*"], branch=True,
        )  # fmt: skip
        self.combined: list[list[str]] = []

    def combine(self, data_paths: list[str], keep: bool) -> None:
        assert keep is False
        self.combined.append(data_paths)


def test_ranks_measure_as_this_process_and_their_data_is_folded_into_its(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from harness.common.protocol import RANK_DATA_SUFFIX
    from harness.plan import measured

    monkeypatch.setitem(sys.modules, "coverage", None)  # not measured: neither are the ranks
    assert measured.setup_for_ranks(tmp_path / "cov") is None
    cov = _FakeCoverage()
    fake = SimpleNamespace(Coverage=SimpleNamespace(current=lambda: cov))
    monkeypatch.setitem(sys.modules, "coverage", fake)
    setup = measured.setup_for_ranks(tmp_path / "cov")
    assert setup is not None and (tmp_path / "cov").stat().st_mode & 0o777 == 0o700
    assert (setup.source, setup.omit, setup.branch) == (("pkg",), ("*/tests/*",), True)
    assert setup.data_file == str(tmp_path / "cov" / measured.RANK_DATA_FILE)
    measured.fold_ranks_data(tmp_path / "cov")
    assert cov.combined == []  # no rank wrote data: nothing to fold
    ranks_data = tmp_path / "cov" / f"{measured.RANK_DATA_FILE}.{RANK_DATA_SUFFIX}.h.1.0"
    ranks_data.write_text("")
    (tmp_path / "cov" / "unrelated").write_text("")
    measured.fold_ranks_data(tmp_path / "cov")
    assert cov.combined == [[str(ranks_data)]]
