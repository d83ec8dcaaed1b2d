"""The reduction pool of a comparison: order per accumulator, the held-bytes gate, failures.

`_run_pass` starts a batch's FP32 run while the previous batch's reductions still run
(`_Reductions.wait_below`) and reduces a batch's FP32 sides while its INT8 model runs: these
tests pin the two guarantees that makes safe. Whole-run equality (pooled == inline, bit for bit)
is tests/test_scale.py::test_reductions_overlapping_the_runs_give_the_same_sums_as_a_sequential_loop.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from diag.core.distributions import DistributionAccumulator
from diag.core.metrics import ErrorAccumulator, sum_of_squares
from diag.core.streaming import Job, _Reductions


def test_tasks_of_one_key_run_in_submission_order_on_many_threads():
    pool = _Reductions(4)
    seen: list[int] = []

    def step(i: int) -> None:
        time.sleep((20 - i) * 0.002)  # later tasks are shorter: unordered, they would finish first
        seen.append(i)

    try:
        pool.submit([Job("tensor", step, (i,)) for i in range(20)])
        pool.wait()
    finally:
        pool.close()
    assert seen == list(range(20))


def test_wait_below_blocks_until_the_pending_tasks_hold_few_enough_bytes():
    pool = _Reductions(6)
    gates = [threading.Event() for _ in range(5)]
    passed = threading.Event()
    try:
        pool.submit([Job(f"t{i}", gate.wait, (), holds=100) for i, gate in enumerate(gates)])
        assert pool.held == 500
        waiter = threading.Thread(target=lambda: (pool.wait_below(250), passed.set()))
        waiter.start()
        gates[0].set()
        gates[1].set()
        assert not passed.wait(0.3), "300 bytes still held: wait_below(250) must block"
        gates[2].set()
        assert passed.wait(5), "200 bytes held: wait_below(250) must return"
        waiter.join()
        for gate in gates[3:]:
            gate.set()
        pool.wait()
        assert pool.held == 0
    finally:
        for gate in gates:
            gate.set()
        pool.close()


def test_a_value_two_tasks_read_counts_once_until_the_last_of_them_ends():
    # A tensor's FP32 value is read by its accumulated-error task and its local-error task; the
    # next batch's FP32 run may start only once it is really freed (found in review: counted with
    # the accumulated task alone, it was "freed" while the local task still held it).
    pool = _Reductions(4)
    first, second = threading.Event(), threading.Event()
    fp32 = np.zeros(100, np.float32)  # 400 bytes
    try:
        pool.submit([Job("acc", first.wait, (), holds=10, shared=(fp32,))])
        pool.submit([Job("local", second.wait, (), holds=20, shared=(fp32,))])
        assert pool.held == 430
        first.set()
        deadline = time.monotonic() + 5
        while pool.held != 420 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.held == 420, "the FP32 value is still read by the local task"
        second.set()
        pool.wait()
        assert pool.held == 0
    finally:
        first.set()
        second.set()
        pool.close()


def test_a_failing_task_is_raised_by_the_wait_and_fails_the_next_task_of_its_key():
    pool = _Reductions(2)
    ran: list[str] = []

    def boom() -> None:
        raise ValueError("planted")

    try:
        pool.submit([Job("a", boom, ()), Job("a", ran.append, ("after",)), Job("b", ran.append, ("other",))])
        with pytest.raises(ValueError, match="planted"):
            pool.wait()
        assert pool.held == 0
    finally:
        pool.close()
    assert ran == ["other"]


def test_one_thread_runs_each_task_inline_at_submission():
    pool = _Reductions(1)
    seen: list[int] = []
    started = pool.submit([Job("k", seen.append, (1,), holds=10)])
    assert seen == [1] and started["k"].done() and pool.held == 0
    pool.wait_below(0)


def test_split_halves_equal_one_update_bit_for_bit():
    # The FP32 side reduced apart (while the INT8 model runs) and the INT8 side later must give
    # exactly the state one update gives, including a causal-mask -inf and a planted NaN.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 6, 32)).astype(np.float32)
    x[0, 1, 3] = -np.inf
    y = x + rng.normal(scale=0.01, size=x.shape).astype(np.float32)
    y[1, 2, 4] = np.nan
    for a, b in ((x, y), (x[1], y[0])):
        whole_acc, whole_dist = ErrorAccumulator(), DistributionAccumulator(channel_hint="MatMul")
        whole_acc.update(a, b, 0.02)
        whole_dist.update(a, b, 0.02)
        split_acc, split_dist = ErrorAccumulator(), DistributionAccumulator(channel_hint="MatMul")
        s_xx = sum_of_squares(a)
        assert split_dist.update_fp(a)
        split_acc.update(a, b, 0.02, s_xx=s_xx)
        split_dist.update_int8(b, 0.02)
        assert whole_acc == split_acc
        assert whole_dist.to_state() == split_dist.to_state()
