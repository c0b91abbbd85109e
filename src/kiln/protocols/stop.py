"""Stop strings enforced by the gateway.

Some serving stacks ignore `stop`; Kiln cuts the output itself. In a stream
it holds back only the tail that could still become a stop string, so text
reaches the client as early as possible.
"""

from __future__ import annotations

from typing import Any

from kiln.core import errors

MAX_STOP_STRINGS = 16


def parse_stop(value: Any, param: str = "stop") -> list[str]:
    """`stop` as a list of non-empty strings: a string or an array of at most 16."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise errors.invalid(f"'{param}' must be a string or an array of strings.", param=param)
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.invalid(f"'{param}' takes at most {MAX_STOP_STRINGS} strings.", param=param)
    return [s for s in stops if s]


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text that is safe to emit now; sets `matched` when a stop string appears."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        cut, hit = len(buf), None
        for stop in self.stops:
            i = buf.find(stop)
            if 0 <= i < cut:
                cut, hit = i, stop
        if hit is not None:
            self.matched, self._held = hit, ""
            return buf[:cut]
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail, at the natural end of the output."""
        held, self._held = self._held, ""
        return held


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Non-streaming form: the text before the first stop string, and which one matched."""
    matcher = StopMatcher(stops)
    head = matcher.feed(text)
    return (head, matcher.matched) if matcher.matched is not None else (head + matcher.flush(), None)
