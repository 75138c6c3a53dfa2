"""A record of the collectives a process issues: op, group (and mesh dimension), bytes.

Recorded by a torch dispatch mode, which sees every collective whatever issues it: the
``torch.distributed`` calls (c10d's ops), DTensor's and FSDP2's (functional collectives),
each with its process group. On a fake world nothing moves, so this is how a test asserts on
the traffic a plan would make at scale ("an FSDP2 step makes 4 all-gathers of 2 MiB").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# c10d's op names (both the torch.distributed calls and the functional collectives) as
# torch.distributed names them; an op not listed keeps its own name.
_NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "all_gather_into_tensor_out": "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall_base_": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}
_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_"}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank issued it.

    ``op`` is torch.distributed's name ("all_gather_into_tensor", "all_reduce", ...);
    ``ranks`` the group's global ranks; ``mesh_dim`` the mesh dimension whose group it ran
    on (None for another group); ``bytes_in`` what this rank contributed and ``bytes_out``
    what it receives (an all-gather's output is the group's size times its input).
    """

    op: str
    ranks: tuple[int, ...]
    mesh_dim: str | None
    bytes_in: int
    bytes_out: int


class CollectiveLog(list[CollectiveRecord]):
    """The records in issue order, with counts and sums for assertions."""

    def of(self, op: str | None = None, mesh_dim: str | None = None) -> list[CollectiveRecord]:
        """The records of `op` (every op if None) on `mesh_dim` (any group if None)."""
        return [
            r
            for r in self
            if (op is None or r.op == op) and (mesh_dim is None or r.mesh_dim == mesh_dim)
        ]

    def count(self, op: str | None = None, mesh_dim: str | None = None) -> int:  # type: ignore[override]
        return len(self.of(op, mesh_dim))

    def bytes_out(self, op: str | None = None, mesh_dim: str | None = None) -> int:
        return sum(r.bytes_out for r in self.of(op, mesh_dim))

    def bytes_in(self, op: str | None = None, mesh_dim: str | None = None) -> int:
        return sum(r.bytes_in for r in self.of(op, mesh_dim))


def recording(mesh_dims: Callable[[str], str | None]) -> Any:
    """A dispatch mode that appends a CollectiveRecord to its ``log`` for each collective;
    `mesh_dims` names the mesh dimension of a group name (None for none)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    base: Any = TorchDispatchMode  # untyped in torch

    class _Recorder(base):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.log = CollectiveLog()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.namespace in _NAMESPACES:
                record = _record_of(func, args, kwargs or {}, out, mesh_dims, torch)
                if record is not None:
                    self.log.append(record)
            return out

    return _Recorder()


def _record_of(
    func: Any,
    args: Any,
    kwargs: dict[str, Any],
    out: Any,
    mesh_dims: Callable[[str], str | None],
    torch: Any,
) -> CollectiveRecord | None:
    name = func._schema.name.split("::")[-1]
    if name in _NOT_COLLECTIVES:
        return None
    bound = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    group = _group_of(bound, torch)
    if group is None:
        return None
    bytes_in = sum(
        _bytes(v) for k, v in bound.items() if "input" in k or k in ("tensor", "tensors")
    )
    outputs = [v for k, v in bound.items() if "output" in k or k in ("tensor", "tensors")]
    if func.namespace == "_c10d_functional":
        outputs = [out]
    import torch.distributed as dist

    return CollectiveRecord(
        _NAMES.get(name, name),
        tuple(dist.get_process_group_ranks(group)),
        mesh_dims(group.group_name),
        bytes_in,
        sum(_bytes(v) for v in outputs),
    )


def _group_of(bound: dict[str, Any], torch: Any) -> Any:
    """The process group a c10d op ran on (a boxed ProcessGroup, or a group's name)."""
    c10d = torch._C._distributed_c10d
    name = bound.get("group_name")
    if isinstance(name, str):
        return c10d._resolve_process_group(name)
    boxed = bound.get("process_group")
    if boxed is None:
        return None
    return boxed if isinstance(boxed, c10d.ProcessGroup) else c10d.ProcessGroup.unbox(boxed)


def _bytes(value: Any) -> int:
    """The bytes of the tensors in `value` (a tensor, or nested lists of them)."""
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    element_size = getattr(value, "element_size", None)
    return int(value.numel() * element_size()) if element_size is not None else 0
