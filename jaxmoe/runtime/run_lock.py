"""One training per run directory: a lock file taken before anything is written.

`RUN_DIR/training.lock` is created with O_CREAT | O_EXCL (atomic on local file
systems and on NFS v3 and later), holding who took it: host, process id, start
time and the command. Its holder touches it every `BEAT_S` seconds from a daemon
thread, and removes it on every exit it lives through (return, exception, signal
handled by the training loop, interpreter exit).

A lock whose holder died without removing it (SIGKILL, a lost node) is stale:
- on the host that took it, when its process id is no longer running;
- from any other host sharing the file system, when it has not been touched for
  `STALE_S` seconds (its mtime, as the file server stamps it: the hosts' clocks
  need only agree to within minutes).
A stale lock is taken over by renaming it aside first, so that of two trainings
that find it stale at once only one takes it. Readers of a run (generate,
export, eval) never take it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

NAME = "training.lock"
BEAT_S = 30.0
STALE_S = 600.0


class RunDirectoryInUse(RuntimeError):
    """Another training holds the run directory; the message names it."""


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class RunLock:
    """The lock of one run directory, held from `acquire` to `release`."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / NAME
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._stop = threading.Event()

    def holder(self) -> dict | None:
        """What the lock file says of its holder (None: no lock, or unreadable)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _stale(self, holder: dict | None) -> str | None:
        """Why the lock on disk is stale, or None if its holder may be running."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "gone"
        if holder is None:  # being written this instant, or damaged: wait out a beat
            return f"unreadable and untouched for {age:.0f} s" if age > STALE_S else None
        if holder.get("host") == socket.gethostname() and not alive(int(holder["pid"])):
            return f"process {holder['pid']} on this host is not running"
        if age > STALE_S:
            return f"untouched for {age:.0f} s (its holder touches it every {BEAT_S:.0f} s)"
        return None

    def acquire(self) -> None:
        """Takes the lock, or raises RunDirectoryInUse naming the training that holds it;
        a stale lock is taken over, with a line on stderr."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                why = self._stale(holder)
                if why is None:
                    raise RunDirectoryInUse(self._in_use(holder)) from None
                aside = self.path.with_name(f"{NAME}.stale-{self.token.replace(':', '-')}")
                try:
                    self.path.rename(aside)  # one of two takers wins the rename
                except FileNotFoundError:
                    continue
                aside.unlink(missing_ok=True)
                if why != "gone":
                    print(f"took over the stale lock of {self.path.parent} ({why})",
                          file=sys.stderr)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            threading.Thread(target=self._touch, name="run-lock", daemon=True).start()
            return
        raise RunDirectoryInUse(f"could not take the lock {self.path}: another training "
                                "took it first")

    def _in_use(self, holder: dict | None) -> str:
        if holder is None:
            return f"run directory {self.path.parent} is in use: {self.path} is being written"
        age = time.time() - self.path.stat().st_mtime
        return (f"run directory {self.path.parent} is in use by a training started "
                f"{holder.get('started')} on host {holder.get('host')} (pid {holder.get('pid')}, "
                f"seen {age:.0f} s ago: {holder.get('command')}); wait for it to end, or set "
                f"another train.run_dir (a lock left by a killed training is taken over once "
                f"its process is gone, or after {STALE_S:.0f} s from another host)")

    def _touch(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Removes the lock if it is still this process's."""
        self._stop.set()
        holder = self.holder()
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)
