"""Reading torch's errors and stacks: which collective a rank waited in, and whether an error
reads as a peer going away (gloo's transport errors, torch.distributed's error types) or as
the rank's own mistake. Pure functions over text; the record (outcome.py) and the report
(report_text.py) ask them.

Imports nothing of the harness, and no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Errors that a rank gets because a peer went away: they are consequences, not causes.
_PEER_ERROR_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
# faulthandler's line for a frame of torch's collective API:
#   File ".../distributed_c10d.py", line 5356 in barrier
# (or of the functional collectives DeviceMesh and DTensor wait in: wait_tensor)
_C10D_FRAME = re.compile(r'(?:distributed_c10d|_functional_collectives)\.py", line \d+ in (\w+)')
# rankwise waiting for an async collective's work (on a launch, through its peer watch).
_RANKWISE_WAIT_FRAME = re.compile(
    r'rankwise/_(?:watch|transport)\.py", line \d+ in (?:wait|settle)'
)
# A traceback's line for the same frame: File ".../distributed_c10d.py", line 5356, in barrier
_C10D_TRACEBACK_FRAME = re.compile(
    r'(?:distributed_c10d|_functional_collectives)\.py", line \d+, in (\w+)'
)
# A traceback's frame in torch.distributed (c10d, functional collectives, FSDP, DTensor).
_TORCH_DISTRIBUTED_FRAME = re.compile(r'File "[^"]*/torch/distributed/')
PEER_ERROR_TEXT = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"ProcessGroup.*(aborted|destroyed)|communicator was aborted|"
    r"Socket Timeout|Connection refused|peer.*(closed|died|exited)|"
    r"Timed out waiting \d+ms for (recv|send) operation",  # gloo: a peer never came
    re.IGNORECASE,
)

# torch.distributed's words for a rank's own network mistake (a port another socket holds,
# an address not on this host): never a peer's doing, though its error type reads so.
_OWN_NETWORK_ERROR_TEXT = re.compile(
    r"EADDRINUSE|address already in use|EADDRNOTAVAIL|cannot assign requested address",
    re.IGNORECASE,
)


def report_looks_collateral(text: str) -> bool:
    """Whether a pytest failure report (its text alone) reads as a peer going away inside
    torch.distributed, as `reads_as_peer_gone` judges a rank's exception."""
    if _OWN_NETWORK_ERROR_TEXT.search(text) or "torch/distributed/" not in text:
        return False
    return bool(PEER_ERROR_TEXT.search(text))


def collective_in_stack(stack: str) -> str:
    """The torch collective a faulthandler stack waits in ("" when none)."""
    match = _C10D_FRAME.search(stack)
    return match.group(1) if match else ""


def innermost_collective(traceback: str) -> str:
    """The innermost torch collective a traceback passes through ("" when none)."""
    found = _C10D_TRACEBACK_FRAME.findall(traceback)
    return found[-1] if found else ""  # the innermost: tracebacks list it last


def waiting_in_torch(stack: str) -> bool:
    """Whether a stack waits in torch.distributed, or in rankwise's wait for an async
    collective (under its peer watch)."""
    return bool(_C10D_FRAME.search(stack) or _RANKWISE_WAIT_FRAME.search(stack))


def own_network_error(message: str) -> bool:
    """Whether an error's message names the rank's own network mistake (a port in use, an
    address not on this host): never a peer's doing, though its type may read so."""
    return _OWN_NETWORK_ERROR_TEXT.search(message) is not None


def reads_as_peer_gone(
    exc_name: str, exc_classes: Sequence[str], message: str, traceback: str
) -> bool:
    """Whether a raised error reads as a peer going away: torch.distributed's error types, or
    a peer's words ("Connection closed by peer") in an error from torch.distributed."""
    if own_network_error(message):
        return False
    if exc_name in _PEER_ERROR_TYPES:
        return True
    # Words like "Connection refused" mean a peer is gone only in torch.distributed's
    # errors: the rank's own sockets and pipes fail with the same words.
    from_torch = _TORCH_DISTRIBUTED_FRAME.search(traceback) is not None or any(
        name.startswith("torch.") for name in exc_classes
    )
    return from_torch and bool(PEER_ERROR_TEXT.search(message))
