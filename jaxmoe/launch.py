"""python -m jaxmoe.launch --num-processes 2 --devices-per-process 4 -- --config configs/cpu8_ep.yaml

Several processes on one machine, to try the multi-process path on CPU: starts N
copies of `python -m jaxmoe.train ARGS`, each with its own fake CPU devices,
joined through a coordinator on a free loopback port, and prefixes their output
with `[i]`. If one fails, the others are stopped and the launcher exits non-zero
naming it. On a cluster, start the processes with srun or mpirun instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxmoe.runtime.distributed import ENV
from jaxmoe.runtime.fake_devices import cpu_devices_env

GRACE_S = 5.0  # a stopped process gets this long to exit before it is killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, n: int, port: int, devices: int) -> dict[str, str]:
    return {**cpu_devices_env(os.environ, devices), "PYTHONUNBUFFERED": "1",
            ENV["coordinator"]: f"127.0.0.1:{port}", ENV["num_processes"]: str(n),
            ENV["process_id"]: str(i)}


def _stream(i: int, proc: subprocess.Popen, lock: threading.Lock) -> None:
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{i}] {line}")
            sys.stdout.flush()


def _exit_status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.launch`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, required=True, metavar="N")
    parser.add_argument("--devices-per-process", type=int, default=1, metavar="D",
                        help="fake CPU devices of each process")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then the arguments of python -m jaxmoe.train")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.num_processes < 1 or args.devices_per_process < 1:
        parser.error("--num-processes and --devices-per-process must be at least 1")
    if not train_args:
        parser.error("no arguments for jaxmoe.train after --")

    port, lock = free_port(), threading.Lock()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxmoe.train", *train_args],
                              env=process_env(i, args.num_processes, port,
                                              args.devices_per_process),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(args.num_processes)]
    print(f"jaxmoe.launch: {args.num_processes} processes x {args.devices_per_process} CPU "
          f"devices, coordinator 127.0.0.1:{port}, pids "
          + " ".join(str(p.pid) for p in procs), flush=True)
    readers = [threading.Thread(target=_stream, args=(i, p, lock), daemon=True)
               for i, p in enumerate(procs)]
    for r in readers:
        r.start()
    # a stop request reaches every process, which then save and leave together
    forward = lambda signum, frame: [p.send_signal(signum) for p in procs if p.poll() is None]  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll() and not _stopped(p)), None)
            time.sleep(0.05)
        if failed is None:
            failed = next((i for i, p in enumerate(procs) if p.returncode and not _stopped(p)),
                          None)
        if failed is not None:
            _stop(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for r in readers:
        r.join(timeout=GRACE_S)
    if failed is None:  # finished, or stopped together by a signal (128 + its number)
        return max(p.returncode for p in procs)
    code = procs[failed].returncode
    others = ", ".join(f"{i}: {_exit_status(p.returncode)}" for i, p in enumerate(procs)
                       if i != failed)
    print(f"jaxmoe.launch: process {failed} of {args.num_processes} failed with "
          f"{_exit_status(code)}; the others: {others}", file=sys.stderr)
    return code if code > 0 else 1


def _stopped(proc: subprocess.Popen) -> bool:
    """Whether a process left because it was asked to stop (SIGTERM or SIGINT, here or
    forwarded): it saved and exits 128 + the signal's number, as the others will."""
    return proc.returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
