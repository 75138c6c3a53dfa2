"""`make demo`: the main job, end to end, on this machine's CPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    print("== rankwise demo: multi-rank tests on 4 real ranks (gloo, CPU) ==", flush=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "harness",
        "--ranks",
        "4",
        "-v",
        "-p",
        "no:cacheprovider",
        str(ROOT / "examples" / "quickstart"),
    ]
    return subprocess.call(command, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
