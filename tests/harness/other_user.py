"""Acting as another local user (nobody) against a store on this machine, as an attacker on a
shared runner would: a TCPStore client in plain Python, run by the system's interpreter as
`nobody` through runuser. Needs root; tests that use it are skipped with the reason elsewhere.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SYSTEM_PYTHON = "/usr/bin/python3"

# A TCPStore client speaking torch's wire protocol (validate, then SET; a GET of the last key
# waits until the server has handled them all): keys and values come as JSON with base64.
CLIENT = r"""
import base64, json, socket, struct, sys
port, items = int(sys.argv[1]), json.load(open(sys.argv[2]))
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE))
def field(b):
    return struct.pack("<Q", len(b)) + b
last = b""
for key, value in items.items():
    last = key.encode()
    s.sendall(b"\x01" + field(last) + field(base64.b64decode(value)))
s.sendall(b"\x03" + field(last))
n = struct.unpack("<Q", s.recv(8))[0]
got = b""
while len(got) < n:
    got += s.recv(n - len(got))
print("wrote", len(items))
"""


def skip_reason() -> str | None:
    """Why this machine cannot act as another user here (None: it can)."""
    if os.geteuid() != 0:
        return "acting as another user needs root (runuser -u nobody)"
    if shutil.which("runuser") is None or not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"acting as another user needs runuser and {SYSTEM_PYTHON}"
    return None


def write(port: int, items: dict[str, bytes]) -> None:
    """Set `items` in the store on 127.0.0.1:`port`, as user nobody."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="other-user-"))
    try:
        folder.chmod(0o755)  # nobody reads what it is to write, and the client
        (folder / "client.py").write_text(CLIENT)
        encoded = {k: base64.b64encode(v).decode() for k, v in items.items()}
        (folder / "items.json").write_text(json.dumps(encoded))
        for name in ("client.py", "items.json"):
            (folder / name).chmod(0o644)
        done = subprocess.run(
            ["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, str(folder / "client.py"),
             str(port), str(folder / "items.json")],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# Opens each path as the other user would: a file for reading and appending, a directory's
# listing; prints {path: "ok" or the error's type}.
PROBE = r"""
import json, os, sys
found = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path) or path.endswith("/"):
            os.listdir(path)
        else:
            open(path, "ab").close()
            open(path, "rb").close()
        found[path] = "ok"
    except OSError as exc:
        found[path] = type(exc).__name__
print(json.dumps(found))
"""


def try_to_reach(paths: list[str]) -> dict[str, str]:
    """What user nobody gets opening each of `paths` ("ok", or the error's type name)."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run(
        ["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-c", PROBE, *paths],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found: dict[str, str] = json.loads(done.stdout)
    return found
