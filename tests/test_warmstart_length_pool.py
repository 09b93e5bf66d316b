"""studies/warmstart_length_pool.py: the warm start's step widths with and without length-sorted pools."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies"))
import warmstart_length_pool as wlp  # noqa: E402


def test_step_widths_follow_the_pools():
    lengths = np.array([100, 900, 120, 880, 130, 870, 110, 860])  # every drawn batch of 2 holds a long game
    assert wlp.step_widths(lengths, 2, 1, 1000, 256) == [1000, 1000, 1000, 1000]  # 1024 capped at the length
    # sorted in pools of four: the short games together, the long ones together
    assert wlp.step_widths(lengths, 2, 2, 1000, 256) == [256, 1000, 256, 1000]
    assert wlp.step_widths(lengths, 2, 4, 1000, 256) == [256, 256, 1000, 1000]
    assert wlp.step_widths(lengths, 2, 4, 1000, 0) == [1000] * 4  # no bucket: always the whole length
    with pytest.raises(ValueError, match="pools of 6"):
        wlp.step_widths(lengths, 2, 3, 1000, 256)


def test_cli_checks_its_flags():
    with pytest.raises(SystemExit):
        wlp.main(["--steps=6", "--pools=1,4"])
    with pytest.raises(SystemExit):
        wlp.main(["--reps=0"])
