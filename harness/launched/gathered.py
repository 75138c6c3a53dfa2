"""What one exchange through the launch's store found: every rank's value, and why each rank
that gave none is absent. A result, not session state: each caller reads its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gathered:
    """Every rank's value under one name, in rank order (None where a rank gave none), and
    the reason for each such rank (gone, moved on, late, or the store lost)."""

    values: list[bytes | None]
    absent: Mapping[int, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """No rank is absent. (With the launch's store lost every value is None, this rank's
        own too, which is not counted absent: see `has_every_value`.)"""
        return not self.absent

    @property
    def has_every_value(self) -> bool:
        """Every rank's value is here, this rank's own included."""
        return all(value is not None for value in self.values)

    def why(self, rank: int, otherwise: str = "gone") -> str:
        return self.absent.get(rank, otherwise)

    def absent_text(self, ranks: set[int] | None = None) -> str:
        """'rank 2: why; rank 3: why' for the absent ranks (those in `ranks`, if given)."""
        return "; ".join(
            f"rank {r}: {why}"
            for r, why in sorted(self.absent.items())
            if ranks is None or r in ranks
        )

    def with_absent(self, more: Mapping[int, str]) -> Gathered:
        """The same values, with more ranks counted absent (or their reasons made exact)."""
        return Gathered(self.values, {**self.absent, **more})
