"""rankwise: torch.distributed utilities that never leave a rank waiting."""

from __future__ import annotations

__all__: list[str] = []
