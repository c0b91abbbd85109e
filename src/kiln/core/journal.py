"""The ledger's journal: usage events made durable with one write, before the store commits them.

On the embedded store (SQLite, synchronous NORMAL) a commit survives a crash of the process but
not a power cut: it lands in the OS's page cache. An append to this file has exactly that
durability for a fraction of the cost: one write() of one JSON line, against a transaction that
writes six or seven pages to SQLite's WAL (about 60 µs of CPU). So a request's event is appended
here before its last byte, and the ledger commits journaled events to the database up to a
tenth of a second later, many per transaction. After a crash, the events still here are committed at
the next start before anything is served; the store inserts each generation id once, so an event
that was both committed and still journaled bills once.

Segments: appends go to the active segment; the ledger reports events committed in the order they
were appended (`done`). A segment whose events are all committed is deleted, or, if it is the
active one, emptied in place. The directory is locked (flock): one process per journal.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import deque
from pathlib import Path

from kiln.core.records import UsageEvent
from kiln.store.base import event_from_json, event_json

log = logging.getLogger("kiln.journal")

SEGMENT_BYTES = 4 << 20  # a segment this large is closed and a new one started


class _Segment:
    __slots__ = ("path", "events", "committed", "size")

    def __init__(self, path: Path, events: int = 0, size: int = 0) -> None:
        self.path = path
        self.events = events  # appended to it
        self.committed = 0  # of those, committed to the store
        self.size = size


class Journal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock_file: int | None = None
        self._segments: deque[_Segment] = deque()  # oldest first; the last one is active
        self._fd: int | None = None  # the active segment's
        self._seq = 0

    def open(self) -> list[UsageEvent]:
        """Lock the journal and start a new segment; the events an earlier run left, oldest first
        (the caller commits them before serving)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_file = os.open(self.directory / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_file)
            self._lock_file = None
            raise RuntimeError(f"the ledger journal {self.directory} is in use by another process") from None
        left: list[UsageEvent] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            events = _read(path)
            left += events
            self._segments.append(_Segment(path, len(events), path.stat().st_size))
            self._seq = max(self._seq, int(path.stem))
        if left:
            log.warning("the ledger journal holds %d usage events not yet in the database: committing them",
                        len(left))
        self._start_segment()
        return left

    def append(self, event: UsageEvent) -> None:
        """Durable (as a NORMAL commit: the process may die next) when this returns; raises
        OSError (the disk is full) having written nothing."""
        active = self._segments[-1]
        if active.size >= SEGMENT_BYTES:
            self._start_segment()
            active = self._segments[-1]
        line = event_json(event) + b"\n"
        assert self._fd is not None, "journal is not open"
        try:
            written = os.write(self._fd, line)
        except OSError:
            self._cut_back(active)
            raise
        if written != len(line):  # the disk filled up mid-line: no half event stays behind
            self._cut_back(active)
            raise OSError(28, "No space left on device (a short write to the ledger journal)")
        active.size += written
        active.events += 1

    def done(self, count: int) -> None:
        """`count` more of the oldest journaled events are committed (or set aside) by the store."""
        while count:
            oldest = self._segments[0]
            step = min(count, oldest.events - oldest.committed)
            oldest.committed += step
            count -= step
            if oldest.committed < oldest.events:
                assert count == 0, "more events reported committed than were journaled"
                return
            if len(self._segments) > 1:
                self._segments.popleft()
                oldest.path.unlink(missing_ok=True)
            else:  # the active segment, all committed: emptied in place (O_APPEND writes at the new end)
                assert self._fd is not None
                os.ftruncate(self._fd, 0)
                oldest.events = oldest.committed = oldest.size = 0
                return

    @property
    def pending(self) -> int:
        return sum(s.events - s.committed for s in self._segments)

    def close(self) -> None:
        """Stop appending; events not yet committed stay for the next start."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for segment in self._segments:
            if segment.events == segment.committed:
                segment.path.unlink(missing_ok=True)
        self._segments.clear()
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases the flock
            self._lock_file = None

    def _start_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._seq += 1
        path = self.directory / f"{self._seq:012d}.jsonl"
        self._fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._segments.append(_Segment(path))

    def _cut_back(self, active: _Segment) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, active.size)
        except OSError:  # the partial line stays last in its segment (skipped when read); go on in a new one
            log.exception("could not cut a partial line from the ledger journal %s", active.path)
            self._start_segment()


def _read(path: Path) -> list[UsageEvent]:
    events = []
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            events.append(event_from_json(line))
        except (ValueError, TypeError):  # cut by a power loss mid-write: never acknowledged
            log.warning("ledger journal %s line %d is not a whole event; skipped", path, number)
    return events
