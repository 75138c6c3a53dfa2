"""Listeners the harness starts, on the loopback interface only.

torch's TCPStore server binds every interface whatever host name it is given (``*:PORT``):
another host, or another local user, could reach it. Here the harness binds the socket itself
to 127.0.0.1 and gives torch its descriptor (``master_listen_fd``). Imports torch only when a
store is made.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"


def store(timeout: timedelta | None = None) -> Any:
    """A TCPStore server listening on 127.0.0.1 only, on a free port (its ``port``)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((HOST, 0))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        server = TCPStore(
            HOST,
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
            **options,
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now
    return server
