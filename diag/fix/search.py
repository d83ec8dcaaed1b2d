"""The exclusion search: which trial comes next, given the answers so far.

One algorithm, apart from how a trial is answered, and everything that must follow it step for
step:

* :func:`ranked_candidates`: the quantized node groups in the order the searches try them, worst
  local error first (`diag exclude`, `diag exclude --tiers`, `--sensitivity`).
* :class:`SearchAlgorithm`: the smallest met prefix of that order (:func:`shortest_met_prefix`,
  exponential then binary search, which `diag exclude --tiers` runs tier by tier too), then the
  pruning (delta debugging, then single groups). ``diag.fix.exclude._Search`` answers its trials by
  estimating or re-quantizing; :class:`BudgetExhausted` stops it.
* :func:`plan_ahead`: the same algorithm replayed on the answers known so far (:class:`_Replay`),
  to find the trials it will ask for next, so ``diag.fix.cluster`` can run them ahead on workers.

NOTE: the search and its replay are one class, not two copies: the trials a cluster computes
ahead are the ones the serial search asks for, whatever order the tasks finish in. Pure Python:
nothing here quantizes, runs a model or touches a file.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diag.analysis.analyze import NodeFinding
from diag.core.metrics import ErrorStats
from diag.foundations.jsonnum import json_number

#: Decision-tree branches :func:`plan_ahead` replays at most per call (each replay is pure Python).
MAX_REPLAYS = 256


# ---------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """One quantized node group, in ranking order: what ``nodes_to_exclude`` takes to keep it in float."""

    rank: int
    label: str
    op_type: str
    fp_nodes: list[str]
    local_sqnr_db: float | None
    accumulated_sqnr_db: float | None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["local_sqnr_db"] = json_number(self.local_sqnr_db, digits=None, nan=None)
        d["accumulated_sqnr_db"] = json_number(self.accumulated_sqnr_db, digits=None, nan=None)
        return d


def ranked_candidates(findings: list[NodeFinding], already_excluded: set[str]) -> list[Candidate]:
    """Quantized node groups, worst local error first (accumulated error where no local exists).

    Groups already in the recipe's ``nodes_to_exclude`` and unnamed nodes (which
    ``nodes_to_exclude`` cannot name) are left out.

    Example:
        >>> [c.label for c in ranked_candidates(result.findings, set())][:1]  # doctest: +SKIP
        ['layer1/ffn/fc1/MatMul']
    """

    def sqnr(stats: ErrorStats | None) -> float | None:
        return None if stats is None else float(stats.sqnr_db)

    def key(f: NodeFinding) -> tuple[float, int]:
        v = sqnr(f.local)
        if v is None:
            v = sqnr(f.accumulated)
        return (math.inf if v is None or math.isnan(v) else v, f.index)

    usable = [
        f
        for f in findings
        if f.group.quantized and not f.group.unnamed and not set(f.group.fp_nodes) <= already_excluded
    ]
    return [
        Candidate(
            r,
            f.group.label,
            f.group.op_types[0] if f.group.op_types else "?",
            list(f.group.fp_nodes),
            sqnr(f.local),
            sqnr(f.accumulated),
        )
        for r, f in enumerate(sorted(usable, key=key), 1)
    ]


# ---------------------------------------------------------------- the search


def shortest_met_prefix(met: Callable[[int], bool], longest: int, start: int = 0) -> int | None:
    """The shortest prefix length ``k`` (``start < k <= longest``) with ``met(k)``: exponential, then binary search.

    ``start``: a length known to miss. None when every length tried up to ``longest`` misses.
    About 2·log2(longest) calls. NOTE: one prefix search for every search over a ranking (`diag
    exclude`'s :class:`SearchAlgorithm`, each tier of `diag exclude --tiers`), so they ask for the
    same lengths in the same order.

    Example:
        >>> asked = []
        >>> shortest_met_prefix(lambda k: asked.append(k) or k >= 5, 12)
        5
        >>> asked
        [1, 2, 4, 8, 6, 5]
    """
    lo, hi, k = start, None, max(1, 2 * start)
    while k <= longest:
        if met(k):
            hi = k
            break
        lo = k
        if k == longest:
            break
        k = min(2 * k, longest)
    if hi is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if met(mid):
            hi = mid
        else:
            lo = mid
    return hi


class BudgetExhausted(Exception):
    """``--max-trials`` or ``--time-budget`` stopped the search (not a user error: a result)."""


class SearchAlgorithm:
    """The exclusion search itself, apart from how a trial is answered.

    Subclasses answer :meth:`check` (does this set of groups in float meet the target?) and
    :meth:`expect`: ``diag.fix.exclude._Search`` by estimating or re-quantizing, :class:`_Replay`
    from answers already known (to run the trials the search will ask for next ahead of time).
    One algorithm, so the two can never drift apart.
    """

    candidates: list[Candidate]
    #: The estimated answer (``_Search.find``): the real search starts from it. None: no estimate.
    guess: frozenset[int] | None = None

    def check(self, groups: frozenset[int], phase: str) -> bool:
        raise NotImplementedError

    def expect(self, remaining: int) -> None:
        """Progress: about ``remaining`` more trials (no-op by default)."""

    def search_real(self) -> frozenset[int] | None:
        """The real trials: verify and prune the estimated answer, or search from it.

        When the re-quantized guess meets the target each of its groups is re-included once (a
        real try each), so the answer is minimal in real terms too. When it misses (an estimate
        is not exact: rounding of fused kernels, a Concat's shared scale), the prefix search runs
        with the guessed groups ranked first, starting above them. Without a guess: the prefix
        search over the ranking, then the pruning.
        """
        order = list(range(len(self.candidates)))
        start = 0
        guess = self.guess
        if guess:
            if self.check(guess, "verify"):
                return self.prune(guess, blocks=False)
            order = sorted(guess) + [i for i in order if i not in guess]
            start = len(guess)
        k = self.smallest_prefix(order, start)
        return self.prune(frozenset(order[:k])) if k is not None else None

    def smallest_prefix(self, order: list[int], start: int = 0) -> int | None:
        """Exponential then binary search for the shortest met prefix of ``order`` shorter than all of it.

        ``start``: a prefix length known to miss (the search begins above it).
        """
        n = len(order)
        self.expect(2 * math.ceil(math.log2(max(n, 2))))
        return shortest_met_prefix(lambda k: self.check(frozenset(order[:k]), "search"), n - 1, start)

    def prune(self, current: frozenset[int], blocks: bool = True) -> frozenset[int]:
        """Shrink the met prefix to a list where re-including any group misses the target.

        First blocks are re-included at once, least suspicious half first, and split only when
        the block as a whole is needed (delta debugging): m needed groups among k cost about
        2·m·log2(k/m) tries instead of k, which matters when a noisy metric made the prefix long.
        Then single groups are re-included in passes until a pass removes nothing, so every
        group left was tried against the final list itself; tries already made come from the
        cache. ``blocks=False`` skips the block phase (a list already believed minimal: about k
        tries instead of 2k).
        """
        k = len(current)
        self.expect(2 * math.ceil(math.log2(k + 1)) + k)

        def drop(block: list[int]) -> None:
            nonlocal current
            trial = current - set(block)
            if trial != current and self.check(trial, "prune"):
                current = trial
                return
            if len(block) > 1:
                mid = len(block) // 2
                drop(block[mid:])
                drop(block[:mid])

        if k > 1 and blocks:
            drop(sorted(current))
        changed = True
        while changed:
            changed = False
            order = sorted(current, reverse=True)
            for j, i in enumerate(order):
                self.expect(len(order) - j)
                trial = current - {i}
                if self.check(trial, "prune"):
                    current = trial
                    changed = True
        return current


# ---------------------------------------------------------------- the replay


class _Need(Exception):
    def __init__(self, groups: frozenset[int]) -> None:
        self.groups = groups


class _Stop(Exception):
    """The replayed search would stop here (budget)."""


class _Replay(SearchAlgorithm):
    """Replays the exclusion search's real trials on known answers.

    It *is* the serial algorithm (:class:`SearchAlgorithm`, the same code line for
    line, not a copy that could drift from it); only :meth:`check` differs: a known answer, or
    :class:`_Need` for the first unknown one.
    """

    def __init__(
        self,
        candidates: list[Any],
        guess: frozenset[int] | None,
        answers: dict[frozenset[int], bool],
        consumed: set[frozenset[int]],
        quantizations: int,
        max_trials: int | None,
    ) -> None:
        self.candidates = candidates
        self.guess = guess
        self.answers = answers
        self.consumed = consumed
        self.quantizations = quantizations
        self.max_trials = max_trials

    def check(self, groups: frozenset[int], phase: str) -> bool:
        if groups not in self.consumed:
            if self.max_trials is not None and self.quantizations >= self.max_trials:
                raise _Stop
            self.quantizations += 1
            self.consumed = self.consumed | {groups}
        if groups in self.answers:
            return self.answers[groups]
        raise _Need(groups)

    def run(self) -> None:
        self.search_real()


def plan_ahead(
    candidates: list[Candidate],
    known: dict[frozenset[int], bool],
    consumed: set[frozenset[int]],
    quantizations: int,
    max_trials: int | None,
    limit: int,
    guess: frozenset[int] | None = None,
) -> list[frozenset[int]]:
    """The trials the exclusion search may need next, the one it needs now first.

    ``guess``: the search's estimated answer (``_Search.guess``), where its real trials start.

    The search is replayed on the answers known so far; where it needs an unknown answer, both
    answers are assumed in turn (breadth first, "missed" first: most trials of a pruning pass
    miss) to find the trials after it. Whatever the real answers turn out to be, the search asks
    for its trials in the serial order; this only decides what is computed before it asks.

    Example:
        >>> baseline = frozenset()  # ran, missed the target
        >>> plan_ahead(list(range(8)), {baseline: False}, {baseline}, 1, None, 3)
        [frozenset({0}), frozenset({0, 1}), frozenset({0, 1, 2, 3})]

        Prefix 1 now; prefix 2 if it misses (if it meets, the search is done: pruning a one-group
        list only re-tries the baseline); prefix 4 if 2 misses too.
    """
    out: list[frozenset[int]] = []
    queue: deque[dict[frozenset[int], bool]] = deque([{}])
    replays = 0
    while queue and len(out) < limit and replays < MAX_REPLAYS:
        assumed = queue.popleft()
        replays += 1
        replay = _Replay(candidates, guess, {**known, **assumed}, consumed, quantizations, max_trials)
        try:
            replay.run()
        except _Need as need:
            if need.groups not in out:
                out.append(need.groups)
            queue.append({**assumed, need.groups: False})
            queue.append({**assumed, need.groups: True})
        except _Stop:
            pass
    return out
