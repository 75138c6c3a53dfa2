"""The wire format on its own: tensor subclasses, shared views, refusals and what they say."""

from __future__ import annotations

import collections
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankwise import _collectives, _wire


@pytest.fixture
def one_rank_mesh(tmp_path: Path) -> Iterator[Any]:
    """A one-rank gloo group and a CPU device mesh over it, torn down afterwards."""
    from torch.distributed.device_mesh import init_device_mesh

    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _round_trip(value: Any) -> Any:
    return _wire.decode(_wire.encode(value, "test"))


@pytest.mark.unit
def test_a_dtensor_travels_as_torch_save_carries_it(one_rank_mesh: Any) -> None:
    """Regression: reading a wrapper subclass's storage address raised, and every value
    holding a DTensor (an FSDP2 state dict) was refused."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    sharded = distribute_tensor(torch.arange(8.0), one_rank_mesh, [Shard(0)])
    replicated = distribute_tensor(torch.ones(2, 3), one_rank_mesh, [Replicate()])
    state = collections.OrderedDict(w=sharded, b=replicated, plain=torch.arange(4)[1:3])
    back = _round_trip(state)
    assert type(back) is collections.OrderedDict and list(back) == ["w", "b", "plain"]
    assert isinstance(back["w"], DTensor) and back["w"].placements == (Shard(0),)
    assert torch.equal(back["w"].to_local(), torch.arange(8.0))
    assert torch.equal(back["b"].full_tensor(), torch.ones(2, 3))
    assert torch.equal(back["plain"], torch.tensor([1, 2]))


@pytest.mark.unit
def test_overlapping_views_of_part_of_a_storage_arrive_sharing_one_storage() -> None:
    """README: views that overlap share their storage on arrival. They arrived as separate
    copies when only part of the storage was sent."""
    base = torch.arange(10_000.0)
    first, second = base[100:200], base[150:260]
    data = _wire.encode({"a": first, "b": second}, "test")
    assert len(data) < 8 * 1024, len(data)  # not the 40 kB storage
    back = _wire.decode(data)
    assert torch.equal(back["a"], first) and torch.equal(back["b"], second)
    assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()
    back["a"][60] = -1.0  # element 160 of the base, in both views
    assert back["b"][10] == -1.0


@pytest.mark.unit
def test_strided_views_over_one_storage_keep_their_values() -> None:
    base = torch.arange(4096, dtype=torch.float64)
    strided = base[2000:2100:7]
    column = base.reshape(64, 64)[10:12, 3]
    back = _round_trip([strided, column, base[5:5]])
    assert torch.equal(back[0], strided) and torch.equal(back[1], column)
    assert back[2].shape == (0,)


@pytest.mark.unit
def test_the_senders_check_loads_no_tensor_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that a value loads back with weights_only must not build a second copy of
    every tensor on the sender (it doubled the sender's memory for a large state)."""
    loaded: list[Any] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        loaded.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    _wire.encode({"w": torch.ones(1024)}, "test")
    assert loaded == ["meta"], loaded


@pytest.mark.unit
def test_the_senders_check_still_refuses_what_would_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return (marker.touch, ())

    with pytest.raises(_wire.WireError, match="does not load back"):
        _wire.encode({"x": Payload()}, "test")
    assert not marker.exists()


def _like_modelopts_recipe() -> dict[str, Any]:
    """The shape of what modelopt's auto-quantize search syncs across its groups: the
    chosen recipe's format (a dict holding a defaultdict(dict)), its candidate stats
    (defaultdict(dict)), beside the other containers a caller's value may hold."""
    fmt: collections.defaultdict[str, dict[str, Any]] = collections.defaultdict(dict)
    fmt["*weight_quantizer"] = {"num_bits": 8, "axis": 0}
    stats: collections.defaultdict[str, dict[str, Any]] = collections.defaultdict(dict)
    stats["layer.0"]["costs"] = [1.5, 2.0]
    return {
        "recipe": {"format": fmt, "name": "int8"},
        "candidate_stats": stats,
        "order": collections.OrderedDict(b=1, a=2),
        "counts": collections.Counter("aab"),
        "recent": collections.deque([1, 2, 3], maxlen=5),
        "sets": collections.defaultdict(set, {"x": {1}}),
        "none": collections.defaultdict(None, {"k": 1}),
        "scale": torch.ones(2),
    }


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same container types (and factories, maxlens) all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, collections.defaultdict) and a.default_factory is not b.default_factory:
        return False
    if isinstance(a, collections.deque) and a.maxlen != b.maxlen:
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple, collections.deque)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.unit
def test_modelopts_containers_travel_as_themselves() -> None:
    """get_dist_syncd_obj refused what modelopt's auto-quantize syncs (a defaultdict(dict)
    in its recipe's format): defaultdicts of a builtin type or None, OrderedDict, Counter
    and deque travel as data and arrive as the same types."""
    value = _like_modelopts_recipe()
    back = _wire.decode(_wire.encode(value, "get_dist_syncd_obj"))
    assert _same(back, value), back
    assert back["recipe"]["format"]["new key"] == {}  # still a defaultdict of dict


