"""Breaks: a Data Constructor asks its loaders for a replay when a bridge's stream
broke, at most once a gap, and never drops a break it has not asked for yet."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from overlord.remote.bridge import REPLAY_GAP_S, Breaks


@dataclass
class Flagged:
    """What Breaks reads of a Bridge: its `broke` event, set by the bridge's thread."""

    broke: threading.Event = field(default_factory=threading.Event)


def test_a_break_is_asked_for_once():
    bridges = [Flagged(), Flagged()]
    breaks = Breaks(bridges, gap_s=0.0)
    assert not breaks.owed()
    bridges[1].broke.set()
    assert breaks.owed()
    assert not any(b.broke.is_set() for b in bridges)
    assert not breaks.owed()


def test_breaks_within_the_gap_wait_for_it_and_then_go_out_once():
    bridges = [Flagged(), Flagged()]
    breaks = Breaks(bridges, gap_s=0.3)
    bridges[0].broke.set()
    asked = time.monotonic()
    assert breaks.owed()
    answers = []
    # a bridge failing every few ms, as one that cannot reconnect, for 0.6 s (and on until
    # one request went out, however late this thread runs on a loaded machine)
    while time.monotonic() - asked < 0.6 or not any(owed for _, owed in answers):
        bridges[0].broke.set()
        bridges[1].broke.set()
        answers.append((time.monotonic() - asked, breaks.owed()))
        time.sleep(0.005)
    yes = [t for t, owed in answers if owed]
    span = answers[-1][0]
    assert 1 <= len(yes) <= span / 0.3 + 1  # one per gap at most, not one per failure (~100 of them)
    slack = 0.01  # the test reads the clock just before Breaks does
    assert yes[0] >= 0.3 - slack and all(b - a >= 0.3 - slack for a, b in zip(yes, yes[1:]))
    bridges[0].broke.set()
    time.sleep(0.31)
    assert breaks.owed()  # the break within the gap was kept, not dropped


def test_the_default_gap_is_bounded():
    assert 0 < REPLAY_GAP_S <= 2.0  # a replay owed waits at most this long
