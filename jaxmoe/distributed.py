"""Joining JAX's multi-controller runtime: one process per host (or per GPU), one global mesh.

A run is one of several processes when it is told so (`--coordinator host:port
--num-processes N --process-id I`, or the JAXMOE_* variables below), or when it
runs as a SLURM step or under Open MPI's mpirun with more than one task; JAX
then finds the coordinator itself. Otherwise it is a single process and nothing
here does anything.

Every process must call `initialize` before anything touches a device. A process
that dies is noticed by the coordination service within `peer_timeout` seconds
(missed heartbeats), and every other process then stops with JAX's error naming
the dead task; a process that leaves early waits at most as long for the rest.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxmoe.sharding import describe, process_rows

ENV = {"coordinator": "JAXMOE_COORDINATOR", "num_processes": "JAXMOE_NUM_PROCESSES",
       "process_id": "JAXMOE_PROCESS_ID", "peer_timeout": "JAXMOE_PEER_TIMEOUT"}
DEFAULT_PEER_TIMEOUT = 120


class DistributedError(ValueError):
    """Inconsistent or malformed multi-process settings."""


@dataclass(frozen=True)
class Processes:
    num_processes: int
    process_id: int
    coordinator: str | None  # None: JAX reads it from the SLURM or Open MPI environment
    peer_timeout: int
    source: str  # where the settings came from, for messages


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multiple processes (see README, 'Many hosts')")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help=f"address of process 0's coordinator (env {ENV['coordinator']})")
    group.add_argument("--num-processes", metavar="N",
                       help=f"processes in the job (env {ENV['num_processes']})")
    group.add_argument("--process-id", metavar="I",
                       help=f"this process, 0..N-1 (env {ENV['process_id']})")
    group.add_argument("--peer-timeout", metavar="SECONDS",
                       help="how long to wait for a missing or silent process before every "
                            f"process stops (env {ENV['peer_timeout']}, default "
                            f"{DEFAULT_PEER_TIMEOUT})")


def settings(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Processes | None:
    """The job's processes from flags, else JAXMOE_* variables, else SLURM / Open MPI.

    None for a single process.
    """
    given = {k: getattr(args, k) if getattr(args, k) is not None else environ.get(v)
             for k, v in ENV.items()}
    timeout = _integer(given["peer_timeout"], "--peer-timeout", DEFAULT_PEER_TIMEOUT)
    if timeout < 1:
        raise DistributedError(f"--peer-timeout must be at least 1 second, got {timeout}")
    explicit = [k for k in ("coordinator", "num_processes", "process_id") if given[k] is not None]
    if explicit:
        missing = [k for k in ("coordinator", "num_processes", "process_id") if k not in explicit]
        if missing:
            names = ", ".join(f"--{k.replace('_', '-')} ({ENV[k]})" for k in missing)
            raise DistributedError(f"multi-process settings are incomplete: missing {names}")
        _check_address(given["coordinator"])
        n = _integer(given["num_processes"], "--num-processes")
        i = _integer(given["process_id"], "--process-id")
        return _checked(n, i, given["coordinator"], timeout, "flags / JAXMOE_* variables")
    # The variables JAX's own cluster detection requires (jax/_src/clusters/slurm_cluster.py
    # and ompi_cluster.py): when they are present, jax.distributed.initialize() finds the
    # coordinator itself. Recheck them when upgrading JAX.
    if all(v in environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                  "SLURM_PROCID", "SLURM_LOCALID")):
        return _checked(_integer(environ["SLURM_NTASKS"], "SLURM_NTASKS"),
                        _integer(environ["SLURM_PROCID"], "SLURM_PROCID"), None, timeout, "SLURM")
    if "OMPI_MCA_orte_hnp_uri" in environ:
        return _checked(_integer(environ.get("OMPI_COMM_WORLD_SIZE"), "OMPI_COMM_WORLD_SIZE"),
                        _integer(environ.get("OMPI_COMM_WORLD_RANK"), "OMPI_COMM_WORLD_RANK"),
                        None, timeout, "Open MPI")
    return None


def _integer(value: str | None, name: str, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"--coordinator must be HOST:PORT with a port in 1..65535, "
                               f"got {address!r}")


def _checked(n: int, i: int, coordinator: str | None, timeout: int, source: str) -> Processes | None:
    if n < 1:
        raise DistributedError(f"number of processes must be at least 1, got {n} ({source})")
    if not 0 <= i < n:
        raise DistributedError(f"process id {i} not in 0..{n - 1} ({source})")
    return Processes(n, i, coordinator, timeout, source) if n > 1 else None


def initialize(p: Processes | None) -> None:
    """Joins the job (a no-op for a single process); before any device is used.

    If not every process joins within `peer_timeout`, those waiting stop with
    JAX's error (DEADLINE_EXCEEDED on RegisterTask).
    """
    if p is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
    jax.distributed.initialize(
        coordinator_address=p.coordinator, num_processes=p.num_processes,
        process_id=p.process_id, initialization_timeout=p.peer_timeout,
        heartbeat_timeout_seconds=p.peer_timeout, shutdown_timeout_seconds=p.peer_timeout)


def is_main() -> bool:
    """Process 0 writes logs, metrics and progress; all processes write checkpoints."""
    return jax.process_index() == 0


def layout(batch_sharding: NamedSharding, batch_size: int) -> str:
    """One line: the mesh over the processes and the batch rows each one reads."""
    blocks = []
    for p in range(jax.process_count()):
        block, count = process_rows(batch_sharding, batch_size, p)
        rows = batch_size // count
        blocks.append(f"process {p} rows {block * rows}:{(block + 1) * rows}")
    shape = describe(batch_sharding.mesh.shape)
    return (f"{jax.process_count()} processes x {jax.local_device_count()} devices, mesh "
            f"{shape}; of each batch of {batch_size}: {', '.join(blocks)}")


def check_same(value: int, what: str) -> None:
    """Raises unless every process holds the same `value` (a collective: all must call it)."""
    if jax.process_count() == 1:
        return
    values = multihost_utils.process_allgather(np.int32(value)).tolist()
    if len(set(values)) > 1:
        raise DistributedError(f"processes disagree on {what}: "
                               + ", ".join(f"process {i} has {v}" for i, v in enumerate(values)))


def any_process(flag: bool) -> bool:
    """True on every process if it is true on any (a collective: all must call it)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
