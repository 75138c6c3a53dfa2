"""torchrun's environment for one rank, built in one place for launch mode and ``launch_env``.

Imports nothing but the standard library: ranks and the pytest process both use it.
"""

from __future__ import annotations

# What each variable tells the code under test, as torchrun (torch.distributed.run) sets it.
VARIABLES = {
    "WORLD_SIZE": "how many ranks the job has (init_process_group's env:// reads it)",
    "RANK": "this process's global rank (env://)",
    "LOCAL_RANK": "this process's rank on its node: the GPU index code picks",
    "LOCAL_WORLD_SIZE": "how many ranks run on this node",
    "GROUP_RANK": "this node's index among the nodes",
    "GROUP_WORLD_SIZE": "how many nodes the job has",
    "ROLE_NAME": "the worker role (torchrun has one, 'default')",
    "ROLE_RANK": "this process's rank among the workers of its role",
    "ROLE_WORLD_SIZE": "how many workers share its role",
    "MASTER_ADDR": "the host of the rendezvous store (env://)",
    "MASTER_PORT": "the port of the rendezvous store (env://)",
    "TORCHELASTIC_USE_AGENT_STORE": "'True' when the agent hosts the store and ranks are clients",
    "TORCHELASTIC_RESTART_COUNT": "how many times the job was restarted (a new attempt each)",
    "TORCHELASTIC_MAX_RESTARTS": "how many restarts the job allows",
    "TORCHELASTIC_RUN_ID": "the job's id; the store's keys are per run and attempt",
}


def torchrun_env(
    world_size: int,
    rank: int,
    *,
    master_addr: str,
    master_port: int,
    local_world_size: int | None = None,
    agent_store: bool = False,
    run_id: str = "none",
    restart_count: int = 0,
) -> dict[str, str]:
    """Every variable in :data:`VARIABLES` for `rank` of a launch of `world_size` processes.

    Nodes are `local_world_size` ranks each (default: one node). The caller checks its
    arguments: this builds what torchrun would set, nothing more.
    """
    local = local_world_size or world_size
    values: dict[str, object] = {
        "WORLD_SIZE": world_size,
        "RANK": rank,
        "LOCAL_RANK": rank % local,
        "LOCAL_WORLD_SIZE": local,
        "GROUP_RANK": rank // local,
        "GROUP_WORLD_SIZE": world_size // local,
        "ROLE_NAME": "default",
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world_size,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_USE_AGENT_STORE": agent_store,
        "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": 0,
        "TORCHELASTIC_RUN_ID": run_id,
    }
    return {name: str(value) for name, value in values.items()}
