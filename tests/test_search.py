"""The searches' order of trials, on fixed oracles: no model, no Dask.

Planning a cluster's trials ahead (:func:`diag.fix.search.plan_ahead`, which replays
:class:`diag.fix.search.SearchAlgorithm` on the answers known so far) asks for the serial search's
trials in its order; the tier search (`diag exclude --tiers`) moves up a tier only when every
group one tier up misses.
"""

from __future__ import annotations

import pytest

from diag.fix.search import SearchAlgorithm, plan_ahead
from diag.fix.tiers import _TierSearch


class _Serial(SearchAlgorithm):
    """The serial search's real trials (diag.fix.search.SearchAlgorithm) on a fixed oracle, recording them."""

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


class _TierOracle(_TierSearch):
    """The tier search (levels per ranked group) on a fixed oracle instead of re-quantizing, recording its trials."""

    def __init__(self, n, oracle):
        self.candidates = list(range(n))
        self.tiers = ["int4", "int8", "fp32"]
        self.oracle = oracle
        self.asked = []

    def trial(self, levels, phase):
        self.asked.append((phase, levels))
        return None, self.oracle(levels)


def test_the_tier_search_tries_every_group_one_tier_up_before_the_tier_above():
    # met only with every group at int8 or above: the int8 prefix search must reach all 4 groups
    # (not stop one short, as the top tier does) and never try fp32
    search = _TierOracle(4, lambda levels: all(lv >= 1 for lv in levels))
    assert search.search() == (1, 1, 1, 1)
    assert [levels for phase, levels in search.asked if phase == "search"] == [
        (1, 0, 0, 0),
        (1, 1, 0, 0),
        (1, 1, 1, 1),
        (1, 1, 1, 0),
    ]
    # met only with group 2 in fp32: every int8 prefix misses, then the fp32 prefix search runs on top
    # of all groups at int8 and stops one short of all of them (all at fp32 is the FP32 model)
    search = _TierOracle(4, lambda levels: levels[2] == 2)
    assert search.search() == (0, 0, 2, 0)
    assert [levels for phase, levels in search.asked if phase == "search"] == [
        (1, 0, 0, 0),
        (1, 1, 0, 0),
        (1, 1, 1, 1),
        (2, 1, 1, 1),
        (2, 2, 1, 1),
        (2, 2, 2, 1),
    ]