@pytest.mark.unit
def test_a_defaultdict_of_another_factory_is_refused_saying_what_to_send() -> None:
    counts: collections.defaultdict[str, list[int]] = collections.defaultdict(lambda: [0])
    counts["a"].append(1)
    with pytest.raises(_wire.WireError) as refused:
        _wire.encode({"counts": counts, "t": torch.ones(1)}, "all_reduce('x') on rank 0")
    said = str(refused.value)
    assert "all_reduce('x') on rank 0" in said and "default_factory" in said, said
    assert "dict, list, set, int, float, str, tuple or None" in said, said


@pytest.mark.unit
def test_a_forged_payload_naming_another_factory_is_refused_and_runs_nothing(
    tmp_path: Path,
) -> None:
    """A payload written by hand (not by encode) that names any other factory, a function
    that would touch a file if it were called, is refused on arrival; nothing is called."""
    marker = tmp_path / "ran"
    for factory in ("pathlib.Path.touch", "os.system", "builtins.eval"):
        forged = io.BytesIO()
        torch.save({"x": _wire.Carried("defaultdict", factory, [["k", str(marker)]])}, forged)
        data = _wire.CARRIED + forged.getvalue()
        with pytest.raises(_wire.WireError, match="not one the wire carries"):
            _wire.decode(data)
    assert not marker.exists()


@pytest.mark.unit
def test_a_json_payload_that_does_not_parse_is_not_called_a_torch_load_refusal() -> None:
    with pytest.raises(RuntimeError) as refused:
        _collectives.load(b"J{not json", "all_reduce('x'): rank 1's value")
    said = str(refused.value)
    assert "rank 1's value" in said and "JSON" in said, said
    assert "torch.load" not in said and "weights_only" not in said, said
    assert _collectives.load(b"J" + json.dumps([1]).encode(), "x") == [1]


@pytest.mark.unit
def test_a_torch_save_payload_still_says_it_was_refused() -> None:
    buffer = io.BytesIO()
    torch.save({"t": torch.ones(1)}, buffer)
    assert torch.equal(_collectives.load(buffer.getvalue(), "x")["t"], torch.ones(1))
    with pytest.raises(RuntimeError, match="weights_only"):
        _collectives.load(b"PK-not-a-zip", "all_reduce('x'): rank 1's value")


@pytest.mark.ranks(2, 4)
def test_get_dist_syncd_obj_carries_what_modelopts_search_syncs(rank: int, world_size: int) -> None:
    import rankwise as rw

    mine = _like_modelopts_recipe()
    mine["candidate_stats"][f"rank{rank}"]["score"] = rank
    everyone = rw.DistributedProcessGroup.get_dist_syncd_obj(
        mine, rw.DistributedProcessGroup(None), lambda values: values
    )
    assert len(everyone) == world_size
    for r, theirs in enumerate(everyone):
        assert type(theirs["candidate_stats"]) is collections.defaultdict
        assert theirs["candidate_stats"][f"rank{r}"]["score"] == r
        assert _same(theirs["recipe"], mine["recipe"])


@pytest.mark.unit
@pytest.mark.parametrize(
    "values",
    [
        [1, -3, 2.5e-07, True, None, 0],
        [float("nan"), float("-inf"), float("inf")],
        [1, "a,b", [1, 2], {"k": None}],  # not all scalars: each decoded on its own
        [7],
    ],
)
def test_decoding_many_is_decoding_each(values: list[Any]) -> None:
    blobs = [_wire.encode(v, "x") for v in values]
    got = _wire.decode_many(blobs)
    expected = [_wire.decode(b) for b in blobs]
    assert repr(got) == repr(expected)  # nan compares unequal to itself; its repr does not


@pytest.mark.unit
@pytest.mark.parametrize(
    "blobs",
    [
        [b"J1\nJ2", b"J3"],  # two values in one blob: caught, not read as three
        [b"J1,2", b"J3"],
        [b"J[1", b"J2]"],
        [b"J", b"J1"],
    ],
)
def test_decoding_many_refuses_what_decoding_each_refuses(blobs: list[bytes]) -> None:
    with pytest.raises(ValueError):
        _wire.decode(blobs[0])
    with pytest.raises(ValueError):
        _wire.decode_many(blobs)
