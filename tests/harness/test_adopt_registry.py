"""The adoption seam's registry and shared helpers, tested directly with a fake config: the
built-in and projects' adopters, the ones --rank-adopt asks for, bad adopters refused, names
checked after collection, and which adopter a class belongs to."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness.adopt import core
from harness.plan import adopter_needs, settings

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


class _Base:
    def run_test(self) -> None:
        pass


class _Ours(core.Adopter):
    name = "ours"
    libraries = ("ourlib",)

    def claims(self, cls: type) -> bool:
        return core.base_named(cls, "_Base", ("run_test",)) is not None

    def endings(self, config: Any) -> list[Any]:
        return [print]


class _Theirs(core.Adopter):
    name = "theirs"

    def claims(self, cls: type) -> bool:
        return issubclass(cls, _Base)


def _config(asked: frozenset[str], *given: list[Any]) -> Any:
    config = SimpleNamespace(
        stash=pytest.Stash(),
        hook=SimpleNamespace(pytest_harness_adopters=lambda config: list(given)),
        getoption=lambda name, default=None: ",".join(sorted(asked)),
    )
    config.stash[settings._settings_key] = SimpleNamespace(adopt=asked)
    return config


def test_projects_adopters_join_the_built_in_ones_and_the_asked_give_their_libraries() -> None:
    config = _config(frozenset({"ours"}), [_Ours()], [_Theirs()])
    core.register_adopters(config, built_in=[])
    assert list(core.registered(config)) == ["ours", "theirs"]
    assert [a.name for a in core.asked(config)] == ["ours"]
    assert adopter_needs.libraries(config) == frozenset({"ourlib"})
    assert adopter_needs.endings(config) == [print]


def test_a_conftest_asked_again_gives_the_same_adopter_once() -> None:
    config = _config(frozenset(), [_Ours()], [_Ours()])
    core.register_adopters(config, built_in=[])
    assert list(core.registered(config)) == ["ours"]


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (object(), "return instances of a subclass of harness.Adopter"),
        (type("Comma", (core.Adopter,), {"name": "a,b"})(), "must be new, non-empty"),
        (type("Nameless", (core.Adopter,), {})(), "must be new, non-empty"),
    ],
)
def test_a_bad_adopter_is_a_usage_error_saying_what_to_return(given: Any, said: str) -> None:
    with pytest.raises(pytest.UsageError, match=said):
        core.register_adopters(_config(frozenset(), [given]), built_in=[])


def test_an_asked_name_no_adopter_has_is_refused_after_collection_naming_the_known() -> None:
    config = _config(frozenset({"nosuch"}), [_Ours()])
    core.register_adopters(config, built_in=[])
    with pytest.raises(pytest.UsageError, match=r"nosuch.*use ours"):
        core._check_asked(config)


def test_a_class_another_adopter_claims_is_left_alone_unless_that_one_is_asked_too() -> None:
    class Test(_Base):
        pass

    config = _config(frozenset({"theirs"}), [_Ours()], [_Theirs()])
    core.register_adopters(config, built_in=[])
    said = core.claimed_elsewhere(config, Test, "theirs") or ""
    assert "add ours to --rank-adopt" in said  # ours claims it and is not asked
    config.stash[core._asked_key] = frozenset({"ours", "theirs"})
    assert core.claimed_elsewhere(config, Test, "theirs") is None
    assert core.claimed_elsewhere(config, _Ours, "ours") is None  # no other claims it


def test_a_base_is_found_by_name_and_parts_and_parameters_without_self() -> None:
    class Test(_Base):
        def helper(self, rank: int, world_size: int) -> None:
            pass

    assert core.base_named(Test, "_Base", ("run_test",)) is _Base
    assert core.base_named(Test, "_Base", ("missing",)) is None
    assert core.parameters_of(Test.helper) == ["rank", "world_size"]
    assert core.parameters_of(3) == []


def test_the_harness_hook_gathers_every_plugins_adopters_through_pluggy() -> None:
    """The hook as pytest calls it (pluggy with the harness's spec): each plugin's list, a
    plugin returning none left out, every adopter registered."""
    import pluggy

    from harness import hookspecs

    manager = pluggy.PluginManager("pytest")
    manager.add_hookspecs(hookspecs)

    class Gives:
        def __init__(self, given: list[Any] | None) -> None:
            self.given = given

        @pluggy.HookimplMarker("pytest")
        def pytest_harness_adopters(self, config: Any) -> list[Any] | None:
            return self.given

    for given in ([_Ours()], None, [_Theirs()]):
        manager.register(Gives(given))
    config = _config(frozenset({"theirs"}))
    config.hook = manager.hook
    core.register_adopters(config, built_in=[])
    assert sorted(core.registered(config)) == ["ours", "theirs"]
    assert [a.name for a in core.asked(config)] == ["theirs"]
