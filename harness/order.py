"""The one order policy of interleaved runs: the list of a round runs forwards in even rounds and backwards in odd
ones, so that neither path (nor the baseline, nor a factor) always runs first and a machine's drift hits both.

Why: in the tuning runs' one-pair compares the path run first was the slower one in all but one (docs/tuning.md).
compare.py's pairs, explain's rounds and benchmarks/ds_autotuner.py's head-to-head all use it.
"""

from __future__ import annotations

from collections.abc import Sequence


def round_order(names: Sequence, round_index: int) -> list:
    """`names` in the order round `round_index` (0-based) runs them: as given in even rounds, reversed in odd."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]
