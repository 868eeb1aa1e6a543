"""The worker processes of one multi-device job: joining (and leaving) the process group.

`init_workers` joins the group of `world_size` workers at a TCP rendezvous (rank 0's host and a port):
gloo on CPUs, NCCL on GPUs (worker r on cuda:r of its host, the communicator bound to it up front). Every
collective waits at most `timeout_s` for the other ranks, so a worker whose peer died, hung or was killed
does not wait forever:

- gloo: the collective raises a RuntimeError in the calling thread (at once when the peer's connection
  closes, after `timeout_s` when the peer is alive but does not join);
- NCCL: torch's watchdog aborts the communicator after `timeout_s` and tears the process down
  (TORCH_NCCL_ASYNC_ERROR_HANDLING, set to 3 here unless the environment says otherwise): the process
  exits, and whoever started the workers sees its exit code.

Either way the job's parent (the server) must watch its workers and stop when one exits
(`tests/parallel/test_parallel.py` kills a worker and times its peer).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0  # a step of a large model can take tens of seconds; a dead peer less


@dataclass(frozen=True)
class Workers:
    """What `init_workers` joined: this worker's rank, the group's size, its device and backend."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout_s: float
    group: dist.ProcessGroup | None = None  # None: the default (world) group


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a rendezvous on this host)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_device(device: str, rank: int) -> torch.device:
    """The device of worker `rank`: "cpu", "cuda" (cuda:<rank>, one GPU per worker of a host) or an
    explicit "cuda:i"."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: this torch has no CUDA device")
        index = rank if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"worker {rank} needs cuda:{index}, and this host has {torch.cuda.device_count()} "
                "CUDA device(s): start at most that many workers"
            )
        return torch.device("cuda", index)
    return dev


def init_workers(
    rank: int,
    world_size: int,
    *,
    master_port: int,
    master_addr: str = "127.0.0.1",
    device: str = "cpu",
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Workers:
    """Join the process group of `world_size` workers as worker `rank` (each worker calls this once).

    Rendezvous at tcp://master_addr:master_port (the same on every worker; rank 0 listens there). device
    "cpu" -> gloo, "cuda" -> NCCL with worker r on cuda:r (backend overrides). timeout_s bounds every
    collective and the rendezvous itself (see the module docstring)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} workers")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    dev = worker_device(device, rank)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group")
    kw = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kw,
    )
    return Workers(rank, world_size, dev, backend, float(timeout_s))


def shutdown_workers() -> None:
    """Leave the process group (every worker, at the end; a no-op outside one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["DEFAULT_TIMEOUT_S", "Workers", "free_port", "init_workers", "shutdown_workers", "worker_device"]
