"""The one shape of every bad-value message: what, the value, where it came from, the fix.

"invalid timeout 'soon' from --rank-timeout: use seconds > 0". Shared by the settings, the
markers, faults, expected outcomes and hygiene, so every message reads the same way.
"""

from __future__ import annotations

from harness.common.pytest_internals import Failed


class SpecError(ValueError):
    """A declaration (option, marker, fault, expectation) that cannot be carried out."""


def invalid(what: str, value: object, origin: str, fix: str) -> str:
    """'invalid <what> <value> from <origin>: <fix>'."""
    return f"invalid {what} {value!r} from {origin}: {fix}"


class HarnessError(Failed):  # pytest.fail's exception: reported with its message alone
    """The harness itself could not run the test: reported as an error, not a failure."""

    def __init__(self, msg: str, pytrace: bool = False) -> None:
        super().__init__(msg, pytrace=pytrace)
