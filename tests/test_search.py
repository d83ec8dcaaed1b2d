"""The exclusion search's replay: planning a cluster's trials ahead follows the serial search.

Pure Python (no Dask, no model): :func:`diag.search.plan_ahead` replays
:class:`diag.search.SearchAlgorithm` on the answers known so far, so it runs without the dask
extra, unlike the cluster tests that use it.
"""

from __future__ import annotations

import pytest

from diag.search import SearchAlgorithm, plan_ahead


class _Serial(SearchAlgorithm):
    """The serial search's real trials (diag.search.SearchAlgorithm) on a fixed oracle, recording them."""

    def __init__(self, n, oracle, guess):
        self.candidates = list(range(n))
        self.oracle = oracle
        self.guess = guess
        self.asked = []

    def check(self, groups, phase):
        if groups not in self.asked:
            self.asked.append(groups)
        return self.oracle(groups)


@pytest.mark.parametrize("guess", [None, "exact", {1, 2}])
@pytest.mark.parametrize("needed", [{3}, {0, 5, 9}, {2, 3, 4, 5, 6, 7, 8, 9, 10}, set()])
def test_planning_ahead_asks_for_the_serial_searchs_trials_in_its_order(needed, guess):
    def oracle(groups):  # met when every needed group is in float; not monotone in the prefix length
        return needed <= groups and (len(groups) != 7 or not needed)

    n = 12
    # the estimated answer the real trials start from: none, right, or wrong
    start_from = frozenset(needed if guess == "exact" else guess or ()) or None
    serial = _Serial(n, oracle, start_from)
    serial.asked.append(frozenset())  # the baseline, run before the search
    serial.search_real()
    known = {frozenset(): oracle(frozenset())}
    consumed = {frozenset()}
    order = []
    while True:
        ahead = plan_ahead(list(range(n)), known, consumed, len(consumed), None, 4, start_from)
        if not ahead:
            break
        now = ahead[0]
        # whatever the answer to ``now``, the trial after it (if any) was among those planned ahead
        for answer in (False, True):
            known_after = {**known, now: answer}
            after = plan_ahead(list(range(n)), known_after, consumed | {now}, len(consumed) + 1, None, 1, start_from)
            assert not after or after[0] in ahead[1:]
        known[now] = oracle(now)
        consumed.add(now)
        order.append(now)
    assert order == serial.asked[1:]
    # a --max-trials budget the serial search would stop at is never planned past
    start = {frozenset(): oracle(frozenset())}
    assert plan_ahead(list(range(n)), start, {frozenset()}, 5, 5, 4) == []
    assert len(plan_ahead(list(range(n)), start, {frozenset()}, 5, 6, 4)) == 1
