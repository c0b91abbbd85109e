"""A durable local spool of usage events, for when the shared database is unreachable.

Append-only segment files of JSON lines, fsync'd once per group commit (one
append per ledger batch), so an event the ledger acknowledged is on disk even
if the process dies next. The ledger's flusher closes the active segment and
writes the closed ones to the database in order, then deletes them; while a
backlog remains, new batches go behind it, so the database receives the
events in the order they were made. Writing an event twice is harmless: the
store inserts each generation id once.

Each process holds a slot of its own (`<dir>/<n>`, locked with flock); a slot
left by a process that died (a worker, or a whole replica restarting on the
same disk) is adopted by the next process that starts and finds it unlocked.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import IO

from kiln.core.records import UsageEvent
from kiln.store.base import event_from_json, event_json

log = logging.getLogger("kiln.spool")

MAX_SLOTS = 256


class Spool:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.slot: Path | None = None
        self._locks: list[IO[str]] = []
        self._segments: list[Path] = []  # closed, oldest first (adopted ones before this process's own)
        self._active: IO[bytes] | None = None
        self._active_path: Path | None = None
        self._active_events = 0
        self._seq = 0

    def open(self) -> None:
        """Take the first free slot, and adopt the segments of slots nobody holds."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for n in range(MAX_SLOTS):
            slot = self.directory / str(n)
            lock = self._try_lock(slot)
            if lock is None:
                continue
            self._locks.append(lock)
            if self.slot is None:
                self.slot = slot
            segments = sorted(slot.glob("*.jsonl"))
            if segments:
                log.warning("spool %s holds %d segment(s) not yet written to the database", slot, len(segments))
            self._segments += segments
            if slot is not self.slot and not segments:
                self._release(lock)
        if self.slot is None:
            raise RuntimeError(f"no free spool slot in {self.directory}")
        own = sorted(self.slot.glob("*.jsonl"))
        self._seq = int(own[-1].stem) if own else 0

    @property
    def backlog(self) -> bool:
        return bool(self._segments) or self._active_events > 0

    def pending_segments(self) -> int:
        return len(self._segments) + (1 if self._active_events else 0)

    def append(self, events: list[UsageEvent]) -> None:
        """Write the events and fsync: durable when this returns (raises OSError otherwise)."""
        if self._active is None:
            assert self.slot is not None, "spool is not open"
            self._seq += 1
            self._active_path = self.slot / f"{self._seq:012d}.jsonl"
            self._active = self._active_path.open("ab")
        self._active.write(b"".join(event_json(e) + b"\n" for e in events))
        self._active.flush()
        os.fsync(self._active.fileno())
        self._active_events += len(events)

    def rotate(self) -> list[Path]:
        """Close the active segment (new appends start another); the closed ones, oldest first."""
        if self._active is not None and self._active_events:
            self._active.close()
            assert self._active_path is not None
            self._segments.append(self._active_path)
            self._active, self._active_path, self._active_events = None, None, 0
        return list(self._segments)

    def read(self, segment: Path) -> list[UsageEvent]:
        events = []
        for number, line in enumerate(segment.read_bytes().splitlines(), start=1):
            try:
                events.append(event_from_json(line))
            except (ValueError, TypeError):  # a line cut by a crash mid-write was never acknowledged
                log.warning("spool %s line %d is not a whole event; skipped", segment, number)
        return events

    def remove(self, segment: Path) -> None:
        segment.unlink(missing_ok=True)
        self._segments.remove(segment)

    def close(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        for lock in self._locks:
            self._release(lock)
        self._locks = []

    @staticmethod
    def _try_lock(slot: Path) -> IO[str] | None:
        slot.mkdir(exist_ok=True, mode=0o700)
        lock = (slot / "lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        return lock

    def _release(self, lock: IO[str]) -> None:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        if lock in self._locks:
            self._locks.remove(lock)
