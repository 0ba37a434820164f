"""One live run per output folder: ``output_dir/run.lock`` holds the run's pid, host and start time.

A second run into the folder is refused at once, naming the holder; a lock left by a process that is no longer
alive (killed, crashed) is taken over with a log line. The lock is created atomically (a hard link to a written draft),
so two runs starting at the same moment cannot both take it, and no run sees a lock without its record.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

logger = logging.getLogger("zoo.training.finetune")
LOCK_NAME = "run.lock"


class RunLockedError(RuntimeError):
    pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunLock:
    """``output_dir/run.lock`` for as long as the run lives; :meth:`release` removes it."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> RunLock:
        """Take the lock, or raise :class:`RunLockedError` naming the live run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        draft = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}")
        draft.write_text(json.dumps(record))
        try:
            for _ in range(2):
                try:
                    os.link(draft, self.path)  # atomic, and the lock is never seen without its record
                except FileExistsError:
                    self.refuse_if_live()
                    logger.warning("taking over %s, left by a run that is no longer alive (%s)", self.path,
                                   self.path.read_text(errors="replace").strip() or "empty")  # fmt: skip
                    self.path.unlink(missing_ok=True)
                    continue
                self.held = True
                return self
        finally:
            draft.unlink(missing_ok=True)
        raise RunLockedError(f"could not take the lock {self.path}: another run took it at the same moment.")

    def refuse_if_live(self) -> None:
        """Raise if a live process holds the lock (one on another host counts as live: it cannot be checked)."""
        try:
            holder = json.loads(self.path.read_text())
            pid, host = int(holder["pid"]), holder.get("host")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError):
            return  # unreadable: not a lock this code wrote whole
        if host != socket.gethostname() or _process_alive(pid):
            raise RunLockedError(
                f"output_dir {self.path.parent} is in use by a live run (pid {pid} on {host}, started "
                f"{holder.get('started')}; lock {self.path}). Wait for it to finish, or use another --output_dir."
            )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
