"""What launched ranks read from torchrun's store is data: checked field by field, never
unpickled (a value there ran code as the test's user: anything reaching the store wrote it)."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.common.outcome import Ending, RankOutcome, RankWarning
from harness.launched import records

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


def _full_outcome(value: Any) -> RankOutcome:
    return RankOutcome(
        "t3",
        1,
        4242,
        Ending.RAISED,
        at=12.5,
        value_blob=pickle.dumps(value),
        exc_type="builtins.ValueError",
        exc_mro=("ValueError", "Exception"),
        message="bad",
        traceback="Traceback ...",
        exit_code=3,
        notes=("a note",),
        leftovers={"env": "changed FOO"},
        warnings=(RankWarning("builtins.UserWarning", "careful", "t.py", 7),),
        skipped_at=("t.py", 9),
        origin_rank=0,
        replace_after="left a thread",
        setup_attempts=2,
    )


@pytest.mark.parametrize(
    "value",
    [None, {"lr": 0.1, "steps": [1, 2]}, (1, 2), torch.arange(3.0)],
    ids=["none", "json", "tuple", "tensor"],
)
def test_an_outcome_travels_as_json_and_comes_back_whole(value: Any) -> None:
    sent = _full_outcome(value)
    got = records.decode_outcome(records.encode_outcome(sent).encode(), "t3", 1)
    for name in ("ending", "at", "pid", "exc_mro", "notes", "leftovers", "warnings"):
        assert getattr(got, name) == getattr(sent, name), name
    assert got.skipped_at == sent.skipped_at and got.origin_rank == 0
    assert got.replace_after == sent.replace_after and got.setup_attempts == 2
    assert got.exit_code == 3 and not got.value_lost
    if isinstance(value, torch.Tensor):
        assert torch.equal(got.value, value)
    else:
        assert got.value == value


def test_a_plain_pass_travels_as_its_five_fields_and_comes_back_equal() -> None:
    """Every rank reads every peer's record after every test: a field at its default is
    left out (and read back as that default); pid and ending, which have none, never are."""
    sent = RankOutcome("t3", 1, 4242, Ending.RETURNED, at=12.5)
    record = json.loads(records.encode_outcome(sent))
    assert record["fields"] == {
        "key": "t3",
        "rank": 1,
        "pid": 4242,
        "ending": "returned",
        "at": 12.5,
    }
    assert records.decode_outcome(records.encode_outcome(sent).encode(), "t3", 1) == sent
    for required in ("pid", "ending"):
        del_one = {**record, "fields": {k: v for k, v in record["fields"].items() if k != required}}
        with pytest.raises(records.RecordError, match=f"field '{required}' is missing"):
            records.decode_outcome(json.dumps(del_one).encode(), "t3", 1)


class _Opaque:
    pass


def test_a_value_that_would_need_pickle_is_reported_not_sent() -> None:
    got = records.decode_outcome(records.encode_outcome(_full_outcome(_Opaque())).encode(), "t3", 1)
    assert got.value_blob is None and "never pickled" in got.value_lost


class _NoLoadBack:
    """Pickles, but its pickle does not load: __reduce__ leaves out what __init__ needs."""

    def __init__(self, needed: int) -> None:
        self.needed = needed

    def __reduce__(self) -> Any:
        return (_NoLoadBack, ())


def test_a_value_whose_pickle_does_not_load_back_is_reported_not_a_crash() -> None:
    """Its rank's outcome still travels (its peers would wait for it otherwise), saying why
    the value did not."""
    blob = records.encode_outcome(_full_outcome(_NoLoadBack(1))).encode()
    got = records.decode_outcome(blob, "t3", 1)
    assert got.value_blob is None and got.ending is Ending.RAISED
    assert "does not load back" in got.value_lost and "TypeError" in got.value_lost


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (self.marker.touch, ())


def test_a_pickle_in_the_store_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    forged = pickle.dumps(_full_outcome(None)) + pickle.dumps(_Payload(marker))
    for blob in (forged, pickle.dumps(_Payload(marker))):
        with pytest.raises(records.RecordError, match="not JSON"):
            records.decode_outcome(blob, "t3", 1)
        with pytest.raises(records.RecordError, match="'exit/1' is not JSON"):
            records.read_json(blob, "exit/1", {"text": str, "code": int})
    assert not marker.exists()


def _record(**changes: Any) -> bytes:
    record = json.loads(records.encode_outcome(_full_outcome(None)))
    record["fields"].update(changes)
    return json.dumps(record).encode()


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"ending": "exploded"}, "field 'ending' is 'exploded'"),
        ({"exit_code": "3"}, "field 'exit_code' is of type str"),
        ({"notes": [1]}, "field 'notes' is of type int"),
        ({"skipped_at": ["t.py"]}, "field 'skipped_at' is not \\(file, line\\)"),
        ({"rank": 0}, "it says it is rank 0's"),
        ({"rank": True}, "it says it is rank True's"),  # JSON's true is no rank 1
        ({"rank": 1.0}, "it says it is rank 1.0's"),
        ({"setup_failed": 1}, "field 'setup_failed' is of type int"),
    ],
)
def test_a_record_of_another_shape_is_refused_naming_what(
    changes: dict[str, Any], said: str
) -> None:
    with pytest.raises(records.RecordError, match=said):
        records.decode_outcome(_record(**changes), "t3", 1)


def test_a_forged_torch_value_must_load_with_weights_only(tmp_path: Path) -> None:
    import base64
    import io

    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"x": _Payload(marker)}, buffer)
    record = json.loads(records.encode_outcome(_full_outcome(None)))
    record["value"] = {"wire": base64.b64encode(buffer.getvalue()).decode()}
    with pytest.raises(records.RecordError, match="does not load with weights_only"):
        records.decode_outcome(json.dumps(record).encode(), "t3", 1)
    assert not marker.exists()


@pytest.mark.parametrize(
    "value",
    [
        {"wire": base64.b64encode(b"J{not json").decode()},
        {"wire": "not base64!"},
        {"wire": base64.b64encode(b"J" + b"[" * 100000 + b"]" * 100000).decode()},
    ],
    ids=["json", "base64", "deep"],
)
def test_a_malformed_value_is_a_record_error_not_a_crash(value: dict[str, str]) -> None:
    record = json.loads(records.encode_outcome(_full_outcome(None)))
    record["value"] = value
    with pytest.raises(records.RecordError):
        records.decode_outcome(json.dumps(record).encode(), "t3", 1)


def test_a_deeply_nested_record_is_a_record_error() -> None:
    with pytest.raises(records.RecordError):
        records.decode_outcome(b"[" * 100000 + b"]" * 100000, "t3", 1)
    with pytest.raises(records.RecordError):
        records.read_json(b"[" * 100000 + b"]" * 100000, "exit/1", {"text": str})


def test_read_json_wants_every_field_and_strings_where_strings_are_kept() -> None:
    with pytest.raises(records.RecordError, match="no 'xfail'"):
        records.read_json(b'{"outcome": "passed"}', "t1/plain/1", {"xfail": (str, type(None))})
    with pytest.raises(records.RecordError, match="not of strings"):
        records.read_json(
            b'{"tests": [1], "errors": []}', "collected/1", {"tests": list, "errors": list}
        )


def test_a_shared_tmp_path_from_the_store_must_be_this_users_private_directory(
    tmp_path: Path,
) -> None:
    from harness.launched.hooks import untrusted_directory

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert untrusted_directory(private) is None
    assert untrusted_directory(tmp_path / "not-yet-there") is None  # another node's, maybe
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    assert "can be used by others" in (untrusted_directory(open_to_all) or "")
    link = tmp_path / "link"
    link.symlink_to(private)
    assert untrusted_directory(link) == "is not a directory"
    file = tmp_path / "file"
    file.write_text("x")
    assert untrusted_directory(file) == "is not a directory"
