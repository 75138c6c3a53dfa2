"""The check a test on a kept group starts with: one record per rank, over plain sockets.

Every rank sends rank 0 the run it is starting and how many operations it made on the group
since the last check (torch's sequence number for the group). Rank 0 answers GO when every
record came and they agree, FAIL when the counts differ (a send never received, or a
collective only some ranks joined: gloo would pair it with a later test's operation) or a
record is missing or late (a rank without the group has closed its socket), and BARRIER only
where torch cannot count (the group's monitored barrier then decides). A peer starts the body
only on rank 0's GO, and rank 0 only after sending it, so every rank starts it or none.

A gloo barrier was the check before: on a busy machine its messages cost each rank several
thread wake-ups (~5 ms of CPU per test at 4 ranks); a record on a socket costs one. The
sockets are made with the group (rank 0 listens, its peers connect) and closed with it.
Runs inside ranks; imports no torch.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from enum import IntEnum


class Verdict(IntEnum):
    FAIL = 0
    GO = 1
    BARRIER = 2


UNKNOWN_OPS = -1  # a rank that cannot count its operations: the barrier decides
_HELLO = struct.Struct("!q")  # a peer's rank, once, when it connects
_RECORD = struct.Struct("!qq")  # the run's serial, the operations since the last check
_VERDICT = struct.Struct("!b")


class Channel:
    """Rank 0's end (a listening socket, then a connection per peer) or a peer's end."""

    def __init__(self, world_size: int, listener: socket.socket | None = None) -> None:
        self._world_size = world_size
        self._listener = listener
        self._peers: dict[int, socket.socket] = {}  # rank 0: rank -> connection
        self._to_host: socket.socket | None = None  # a peer: its connection to rank 0

    @classmethod
    def host(cls, world_size: int) -> Channel:
        """Rank 0's end, listening on a loopback port its peers learn through the store."""
        return cls(world_size, socket.create_server(("127.0.0.1", 0), backlog=world_size))

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    @classmethod
    def join(cls, world_size: int, rank: int, port: int, timeout_s: float) -> Channel:
        """A peer's end: connected (the kernel queues it until rank 0 accepts) and named."""
        channel = cls(world_size)
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # records go out at once
        channel._to_host = sock
        sock.sendall(_HELLO.pack(rank))
        return channel

    def check(self, serial: int, ops: int, wait_s: float, peer_wait_s: float) -> Verdict:
        """This rank's verdict: rank 0 waits up to `wait_s` for every record, a peer up to
        `peer_wait_s` for rank 0's answer. Never raises."""
        try:
            if self._to_host is not None:
                return self._ask(serial, ops, peer_wait_s)
            return self._decide(serial, ops, wait_s)
        except (OSError, ValueError, struct.error):
            return Verdict.FAIL

    def close(self) -> None:
        """Close every socket: a peer (or rank 0) still waiting on this rank fails at once."""
        for sock in (self._listener, self._to_host, *self._peers.values()):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._listener, self._to_host, self._peers = None, None, {}

    def _ask(self, serial: int, ops: int, wait_s: float) -> Verdict:
        assert self._to_host is not None
        if self._to_host.gettimeout() != wait_s:  # settimeout costs two system calls
            self._to_host.settimeout(wait_s)
        self._to_host.sendall(_RECORD.pack(serial, ops))
        (answer,) = _VERDICT.unpack(_read(self._to_host, _VERDICT.size))
        return Verdict(answer)

    def _decide(self, serial: int, ops: int, wait_s: float) -> Verdict:
        """Each read waits up to `wait_s` (set once per socket); the first that times out
        fails the check, so rank 0 never waits much longer than that in all."""
        verdict = Verdict.GO
        try:
            self._accept_peers(time.monotonic() + wait_s, wait_s)
            for sock in self._peers.values():
                their_serial, their_ops = _RECORD.unpack(_read(sock, _RECORD.size))
                if their_serial != serial:
                    verdict = Verdict.FAIL  # not at this run: never expected, never trusted
                elif their_ops != ops and UNKNOWN_OPS not in (their_ops, ops):
                    verdict = Verdict.FAIL  # out of step: only a fresh group is safe
                elif verdict is Verdict.GO and UNKNOWN_OPS in (their_ops, ops):
                    verdict = Verdict.BARRIER
        except (OSError, ValueError, struct.error):
            verdict = Verdict.FAIL  # a peer without the group, gone or late
        self._answer(verdict)
        return verdict

    def _accept_peers(self, deadline: float, wait_s: float) -> None:
        """Accept each peer's connection, made when the group was set up (first check only)."""
        while len(self._peers) < self._world_size - 1:
            assert self._listener is not None
            self._listener.settimeout(_left(deadline))
            sock, _ = self._listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(wait_s)
            (rank,) = _HELLO.unpack(_read(sock, _HELLO.size))
            self._peers[rank] = sock
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _answer(self, verdict: Verdict) -> None:
        for sock in self._peers.values():
            with contextlib.suppress(OSError):
                sock.sendall(_VERDICT.pack(verdict))  # a peer gone fails on its own


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the kept group's check timed out")
    return left


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed its end")  # its group is gone
        data += chunk
    return data
