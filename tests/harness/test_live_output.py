"""A run's output files without processes: a test plays the rank, writing to the file as a
rank does (appending), and checks what is echoed, what stays on disk and what the report
keeps."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from harness.common.protocol import OUTPUT_LIMIT, RankFiles
from harness.warm import live_output
from harness.warm.live_output import LiveStreams, RunOutput

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


@pytest.fixture
def files(tmp_path: Path) -> RankFiles:
    found = RankFiles.in_dir(tmp_path, 0)
    found.stdout.write_bytes(b"")
    found.stderr.write_bytes(b"")
    return found


def _write(files: RankFiles, data: bytes) -> None:
    with open(files.stdout, "ab") as out:  # as the rank writes: appended, wherever the end is
        out.write(data)


def test_a_cut_file_keeps_its_head_and_tail_and_counts_what_was_cut_exactly(
    files: RankFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_output, "FILE_LIMIT", 1024 * 1024)
    output = RunOutput([(0, files)], None)
    written = 0
    for n in range(40):  # 40 chunks of 100 KiB, the files bounded between them
        chunk = (f"chunk {n} ".encode() + b"." * 102400)[:102400]
        _write(files, chunk)
        written += len(chunk)
        output.drain()
        assert files.stdout.stat().st_size <= 1024 * 1024 + 102400
    text = output.report(files.stdout)
    head, cut_line, tail = text.split("\n", 2)
    assert head.startswith("chunk 0 ") and len(head) == live_output.HEAD_KEPT
    cut = int(cut_line.removeprefix("[... ").removesuffix(" bytes cut ...]"))
    assert len(tail) == OUTPUT_LIMIT and tail.endswith(".")
    assert len(head) + cut + len(tail) == written


def test_the_echo_reads_in_chunks_and_shows_a_long_line_capped(
    files: RankFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_output, "CHUNK", 1000)
    streams = LiveStreams(io.StringIO(), io.StringIO())
    output = RunOutput([(0, files)], streams)
    _write(files, b"short\n" + b"L" * (live_output.LINE_LIMIT * 3) + b"\nafter\n")
    output.drain()
    assert streams.out.getvalue() == "\n[rank 0] short\n"  # one chunk read: the rest waits
    for _ in range(100):
        output.drain()
    shown = streams.out.getvalue().splitlines()
    assert shown[2] == "[rank 0] " + "L" * live_output.LINE_LIMIT + (
        " [... the rest of this line is not shown]"
    )
    assert shown[3:] == ["[rank 0] after"]
    output.drain(final=True)
    assert streams.out.getvalue().splitlines()[-1] == (
        f"[rank 0] [... {live_output.LINE_LIMIT * 2} bytes not shown here; the report has the end]"
    )


def test_output_within_the_limits_is_echoed_and_reported_whole(files: RankFiles) -> None:
    streams = LiveStreams(io.StringIO(), io.StringIO())
    output = RunOutput([(0, files)], streams)
    _write(files, b"one\ntwo")
    output.drain()
    output.drain(final=True)
    assert streams.out.getvalue() == "\n[rank 0] one\n[rank 0] two\n"
    assert output.report(files.stdout) == "one\ntwo"
