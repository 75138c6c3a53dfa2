"""The distribution's promises: cheap plugin import, one registration, opt-out works."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

RANK_TEST = """
import pytest, torch.distributed as dist

@pytest.mark.ranks
def test_two(world_size):
    assert dist.get_world_size() == world_size == 2
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_importing_harness_does_not_import_torch() -> None:
    result = _python("import harness, sys; print('torch' in sys.modules)")
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.slow
def test_importing_rankwise_imports_torch_and_nothing_of_the_harness() -> None:
    result = _python(
        "import rankwise, sys; print(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('harness', 'pytest', '_pytest', 'transformers')))"
    )
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("autoload", ["1", ""], ids=["autoload-off", "autoload-on"])
def test_dash_p_harness_registers_the_plugin_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, autoload: str
) -> None:
    if autoload:
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", autoload)
    else:
        monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makepyfile(RANK_TEST)
    # A second registration would fail on the duplicate --ranks option.
    result = pytester.runpytest_subprocess("-p", "harness", "--ranks", "2")
    result.assert_outcomes(passed=1)
    help_text = pytester.runpytest_subprocess("-p", "harness", "--help")
    help_text.stdout.fnmatch_lines(["*--ranks=N*", "*--rank-timeout=S*"])


@pytest.mark.slow
def test_no_harness_opts_out(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:harness")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "no:harness", "--ranks", "2")
    result.stderr.fnmatch_lines(["*unrecognized arguments: --ranks*"])


def test_the_entry_point_is_declared() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert names.get("harness") == "harness"
    assert os.path.exists(os.path.join(os.path.dirname(__import__("harness").__file__), "py.typed"))


def test_the_entry_point_loads_cleanly_under_warnings_as_errors(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loaded by its entry point (no -p harness), as most users load it: the plugin's own
    # modules must not be imported before pytest can mark them for assertion rewriting, or
    # pytest warns, and a project with filterwarnings = error cannot start.
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(RANK_TEST)
    result = pytester.runpytest_subprocess("--ranks", "2", "-W", "error")
    result.assert_outcomes(passed=1)
    assert "PytestAssertRewriteWarning" not in result.stdout.str() + result.stderr.str()


def test_both_packages_say_the_installed_version() -> None:
    """__version__ of rankwise and of harness is the distribution's own (pyproject's), read
    from the installed metadata: one number, set in one place."""
    import re
    from importlib.metadata import version
    from pathlib import Path

    import rankwise

    import harness

    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    assert declared is not None
    assert rankwise.__version__ == harness.__version__ == version("rankwise")
    assert version("rankwise") == declared[1]


def test_the_changelog_has_a_section_per_version() -> None:
    """Keep a Changelog: Unreleased first, then each release, newest first, the installed
    one among them; each entry a bullet of at most two lines, the whole file short enough for
    users to read (at most 300 lines: internal changes go in commit messages)."""
    import re
    from importlib.metadata import version
    from pathlib import Path

    text = (Path(__file__).parent.parent / "CHANGELOG.md").read_text()
    sections = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert sections[0] == "Unreleased"
    releases = sections[1:]
    assert version("rankwise") in releases
    as_tuples = [tuple(int(x) for x in v.split(".")) for v in releases]
    assert as_tuples == sorted(as_tuples, reverse=True)
    entries: list[list[str]] = []  # each bullet and the indented lines that continue it
    for line in text.splitlines():
        if line.startswith("- "):
            entries.append([line])
        elif line.startswith("  ") and entries:
            entries[-1].append(line)
    long = [entry[0] for entry in entries if len(entry) > 2]
    assert entries and not long, long
    assert len(text.splitlines()) <= 300


@pytest.mark.unit
def test_pyproject_lists_every_package_of_the_source_tree() -> None:
    """setuptools installs only the packages pyproject names: a new folder left out of the
    list would pass from the checkout and be missing from the wheel."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    listed = re.search(r"^packages = \[(.*?)\]", (root / "pyproject.toml").read_text(), re.M | re.S)
    assert listed is not None
    declared = set(re.findall(r'"([^"]+)"', listed[1]))
    found = {"rankwise"} | {
        ".".join(p.parent.relative_to(root).parts) for p in (root / "harness").rglob("__init__.py")
    }
    assert found == declared, f"pyproject's packages differ: {sorted(found ^ declared)}"
