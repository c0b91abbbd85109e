"""The ledger's journal file: segments, what is committed leaves, what is not stays for the next start."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kiln.core import journal as journal_module
from kiln.core.journal import Journal
from kiln.core.records import UsageEvent


def _event(i: int) -> UsageEvent:
    return UsageEvent(id=f"gen-{i:024x}", created_at=time.time(), org_id="org", project_id="p", key_id="k",
                      model="m", endpoint="chat.completions", prompt_tokens=i, completion_tokens=1, cost_nano=i)


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.jsonl"))


def test_committed_segments_leave_and_the_rest_is_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 1000)  # three events (367 bytes each) per segment
    j = Journal(tmp_path / "journal")
    assert j.open() == []
    for i in range(10):
        j.append(_event(i))
    assert len(_segments(tmp_path / "journal")) == 4 and j.pending == 10
    j.done(5)  # the first segment leaves; the second is partly committed
    assert len(_segments(tmp_path / "journal")) == 3 and j.pending == 5
    j.close()

    again = Journal(tmp_path / "journal")
    left = again.open()
    assert [e.id for e in left] == [_event(i).id for i in range(3, 10)], "a segment is read whole"
    again.done(len(left))
    again.append(_event(10))
    again.done(1)  # everything is committed: the active segment is emptied in place
    files = _segments(tmp_path / "journal")
    assert len(files) == 1 and files[0].stat().st_size == 0
    again.close()
    assert _segments(tmp_path / "journal") == []


def test_one_process_per_journal(tmp_path: Path) -> None:
    first = Journal(tmp_path / "journal")
    first.open()
    with pytest.raises(RuntimeError, match="in use"):
        Journal(tmp_path / "journal").open()
    first.close()
    Journal(tmp_path / "journal").open()


def test_a_line_cut_by_a_crash_is_skipped(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal")
    j.open()
    j.append(_event(1))
    j.close()
    segment = _segments(tmp_path / "journal")[0]
    with segment.open("ab") as f:
        f.write(b'{"id":"gen-cut","created_')  # a power loss mid-write: never acknowledged
    assert [e.id for e in Journal(tmp_path / "journal").open()] == [_event(1).id]
