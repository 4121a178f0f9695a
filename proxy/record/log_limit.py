"""How often a line that any client (or a full disk) can cause may be logged: at most `per_window`
lines per `window_s`, and the first line of the next window says how many were left out.

Pure: the caller passes the time, as a number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LogLimit:
    per_window: int = 10
    window_s: float = 60.0
    _window_start: float | None = None
    _logged: int = 0
    _left_out: int = 0

    def allow(self, now: float) -> tuple[bool, int]:
        """Whether to log a line now, and how many lines were left out before it (0 when it is not
        logged; those are told with the next line that is)."""
        if self._window_start is None or now - self._window_start >= self.window_s:
            self._window_start, self._logged = now, 0
        if self._logged >= self.per_window:
            self._left_out += 1
            return False, 0
        self._logged += 1
        left_out, self._left_out = self._left_out, 0
        return True, left_out
