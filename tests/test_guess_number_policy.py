"""studies/guess_number_policy.py's tabulation of transcripts by the range stated before each guess."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies"))
import guess_number_policy  # noqa: E402


def _call(n):
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call>'


def test_tabulate_reads_each_guess_against_the_range_before_it():
    texts = [
        _call(8) + "8 is too high. It is 1 to 7." + _call(9) + "9 is too high. It is 1 to 7." + _call(4),
        _call(8) + "8 is too low. It is 9 to 16." + _call(12),
    ]
    table, made, inside = guess_number_policy.tabulate(texts)
    assert dict(table[(1, 16)]) == {8: 2} and dict(table[(1, 7)]) == {9: 1, 4: 1} and dict(table[(9, 16)]) == {12: 1}
    assert (made, inside) == (5, 4)  # 9 was already ruled out
