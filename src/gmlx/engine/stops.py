"""Stop strings over streamed text: emit what cannot begin a stop string, hold back the rest.

Each stop string is matched as the text streams by its Knuth-Morris-Pratt automaton, one state a
stop string: how much of it the text so far ends with. A token costs its characters times the
stop strings, whatever their length; comparing every prefix of every stop string with the text's
end instead costs their length squared a token, which a client sending long stop strings turns
into seconds of the engine thread, every stream's.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=256)  # a harness sends the same stop strings with every request
def _fallbacks(s: str) -> tuple[int, ...]:
    """For each i, the longest proper prefix of s[: i + 1] that is also a suffix of it (KMP's table)."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return tuple(table)


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._tables = [_fallbacks(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # each stop string: how much of it the text ends with
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; returns (text safe to emit, whether a stop string was hit).
        On a hit the stop string and everything after it are dropped: the first to complete, and
        of those completing at one character, the one that starts earliest."""
        if not self.stops:
            return text, False
        buf = self._held + text
        matched = self._matched
        for end, ch in enumerate(text, start=len(self._held) + 1):
            hit = None
            for n, s in enumerate(self.stops):
                k, table = matched[n], self._tables[n]
                while k and s[k] != ch:
                    k = table[k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):
                    hit = min(hit if hit is not None else end, end - k)
                matched[n] = k
            if hit is not None:
                self._held = ""
                return buf[:hit], True
        keep = max(matched)  # the longest start of a stop string the text ends with: it may yet complete
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, once no more is coming."""
        held, self._held = self._held, ""
        return held
