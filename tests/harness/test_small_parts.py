"""Small harness parts tested directly, without a session: what the adopters give the warm
layer, torch's import-time warnings held and said once, and pytest-timeout paused for a body."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from harness.common import torch_import_warnings as notices
from harness.plan import adopter_needs, timeout_interop

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


def _config() -> Any:
    return SimpleNamespace(stash=pytest.Stash())


def test_without_adopters_the_warm_layer_gets_nothing() -> None:
    config = _config()
    assert adopter_needs.libraries(config) == frozenset() and adopter_needs.endings(config) == []


def test_what_the_adopters_give_is_read_back_and_the_cleanups_list_is_a_copy() -> None:
    config = _config()
    ended: list[str] = []
    adopter_needs.give(config, frozenset({"deepspeed"}), [lambda: ended.append("shm")])
    assert adopter_needs.libraries(config) == frozenset({"deepspeed"})
    found = adopter_needs.endings(config)
    found.clear()  # a reader's list: the stash keeps its own
    (cleanup,) = adopter_needs.endings(config)
    cleanup()
    assert ended == ["shm"]


def test_the_numpy_notice_is_dropped_and_any_other_warning_shown() -> None:
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with notices.without_numpy_notice():
            warnings.warn(
                f"{notices.NUMPY_NOTICE}: No module named 'numpy'", UserWarning, stacklevel=1
            )
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["something else"]


def test_warnings_held_are_raised_again_once_from_where_they_came() -> None:
    kept: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(), notices.held(kept):
        warnings.simplefilter("always")  # as at a launched session's configure: not an error
        warnings.warn("said while configuring", UserWarning, stacklevel=1)
    assert [str(w.message) for w in kept] == ["said while configuring"]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        notices.raise_again(kept)
    assert [str(w.message) for w in shown] == ["said while configuring"]
    assert shown[0].filename == __file__ and kept == []


def test_a_held_warning_a_filter_makes_an_error_is_dropped_not_raised() -> None:
    kept: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(), notices.held(kept):
        warnings.simplefilter("always")
        warnings.warn("made an error", UserWarning, stacklevel=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        notices.raise_again(kept)  # no test module here to fail: dropped
    assert kept == []


class _Timing:
    """pytest-timeout as the harness sees it: its item settings and its two hooks."""

    def __init__(self, timeout: float, func_only: bool) -> None:
        self.settings = SimpleNamespace(timeout=timeout, func_only=func_only)
        self.calls: list[str] = []

    def _get_item_settings(self, item: Any) -> Any:
        return self.settings


def _item(timing: _Timing | None) -> Any:
    said: list[str] = timing.calls if timing is not None else []
    hook = SimpleNamespace(
        pytest_timeout_cancel_timer=lambda item: said.append("cancel"),
        pytest_timeout_set_timer=lambda item, settings: said.append("set"),
    )
    manager = SimpleNamespace(get_plugin=lambda name: timing, hook=hook)
    return SimpleNamespace(config=SimpleNamespace(pluginmanager=manager))


@pytest.mark.parametrize(
    ("timeout", "func_only", "bound", "calls"),
    [
        (30.0, False, 30.0, ["cancel", "set"]),  # the whole protocol: set again for teardown
        (30.0, True, None, ["cancel"]),  # the call only: nothing to set again, no fixture bound
        (0.0, False, None, []),  # off
    ],
)
def test_pytest_timeout_is_paused_for_the_body_and_its_fixture_bound_read(
    timeout: float, func_only: bool, bound: float | None, calls: list[str]
) -> None:
    timing = _Timing(timeout, func_only)
    item = _item(timing)
    assert timeout_interop.pytest_timeout_of_fixtures(item) == bound
    with timeout_interop.pytest_timeout_paused(item):
        assert timing.calls == calls[:1]
    assert timing.calls == calls


def test_without_pytest_timeout_nothing_is_paused_or_bounded() -> None:
    item = _item(None)
    assert timeout_interop.pytest_timeout_of_fixtures(item) is None
    with timeout_interop.pytest_timeout_paused(item):
        pass


CPUINFO = """processor\t: {n}
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R)
flags\t\t: {flags}
cpu MHz\t\t: {mhz}
"""


def test_a_cpus_fingerprint_follows_what_py_cpuinfo_reads(tmp_path: Any) -> None:
    """The same CPU (another core, another clock reading) gives the same fingerprint; other
    flags or another py-cpuinfo give another; no /proc/cpuinfo gives none (nothing kept)."""
    from harness.adopt.deepspeed import cpu_description

    def print_of(flags: str, mhz: str, cores: int = 2, version: str = "9.0.0") -> str | None:
        path = tmp_path / f"cpuinfo-{flags}-{mhz}-{cores}"
        path.write_text("\n".join(CPUINFO.format(n=n, flags=flags, mhz=mhz) for n in range(cores)))
        return cpu_description.fingerprint(SimpleNamespace(CPUINFO_VERSION_STRING=version), path)

    same = print_of("fpu avx2", "2000.1")
    assert same is not None
    assert print_of("fpu avx2", "2400.9", cores=4) == same
    assert print_of("fpu avx2 avx512f", "2000.1") != same
    assert print_of("fpu avx2", "2000.1", version="9.1.0") != same
    assert cpu_description.fingerprint(SimpleNamespace(), tmp_path / "absent") is None


def _a_session(root: Any, blocked: bool = False, cacheclear: bool = False) -> Any:
    return SimpleNamespace(
        rootpath=root,
        pluginmanager=SimpleNamespace(is_blocked=lambda name: blocked),
        known_args_namespace=SimpleNamespace(cacheclear=cacheclear),
    )


def test_what_the_conftests_set_is_kept_privately_for_the_next_sessions_server(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the conftests set (a token, say) is kept in a file of this user's alone, outside
    the project, and read back only from such a file; never a variable that would have the
    server run other code; nothing under -p no:cacheprovider or --cache-clear."""
    import os
    import stat

    from harness.warm import conftest_environ

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("GONE_AFTER", "1")
    session = _a_session(tmp_path / "project")
    before = dict(os.environ)
    monkeypatch.setenv("SET_BY_CONFTEST", "token")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    monkeypatch.delenv("GONE_AFTER")
    conftest_environ.record(session, before)
    monkeypatch.setattr(os, "environ", before)  # the next session, before its conftests
    predicted = conftest_environ.predicted(session)
    assert predicted["SET_BY_CONFTEST"] == "token" and "GONE_AFTER" not in predicted
    assert "LD_PRELOAD" not in predicted
    path = conftest_environ.kept_file(session)
    assert path is not None and str(tmp_path / "project") not in str(path.parent)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)  # readable by others: not believed (nor written so by the harness)
    assert "SET_BY_CONFTEST" not in conftest_environ.predicted(session)
    assert conftest_environ.kept_file(_a_session(tmp_path, blocked=True)) is None
    assert conftest_environ.kept_file(_a_session(tmp_path, cacheclear=True)) is None


def test_own_files_are_written_whole_and_read_only_where_no_one_else_may_change_them(
    tmp_path: Any,
) -> None:
    import stat

    from harness.common import own_files

    path = tmp_path / "kept" / "value.json"
    assert own_files.write_own(path, "{}", folder_mode=0o700)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["value.json"]  # no partial left
    assert own_files.read_own(path, others_may_read=False) == "{}"
    path.chmod(0o644)
    assert own_files.read_own(path, others_may_read=True) == "{}"
    assert own_files.read_own(path, others_may_read=False) is None
    path.chmod(0o622)
    assert own_files.read_own(path, others_may_read=True) is None
    assert own_files.read_own(tmp_path / "absent", others_may_read=True) is None
    (tmp_path / "file").write_text("")
    assert not own_files.write_own(tmp_path / "file" / "below", "x")  # a file as its folder
