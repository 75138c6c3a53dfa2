"""DeepSpeed's module globals on a warm rank (adopt/deepspeed/ranks.py): taken once, as the
rank's first adopted test found them, put back after every test; a module first imported, or
imported anew, since then is taken as it is when the next test starts."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from harness.adopt.deepspeed import ranks

pytestmark = pytest.mark.unit


def _module(name: str, **values: object) -> ModuleType:
    module = ModuleType(name)
    vars(module).update(values)
    return module


@pytest.fixture
def deepspeed(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A stand-in `deepspeed.utils.groups` in sys.modules; the rank's state not taken yet."""
    monkeypatch.setattr(ranks, "_first_seen", None)
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    groups = _module("deepspeed.utils.groups", _WORLD_GROUP=None, _EXPERT_GROUPS={})
    monkeypatch.setitem(sys.modules, "deepspeed", _module("deepspeed"))
    monkeypatch.setitem(sys.modules, "deepspeed.utils.groups", groups)
    return groups


def _test(body: object) -> None:
    """One adopted test on this rank: its state taken, the body, the state put back."""
    kept = ranks.state_before_test()
    try:
        body()  # type: ignore[operator]
    finally:
        kept.put_back()


def test_what_a_test_changes_is_put_back_for_the_next(deepspeed: ModuleType) -> None:
    def leaves_state() -> None:
        deepspeed._WORLD_GROUP = "left behind"
        deepspeed._EXPERT_GROUPS["experts"] = "group"
        deepspeed._ADDED = 1

    _test(leaves_state)
    assert deepspeed._WORLD_GROUP is None and deepspeed._EXPERT_GROUPS == {}
    assert not hasattr(deepspeed, "_ADDED")
    _test(leaves_state)
    assert deepspeed._WORLD_GROUP is None and deepspeed._EXPERT_GROUPS == {}


def test_the_state_is_the_first_tests_even_when_changed_between_tests(
    deepspeed: ModuleType,
) -> None:
    # Where state is put into a module between adopted tests (an import's side effect as a
    # later test file loads, say), it lasts one test: DeepSpeed's suite has no such case.
    _test(lambda: None)
    deepspeed._WORLD_GROUP = "set between tests"  # by no adopted test
    seen: list[object] = []
    _test(lambda: seen.append(deepspeed._WORLD_GROUP))
    assert seen == ["set between tests"]  # the test runs as it found it
    assert deepspeed._WORLD_GROUP is None  # then the state the first test found is back


def test_a_module_imported_by_a_test_is_taken_as_the_next_test_starts(
    deepspeed: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    late = _module("deepspeed.runtime.late", registry=[])

    def imports() -> None:
        monkeypatch.setitem(sys.modules, "deepspeed.runtime.late", late)
        late.registry.append("from its import")

    _test(imports)
    assert late.registry == ["from its import"]  # unknown when the test started: as it was left
    _test(lambda: late.registry.append("from the next test"))
    assert late.registry == ["from its import"]


def test_a_module_imported_anew_is_taken_anew(
    deepspeed: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    _test(lambda: None)
    again = _module("deepspeed.utils.groups", _WORLD_GROUP="the new module's", _EXPERT_GROUPS={})
    monkeypatch.setitem(sys.modules, "deepspeed.utils.groups", again)

    def changes() -> None:
        again._WORLD_GROUP = "changed"

    _test(changes)
    assert again._WORLD_GROUP == "the new module's"  # not the first module's None


def test_a_class_keeping_state_is_taken_once_its_module_is_imported(
    deepspeed: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    _test(lambda: None)
    name = "deepspeed.runtime.zero.partition_parameters"
    module = _module(name)
    init = type("Init", (), {"num_module_parameters": 0, "__module__": name})
    module.Init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)

    def counts() -> None:
        init.num_module_parameters = 5  # type: ignore[attr-defined]
        init.linear_bk = "F.linear"  # type: ignore[attr-defined]

    _test(counts)
    assert init.num_module_parameters == 0 and not hasattr(init, "linear_bk")  # type: ignore[attr-defined]
