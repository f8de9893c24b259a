"""One run per workdir: a lock file naming the holder's host and pid.

`WorkdirLock(workdir)` creates `<workdir>/.lock.<process index>` atomically
(`O_CREAT | O_EXCL`) holding `host pid`, and removes it on exit. A second run on
the same workdir finds the file and refuses with `WorkdirLockedError`, naming the
holder. A lock whose holder is on this host and no longer alive (a run killed
with SIGKILL, a crashed node rebooted under the same name) is stale: it is taken
over with a message. A lock held from another host cannot be checked from here;
the message says to remove the file if that run is gone.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

LOCK_PREFIX = ".lock"


class WorkdirLockedError(RuntimeError):
    """Another live run holds the workdir."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class WorkdirLock:
    """Context manager holding `<workdir>/.lock.<process_index>` for one process of a run.

    Args:
      workdir: the run's workdir (created if missing; on exit, the directories the lock
        created are removed again when they are empty: a start refused before it wrote
        anything leaves the filesystem as it was).
      process_index: this process's index in a multi-process run (each process
        holds its own lock file, so a second run is refused on every process).

    Raises (on enter):
      WorkdirLockedError: a live run holds the lock (host, pid and file named).
    """

    def __init__(self, workdir: str | Path, process_index: int = 0):
        self.path = Path(workdir) / f"{LOCK_PREFIX}.{process_index}"
        self.owner = f"{socket.gethostname()} {os.getpid()}"
        self.created: list[Path] = []  # the directories `__enter__` made, deepest first

    def __enter__(self) -> WorkdirLock:
        for _ in range(3):
            self._make_workdir()
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except FileNotFoundError:  # another process of the run removed the empty workdir it had made: again
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.owner + "\n")
            return self
        raise WorkdirLockedError(f"{self.path}: could not take the workdir lock (another run took it at the same time)")

    def _make_workdir(self) -> None:
        """Makes the workdir and the missing directories above it, noting them (deepest first) for `__exit__`."""
        missing = []
        for folder in (self.path.parent, *self.path.parent.parents):
            if folder.exists():
                break
            missing.append(folder)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.created += [f for f in missing if f not in self.created]

    def _take_over_if_stale(self) -> None:
        try:
            host, pid = self.path.read_text().split()
            pid = int(pid)
        except (OSError, ValueError):
            host, pid = None, None
        if host == socket.gethostname() and pid is not None and not _alive(pid):
            print(f"gem-train: removing the stale lock {self.path} of process {pid} on {host} (no longer running)", file=sys.stderr)
        elif host is None:
            print(f"gem-train: removing the unreadable lock file {self.path}", file=sys.stderr)
        elif host == socket.gethostname():
            raise WorkdirLockedError(
                f"{self.path.parent} is in use by another run (process {pid} on this host, {host}); "
                "wait for it to finish, stop it, or use another workdir"
            )
        else:
            raise WorkdirLockedError(
                f"{self.path.parent} is in use by another run (process {pid} on host {host}); "
                f"if that run is gone, remove {self.path}, or use another workdir"
            )
        self.path.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        try:
            if self.path.read_text().strip() == self.owner:
                self.path.unlink()
        except FileNotFoundError:
            pass
        for folder in self.created:  # deepest first; one holding anything (a run's files) stays
            try:
                folder.rmdir()
            except OSError:
                break
