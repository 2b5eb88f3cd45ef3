"""engine/stops.py: stop strings over text that arrives in pieces."""

from __future__ import annotations

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
