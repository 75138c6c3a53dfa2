"""Is this pytest process one rank of a job another launcher (torchrun) started?

Imports no torch (``auto_backend`` does, called for a detected launch only): the plugin
asks at configure time, before any test needs ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Set in every harness rank worker: a pytest run inside a test's rank is not a launch, even
# when the test gave it torchrun's variables (launch=True).
IN_RANK_WORKER = "HARNESS_RANK_WORKER"
# "0" turns detection off: a process with torchrun's variables that must run as plain pytest.
LAUNCHED_SWITCH = "HARNESS_LAUNCHED"


class LaunchError(Exception):
    """torchrun's variables are there but do not describe a rank: names the fix."""


@dataclass(frozen=True)
class Launch:
    """This process's place in the launched job, from torchrun's environment."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # the launcher's agent hosts the store; every rank is a client
    run_key: str  # the run id and restart count: store keys of one attempt of one job


def detect(environ: Mapping[str, str] = os.environ) -> Launch | None:
    """The launch this process is a rank of, or None for a plain pytest session.

    A launch is WORLD_SIZE > 1 with RANK and LOCAL_RANK set, outside a harness worker.
    """
    if environ.get(IN_RANK_WORKER) or environ.get(LAUNCHED_SWITCH) == "0":
        return None
    if not {"WORLD_SIZE", "RANK", "LOCAL_RANK"} <= set(environ):
        return None
    world = _int(environ, "WORLD_SIZE")
    if world <= 1:
        return None
    rank, local = _int(environ, "RANK"), _int(environ, "LOCAL_RANK")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is not a rank of WORLD_SIZE={world}: {_FIX}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name):
            raise LaunchError(f"{name} is not set (RANK={rank}, WORLD_SIZE={world}): {_FIX}")
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return Launch(
        world_size=world,
        rank=rank,
        local_rank=local,
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", world),
        master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT"),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        run_key=f"{run_id}/{restart}",
    )


_FIX = (
    "start pytest with torchrun (torchrun --nproc-per-node N -m pytest ...), or set "
    f"{LAUNCHED_SWITCH}=0 to run it as a plain session"
)


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(str(text))
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer: {_FIX}") from None


def auto_backend(launch: Launch) -> str:
    """nccl where this rank has its GPU (cuda:LOCAL_RANK, or the one GPU the launcher made
    visible to it), gloo otherwise. Imports torch: called only for a detected launch."""
    import torch

    if not torch.cuda.is_available():
        return "gloo"
    count = torch.cuda.device_count()
    return "nccl" if count > launch.local_rank or count == 1 else "gloo"
