"""The plugin installed changes nothing for tests that do not use it (``make test-neighbour``).

One suite of plain tests probes the process state a test sees (in its own process, and in
children of every start method it starts itself: multiprocessing's three contexts, a
``ProcessPoolExecutor`` on the forkserver, ``torch.multiprocessing.start_processes``, the
default context after ``set_start_method("forkserver")``). Each session below is a fresh
pytest process; every one must see exactly what the session without the plugin sees:
with the plugin, with a ranks test run before the probes, in the session after a ranks
session (pytest's cache says ranks were started), and under ``--rank-adopt torch`` beside a
project's own base it does not claim (children from Python's fork server, the environment
its setUp set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.neighbour

PROBES = r'''
import concurrent.futures, faulthandler, json, logging, multiprocessing, os, resource, signal
import sys, tempfile, threading, warnings
import pytest
import torch

OUT = os.environ["PROBE_OUT"]
SIGNALS = ("SIGTERM", "SIGHUP", "SIGINT", "SIGUSR1", "SIGCHLD", "SIGPIPE")
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_NPROC")


def _handler(signum):
    found = signal.getsignal(signum)
    if found in (signal.SIG_DFL, signal.SIG_IGN, None):
        return str(found)
    return getattr(found, "__qualname__", type(found).__name__)


def state(test_pgrp):
    """What a process sees: the same function in the test's process and in its children."""
    umask = os.umask(0o022)
    os.umask(umask)
    return {
        "env": os.environ.get("PROBE_VAR"),
        "env_keys": sorted(k for k in os.environ if k not in ("PYTEST_CURRENT_TEST",)),
        "signals": {name: _handler(getattr(signal, name)) for name in SIGNALS},
        "test_group": os.getpgrp() == test_pgrp,
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "modules": sorted({m.split(".")[0] for m in sys.modules}),
        "threads": sorted(t.name for t in threading.enumerate()),
        "cwd": os.path.basename(os.getcwd()),
        "tmp": tempfile.gettempdir(),
        "faulthandler": faulthandler.is_enabled(),
        "umask": umask,
        "limits": {n: resource.getrlimit(getattr(resource, n)) for n in LIMITS},
    }


def child(path, test_pgrp):
    with open(path, "w") as f:
        json.dump(state(test_pgrp), f)


def in_pool(test_pgrp):
    return state(test_pgrp)


def for_torch(index, path, test_pgrp):
    child(path, test_pgrp)


def _record(name, value):
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)


def _run(ctx, name, tmp_path):
    path = tmp_path / "child.json"
    process = ctx.Process(target=child, args=(str(path), os.getpgrp()))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    _record(name, json.loads(path.read_text()))


def test_0_the_test_process(monkeypatch):
    monkeypatch.setenv("PROBE_VAR", "set-in-test")
    found = state(os.getpgrp())  # its modules: the session's own (pytest's plugins), not compared
    found["warnings"] = [(f[0], str(getattr(f[1], "pattern", f[1])), f[2].__name__,
                          str(getattr(f[3], "pattern", f[3])), f[4]) for f in warnings.filters]
    root = logging.getLogger()
    found["logging"] = (root.level, sorted(type(h).__name__ for h in root.handlers))
    # a fresh process's seed is random (64 bits); one set by someone is a small number
    found["torch"] = (torch.get_num_threads(), torch.initial_seed() < 2**32)
    _record("test-process", found)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_1_children_of_each_start_method(monkeypatch, tmp_path, method):
    monkeypatch.setenv("PROBE_VAR", "set-in-test")
    _run(multiprocessing.get_context(method), f"child-{method}", tmp_path)


def test_2_a_process_pool_on_the_forkserver(monkeypatch):
    monkeypatch.setenv("PROBE_VAR", "set-in-test")
    ctx = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        _record("pool-forkserver", pool.submit(in_pool, os.getpgrp()).result(timeout=60))


def test_3_torch_start_processes_on_the_forkserver(monkeypatch, tmp_path):
    import torch.multiprocessing as tmp

    monkeypatch.setenv("PROBE_VAR", "set-in-test")
    path = tmp_path / "child.json"
    assert tmp.start_processes(for_torch, args=(str(path), os.getpgrp()), nprocs=1,
                               start_method="forkserver", join=True) is None
    _record("torch-forkserver", json.loads(path.read_text()))


def test_4_the_default_context_set_to_forkserver(monkeypatch, tmp_path):
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        monkeypatch.setenv("PROBE_VAR", "set-in-test")
        _run(multiprocessing, "default-forkserver", tmp_path)
    finally:
        multiprocessing.set_start_method(before, force=True)


def test_5_its_own_start_method_can_be_set():
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        multiprocessing.set_start_method("spawn")
        ok = multiprocessing.get_start_method()
    except RuntimeError as exc:
        ok = str(exc)
    finally:
        multiprocessing.set_start_method(before, force=True)
    _record("set-start-method", {"before": before, "after": ok})


