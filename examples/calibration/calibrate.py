"""Calibrate a tiny causal LM on every rank's own data: the job `make demo` runs.

Per-layer activation absolute maxima (the input amax of every Linear) are collected on each
rank's data shard, combined across ranks with rankwise's all_reduce and an element-wise max,
and written once by the main rank. Run it:

    torchrun --standalone --nproc-per-node 4 examples/calibration/calibrate.py \\
        --settings settings.json --out out/calibration.pt          # CPU, gloo
    torchrun --nproc-per-node 8 examples/calibration/calibrate.py --device cuda ...  # GPUs

On CPU the script sets its gloo group up itself (distributed_run binds CUDA on a launch);
on GPUs it runs inside rankwise.distributed_run on NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import rankwise as rw
import torch
import torch.distributed as dist
import torch.nn as nn

Loader = Callable[[dict[str, Any], int, int], Iterator[torch.Tensor]]
DEFAULT_SETTINGS = {"batches_per_rank": 8, "batch": 4, "seq_len": 16, "seed": 0, "vocab": 256}


def build_model(settings: dict[str, Any]) -> nn.Module:
    """The same tiny Llama on every rank (seeded), built from a config: nothing is downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(settings["seed"])
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=settings["vocab"],
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def synthetic_batch(settings: dict[str, Any], index: int) -> torch.Tensor:
    """Batch `index` of the whole dataset: deterministic, so any split sees the same data."""
    generator = torch.Generator().manual_seed(settings["seed"] * 100_003 + index)
    return torch.randint(
        0, settings["vocab"], (settings["batch"], settings["seq_len"]), generator=generator
    )


def shard_loader(settings: dict[str, Any], rank: int, world: int) -> Iterator[torch.Tensor]:
    """This rank's shard: batches rank, rank + world, rank + 2 * world, ..."""
    for step in range(settings["batches_per_rank"]):
        yield synthetic_batch(settings, step * world + rank)


class AmaxObserver:
    """Forward hooks that keep the running input absolute maximum of every Linear."""

    def __init__(self, model: nn.Module) -> None:
        self.amax: dict[str, torch.Tensor] = {}
        self._hooks = [
            module.register_forward_hook(self._hook(name))
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def observe(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
            current = inputs[0].detach().abs().amax().float().cpu()
            self.amax[name] = (
                torch.maximum(self.amax[name], current) if name in self.amax else current
            )

        return observe

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def elementwise_max(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.stack([d[name] for d in per_rank]).amax(0) for name in per_rank[0]}


def calibrate_single_process(settings: dict[str, Any], world: int) -> dict[str, torch.Tensor]:
    """The reference: one process over the whole dataset `world` ranks would share."""
    settings = {**DEFAULT_SETTINGS, **settings}
    model = build_model(settings)
    observer = AmaxObserver(model)
    with torch.no_grad():
        for index in range(settings["batches_per_rank"] * world):
            model(input_ids=synthetic_batch(settings, index))
    observer.close()
    return observer.amax


def run_calibration(
    state: rw.DistributedState,
    settings_path: Path,
    out_path: Path,
    loader: Loader = shard_loader,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Calibrate on this rank's shard; every rank returns the combined maxima."""
    settings = rw.broadcast_from("run_settings", lambda: _read_settings(settings_path))
    model = build_model(settings)
    rw.set_distribution_plan(model, rw.DistributionPlan(world_size=state.world_size, dense="fsdp"))
    model.to(state.device)
    if state.world_size > 1:
        rw.fsdp2_wrap(model)
    observer = AmaxObserver(model)
    shard = loader(settings, state.rank, state.world_size)
    started, batches = time.perf_counter(), 0
    bar = _ProgressBar(settings["batches_per_rank"], enabled=progress and state.is_main)
    with torch.no_grad():
        for _ in range(settings["batches_per_rank"]):
            # Every rank fetches inside one labelled collective: a loader that fails on any
            # rank stops every rank here, with its cause, before anyone waits in the forward.
            ids = rw.all_reduce(
                "load_batch", lambda: next(shard), lambda all_ids: all_ids[state.rank]
            )
            model(input_ids=ids.to(state.device))
            batches += 1
            bar.update(batches)
    bar.close()
    observer.close()
    combined = rw.all_reduce("amax", lambda: observer.amax, elementwise_max)
    mine = {"rank": state.rank, "batches": batches, "seconds": time.perf_counter() - started}
    ranks = [s for s in rw.gather_state_dicts(mine, dst=0)]  # every rank joins; rank 0 gets all
    if state.is_main:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"amax": combined, "ranks": ranks, "settings": settings}, out_path)
        _print_summary(ranks, combined, out_path)
    return combined


def _read_settings(path: Path) -> dict[str, Any]:
    settings = {**DEFAULT_SETTINGS, **json.loads(path.read_text())}
    for key in ("batches_per_rank", "batch", "seq_len", "vocab"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise ValueError(f"{path}: {key} must be a positive int; got {settings[key]!r}")
    return settings


class _ProgressBar:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.started = total, enabled, time.perf_counter()

    def update(self, done: int) -> None:
        if self.enabled:
            filled = int(30 * done / self.total)
            rate = done / max(time.perf_counter() - self.started, 1e-9)
            print(
                f"\rcalibrating [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} "
                f"batches ({rate:.1f}/s)",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def _print_summary(ranks: list[dict[str, Any]], amax: dict[str, torch.Tensor], out: Path) -> None:
    print(f"calibrated {len(amax)} Linear layers on {len(ranks)} rank(s):")
    for entry in ranks:
        print(f"  rank {entry['rank']}: {entry['batches']} batches in {entry['seconds']:.2f} s")
    top = max(amax, key=lambda name: float(amax[name]))
    print(f"  largest input amax: {float(amax[top]):.3f} at {top}")
    print(f"wrote {out}")


@contextlib.contextmanager
def cpu_run() -> Iterator[rw.DistributedState]:
    """A gloo group for a CPU launch (distributed_run binds CUDA on a launch), or the caller's."""
    owned = not dist.is_initialized() and rw.is_distributed_launch()
    if owned:
        dist.init_process_group("gloo")
    try:
        yield rw.DistributedState(rank=rw.rank(), world_size=rw.size(), device=torch.device("cpu"))
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings", type=Path, required=True, help="JSON run settings (rank 0 reads it)"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="where rank 0 writes the calibration"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--fail-rank", type=int, default=None, help="demo: this rank's loader fails"
    )
    args = parser.parse_args(argv)
    loader = shard_loader if args.fail_rank is None else _failing_loader(args.fail_rank)
    run = cpu_run() if args.device == "cpu" else rw.distributed_run()
    with run as state:
        run_calibration(state, args.settings, args.out, loader=loader)
    return 0


def _failing_loader(bad_rank: int) -> Loader:
    def loader(settings: dict[str, Any], rank: int, world: int) -> Iterator[torch.Tensor]:
        for step, batch in enumerate(shard_loader(settings, rank, world)):
            if rank == bad_rank and step == 2:
                raise OSError(f"shard {rank}: batch {step} is unreadable (demo failure)")
            yield batch

    return loader


if __name__ == "__main__":
    sys.exit(main())
