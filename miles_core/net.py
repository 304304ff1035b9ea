"""Where processes meet: free ports, this node's reachable endpoint, and process groups that
a trainer and rollout engines join over TCP.

Neutral ground on purpose: the trainers, the rollout engines and the tools all need these,
and none of them may import another's module for it.
"""

from __future__ import annotations

import socket
from datetime import timedelta


def free_ports(count: int, host: str = "") -> list[int]:
    """`count` distinct ports free right now on `host` ('' = every interface, where torch's
    TCPStore listens). Another process could take one before its server binds it."""
    socks = [socket.socket() for _ in range(count)]  # held open together: distinct ports
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "") -> int:
    """One port free right now on `host` (see free_ports)."""
    return free_ports(1, host)[0]


def rendezvous_endpoint() -> tuple[str, int]:
    """(this node's IP, a port free on all its interfaces): the address that processes on
    other nodes of the Ray cluster connect to."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: timedelta = timedelta(minutes=10)):
    """A process group outside torch's default one, the way SGLang's engine builds its weight
    update group, so a trainer (rank 0) and the engines (rank_offset..) meet on one TCPStore."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                         group_name=group_name, timeout=timeout)
    # Group rank == global rank inside this group, so broadcast(src=0, group=...) works
    # whether or not a default process group exists in this process.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
