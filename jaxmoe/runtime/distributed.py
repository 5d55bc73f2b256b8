"""Joining JAX's multi-controller runtime: one process per host (or per GPU), one global mesh.

A run is one of several processes when it is told so (`--coordinator host:port
--num-processes N --process-id I`, or the JAXMOE_* variables below), or when it
runs as a SLURM step or under Open MPI's mpirun with more than one task; JAX
then finds the coordinator itself. Otherwise it is a single process and nothing
here does anything.

Every process must call `initialize` before anything touches a device. A process
that dies is noticed by the others within half of `peer_timeout` seconds (at
most 30): each says it is alive every second in the coordination service's
key-value store, and one that falls silent ends every other process with one
line (`PeerWatch`), well before JAX's own heartbeat timeout (twice `peer_timeout`)
would abort them with its log. A process that leaves early waits at most
`peer_timeout` for the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxmoe.parallel.sharding import describe, process_rows

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
    group = parser.add_argument_group("multiple processes (docs/guides/many-hosts.md)")
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
    silence_s = min(p.peer_timeout / 2, 30.0)
    # JAX's missed-heartbeat abort is the backstop behind the watch: at twice the peer
    # timeout it comes at least 3 peer timeouts / 2 after the watch's verdict (at 8 s,
    # 12 s after; at the whole timeout it came 1 s after, and a loaded host lost the race)
    jax.distributed.initialize(
        coordinator_address=p.coordinator, num_processes=p.num_processes,
        process_id=p.process_id, initialization_timeout=p.peer_timeout,
        heartbeat_timeout_seconds=2 * p.peer_timeout, shutdown_timeout_seconds=p.peer_timeout)
    global _watch
    from jax._src.distributed import global_state  # private: where JAX keeps its client
    _watch = PeerWatch(global_state.client, p.process_id, p.num_processes, silence_s)
    _watch.start()


class PeerWatch:
    """Each process of a job says it is alive every `BEAT_S` seconds (a counter of its
    own in the coordination service's key-value store, which process 0 holds).
    Process 0 reads them all; a counter that stands still for `silence_s` makes it
    write why under `STOP` and leave after two beats, and every other process, which
    reads that one key each beat, leaves first: one line on stderr, the cleanups
    registered with `on_stop` (the run directory's lock), exit status 2. A process that
    has finished says so (`done`) and is no longer watched. Without this, JAX's
    missed-heartbeat abort after twice the peer timeout prints the coordination
    service's log on every process. A lost process 0 takes the store with it: JAX
    aborts the others within a second (its `missed_heartbeat_callback`, which would
    let them leave in one line, fails on jaxlib 0.12 with std::bad_cast)."""

    BEAT_S = 1.0
    PREFIX = "jaxmoe/peer_watch"
    STOP = f"{PREFIX}/stop"

    def __init__(self, client, me: int, n: int, silence_s: float):
        self.client, self.me, self.n = client, me, n
        self.silence_s = max(silence_s, 3 * self.BEAT_S)
        self.cleanups: list[Callable[[], None]] = []
        self._finished = threading.Event()
        self.exit = os._exit  # past the main thread, wherever it waits

    def start(self) -> None:
        threading.Thread(target=self._run, name="peer-watch", daemon=True).start()

    def on_stop(self, cleanup: Callable[[], None]) -> None:
        self.cleanups.append(cleanup)

    def done(self) -> None:
        """This process has finished: stop watching, and tell the others."""
        if not self._finished.is_set():
            self._finished.set()
            try:
                self.client.key_value_set(f"{self.PREFIX}/done/{self.me}", "1")
            except Exception:  # noqa: BLE001: the store may be gone already; nothing to tell
                pass

    def verdict(self) -> None:
        """Waits long enough for a lost peer to be noticed (and this process ended)."""
        if not self._finished.is_set():
            time.sleep(self.silence_s + 3 * self.BEAT_S)

    def _run(self) -> None:
        seen: dict[int, tuple[str, float]] = {}
        while not self._finished.wait(self.BEAT_S):
            try:
                self.client.key_value_increment(f"{self.PREFIX}/beat/{self.me}", 1)
                if self.me != 0:
                    return self._stop(self.client.key_value_try_get(self.STOP))
                entries = dict(self.client.key_value_dir_get(self.PREFIX))
            except Exception as e:  # noqa: BLE001: no stop written, or the store is gone
                if str(e).startswith("NOT_FOUND"):
                    continue
                return  # this process finished, or JAX's own abort follows a lost process 0
            now = time.monotonic()
            for peer in range(1, self.n):
                if f"{self.PREFIX}/done/{peer}" in entries:
                    continue
                beat = entries.get(f"{self.PREFIX}/beat/{peer}", "")
                last = seen.get(peer)
                if last is None or last[0] != beat:
                    seen[peer] = (beat, now)
                elif now - last[1] > self.silence_s and not self._finished.is_set():
                    why = (f"process {peer} of {self.n} has been silent for "
                           f"{now - last[1]:.0f} s (killed, or its host lost); every process "
                           "stopped")
                    self.client.key_value_set(self.STOP, why)
                    time.sleep(2 * self.BEAT_S)  # the others leave before the store does
                    return self._stop(why)

    def _stop(self, why: str) -> None:
        print(f"error: {why}", file=sys.stderr, flush=True)
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception:  # noqa: BLE001: leaving regardless
                pass
        sys.stdout.flush()
        self.exit(2)


_watch: PeerWatch | None = None


def on_stop(cleanup: Callable[[], None]) -> None:
    """Runs `cleanup` if a lost peer ends this process (nothing for a single process)."""
    if _watch is not None:
        _watch.on_stop(cleanup)


def failed() -> None:
    """Before an unexpected error is reported: if a peer was lost (a CPU collective
    fails at once where a GPU one would wait), the watch ends this process in one line
    within its silence; otherwise this returns and the error is reported as it is."""
    if _watch is not None:
        _watch.verdict()


def finished() -> None:
    """This process is done: the others stop watching it (nothing for a single process)."""
    if _watch is not None:
        _watch.done()


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