def test_6_no_process_it_did_not_start():
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] not in "ZX":
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    children.append(f.read().replace(b"\0", b" ").decode()[:80])
    _record("children", sorted(children))
'''

RANKS = """
import pytest

@pytest.mark.ranks(2)
def test_on_ranks(rank):
    pass
"""

# A project's own base that --rank-adopt torch does not claim (as torchrec's): its children
# come from Python's fork server, with what its setUp set in the environment.
OWN_BASE = """
import multiprocessing, os, tempfile, unittest


def child(path):
    with open(path, "w") as f:
        f.write(os.environ.get("MASTER_ADDR", "unset"))


class TestOwnBase(unittest.TestCase):
    def setUp(self):
        os.environ["MASTER_ADDR"] = "127.0.0.1"

    def tearDown(self):
        os.environ.pop("MASTER_ADDR", None)

    def test_its_children_see_its_environment(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "seen")
            process = multiprocessing.get_context("forkserver").Process(target=child, args=(path,))
            process.start()
            process.join(60)
            self.assertEqual(process.exitcode, 0)
            with open(path) as f:
                self.assertEqual(f.read(), "127.0.0.1")
"""


def _session(directory: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One fresh pytest process in `directory`, its probes written below `out`."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    env["PROBE_OUT"] = str(out)
    env.pop("PROBE_VAR", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:xdist", *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _probed(out: Path) -> dict[str, Any]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def _project(root: Path, *files: tuple[str, str]) -> Path:
    root.mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\nrank_timeout = 60\n")
    (root / "test_probes.py").write_text(PROBES)
    for name, text in files:
        (root / name).write_text(text)
    return root


# Each session: the files beside the probes, pytest's arguments, and what ran before it. Its
# baseline is the same project without the plugin, the ranks tests deselected (their modules
# imported all the same).
SESSIONS = {
    "with the plugin": ((), ["-p", "harness"], None),
    "a ranks test beside": ((("test_a_ranks.py", RANKS),), ["-p", "harness"], None),
    "after a ranks session": ((), ["-p", "harness", "test_probes.py"], ("test_a_ranks.py", RANKS)),
    "under --rank-adopt": (
        (("test_a_own_base.py", OWN_BASE),),
        ["-p", "harness", "--rank-adopt", "torch"],
        None,
    ),
}
# No fork server running at the probes' time, where the session needs no ranks.
NO_RANKS = ("with the plugin", "after a ranks session")
# Tests that pass without the plugin (the ranks test is deselected there).
PASSED = {"with the plugin": 9, "a ranks test beside": 10, "after a ranks session": 9,
          "under --rank-adopt": 10}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_a_plain_test_sees_what_it_sees_without_the_plugin(tmp_path: Path, name: str) -> None:
    files, args, before = SESSIONS[name]
    base = _project(tmp_path / "baseline" / "project", *files)
    done = _session(base, tmp_path / "baseline" / "out", "-p", "no:harness", "-k", "not on_ranks")
    assert done.returncode == 0, done.stdout + done.stderr
    expected = _probed(tmp_path / "baseline" / "out")
    root = _project(tmp_path / "project", *files)
    if before is not None:
        (root / before[0]).write_text(before[1])
        done = _session(root, tmp_path / "before", "-p", "harness", before[0])
        assert done.returncode == 0, done.stdout + done.stderr
    done = _session(root, tmp_path / "out", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f" {PASSED[name]} passed" in done.stdout, done.stdout
    found = _probed(tmp_path / "out")
    if name not in NO_RANKS:  # its ranks' fork server is the session's child, rightly
        found.pop("children", None)
        expected.pop("children", None)
    assert sorted(found) == sorted(expected)
    for probes in (found, expected):  # a fork child is a copy of the session's process:
        parent = set(probes["test-process"].pop("modules"))  # what the plugin imported there
        probes["child-fork"]["modules"] = sorted(set(probes["child-fork"]["modules"]) - parent)
    differences = []
    for probe in expected:
        if not isinstance(expected[probe], dict):  # the session's children
            found[probe], expected[probe] = {"all": found[probe]}, {"all": expected[probe]}
        for key in expected[probe]:
            got, want = found[probe][key], expected[probe][key]
            if got == want:
                continue
            if isinstance(want, list) and isinstance(got, list):
                extra = sorted(set(map(str, got)) - set(map(str, want)))
                missing = sorted(set(map(str, want)) - set(map(str, got)))
                differences.append(f"{probe} {key}: extra {extra}, missing {missing}")
            else:
                differences.append(f"{probe} {key}: {got!r}, without the plugin {want!r}")
    assert not differences, "\n".join([name, *differences])
