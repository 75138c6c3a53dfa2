"""For test harnesses and tools, not for the code under test: the library's API is
``rankwise.__all__``, and rankwise itself never imports this module.

- Named points: rankwise's labelled collectives announce themselves to observers registered
  here, each called as ``observer(phase, kind, label)`` with ``phase`` ``"enter"`` or
  ``"exit"``. An observer may raise (a harness injects a fault at a point that way).
- The wire format: ``encode`` turns a value into the bytes rankwise's collectives send (a
  ``torch.save`` payload that must load with ``torch.load(weights_only=True)``), ``decode``
  loads them back, and ``refusal`` says in words why a payload was refused.
- ``NotSimulatedError``: what a labelled collective raises on a fake process group (torch's
  "fake" backend) where its result would need data the other ranks never sent.
- torchrun's error file: ``write_launcher_error`` writes this worker's entry, which torchrun's
  failure summary reads (the entry with the smallest timestamp is its "Root Cause").
"""

from __future__ import annotations

__all__ = [
    "NotSimulatedError",
    "Observer",
    "WireError",
    "add_observer",
    "decode",
    "encode",
    "refusal",
    "remove_observer",
    "write_launcher_error",
]

from rankwise._error_file import write_entry as write_launcher_error
from rankwise._fake import NotSimulatedError
from rankwise._points import Observer, add_observer, remove_observer
from rankwise._wire import WireError, decode, encode, refusal
