"""Progress in one style: in a log (stderr not a terminal, as under pytest) a line at most every
15 seconds and one at the end, each with done/total, the rate, the time left and the caller's figures."""

from __future__ import annotations

import logging

from etagent.progress import Progress


def test_a_log_gets_a_line_at_the_end_and_none_in_between_within_15_seconds(caplog):
    caplog.set_level(logging.INFO, logger="etagent.progress")
    progress = Progress("sampling", 40, "question")
    for _ in range(40):
        progress.update(1, trajectories_per_s="2.50")
    progress.close()
    assert len(caplog.messages) == 1
    assert caplog.messages[0].startswith("sampling: 40/40 questions (") and caplog.messages[0].endswith(", trajectories_per_s 2.50")


def test_a_line_per_update_with_the_time_left_and_a_last_line_for_an_open_count(caplog):
    caplog.set_level(logging.INFO, logger="etagent.progress")
    progress = Progress("rl", 4, "step", initial=1, every_s=0)
    progress.update(1, reward="0.500")
    progress.update(0, raw="0.7")  # a figure alone writes no line
    progress.update(1)
    assert len(caplog.messages) == 2
    assert caplog.messages[0].startswith("rl: 2/4 steps (") and "left), reward 0.500" in caplog.messages[0]
    assert caplog.messages[1].endswith("reward 0.500, raw 0.7")
    caplog.clear()
    count = Progress("encoding passages", None, "passage")
    count.update(500)
    count.close()
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("encoding passages: 500 passages (")
