import time

import pytest
import torch

from shared.train.timing import PhaseTimer


def test_phases_are_timed_per_step_with_accumulation():
    timer = PhaseTimer(torch.device("cpu"), micro_steps=2)
    timer.start()
    for _ in range(3):
        for _ in range(2):
            for phase, seconds in (("data", 0.001), ("forward", 0.004), ("backward", 0.002), ("step", 0.0)):
                time.sleep(seconds)
                timer.mark(phase)
    timer.finish()
    assert len(timer.steps) == 3
    s = timer.summary(skip=1)
    assert s["n"] == 2
    assert s["phases_s"]["forward"] >= 0.008  # two micro-steps of 4 ms each
    assert s["phases_s"]["forward"] > s["phases_s"]["backward"] > s["phases_s"]["data"]
    assert s["step_time_s"]["median"] == pytest.approx(sum(s["phases_s"].values()), rel=0.2)


def test_marks_out_of_order_are_refused():
    timer = PhaseTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="start"):
        timer.mark("data")
    timer.start()
    with pytest.raises(RuntimeError, match="'forward' marked where 'data' was expected"):
        timer.mark("forward")


def test_summary_needs_timed_steps():
    timer = PhaseTimer(torch.device("cpu"))
    timer.start()
    for phase in ("data", "forward", "backward", "step"):
        timer.mark(phase)
    timer.finish()
    with pytest.raises(ValueError, match="no timed steps"):
        timer.summary(skip=1)
