"""engine/stops.py: stop strings over text that arrives in pieces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gmlx.engine.stops import StopMatcher


def run(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    m, out = StopMatcher(stops), []
    for piece in pieces:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_a_stop_split_across_pieces_is_cut_with_what_follows() -> None:
    assert run(("END",), ["one E", "N", "D two"]) == ("one ", True)


def test_text_that_only_begins_a_stop_is_held_then_released() -> None:
    m = StopMatcher(("END",))
    assert m.feed("the EN") == ("the ", False)  # "EN" may begin "END"
    assert m.feed("emy") == ("ENemy", False)
    assert m.feed("E") == ("", False)
    assert m.flush() == "E"  # the stream ended: what was held goes out


def test_the_earliest_of_several_stops_wins() -> None:
    assert run(("zz", "b"), ["a b zz"]) == ("a ", True)
    assert run(("\n\n", "###"), ["x", "#", "##\n\ny"]) == ("x", True)


def test_without_stops_text_passes_through_and_empty_stops_are_ignored() -> None:
    assert run((), ["a", "b"]) == ("ab", False)
    assert run(("",), ["a", "b"]) == ("ab", False)


def test_a_stop_at_the_very_start_leaves_nothing() -> None:
    assert run(("Q:",), ["Q", ": next"]) == ("", True)


def reference(stops: tuple[str, ...], text: str) -> tuple[str, bool]:
    """The text up to the first stop string to complete (of those completing at one character, the
    earliest to start), by brute force."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


@given(
    stops=st.lists(st.text("ab\n", min_size=0, max_size=5), max_size=4).map(tuple),
    text=st.text("ab\nc", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_any_pieces_give_the_first_stop_to_complete(stops: tuple[str, ...], text: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(stops, pieces) == reference(stops, text)


def test_overlapping_stops_cut_at_the_first_to_complete_however_the_text_is_split() -> None:
    """The longer stop begins first but completes later: the text is cut where the shorter one
    completed, in whatever pieces it came (a chunk holding both used to decide otherwise)."""
    assert run(("bcd", "abcdef"), ["abcdef"]) == run(("bcd", "abcdef"), ["abcd", "ef"]) == ("a", True)


def test_held_text_is_only_what_may_still_begin_a_stop() -> None:
    m = StopMatcher(("aab",))
    assert m.feed("xaaa") == ("xa", False)  # "aa" may begin "aab"; the first "a" cannot any more
    assert m.feed("b") == ("", True)
