"""One table of metric names (diag.foundations.metricnames): every name a module accepts is a row of it.

A metric is ``cosine_min`` in diag.json, ``cosine`` as a target and a sweep objective and
``--min-cosine`` as a gate. ``diff``, ``gate``, ``evaluate``, ``sweep`` and the CLI derive their
names and directions from the table; these tests fail when one of them accepts a name the table
does not hold, disagrees with it on which way is better, or when a name the table holds is not one
the document, the held-out metrics or the help texts know.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

import pytest

from diag.analysis.compare import CompareOptions
from diag.cli import commands as cli
from diag.cli.verbs import diagnose
from diag.core.feeds import FeedSpec
from diag.fix import evaluate, sweep
from diag.fix.evaluate import HeldOutMetrics, parse_target
from diag.fix.exclude import search_target
from diag.foundations.errors import DiagError
from diag.foundations.metricnames import (
    METRICS,
    gate_flags,
    gates,
    held_out_names,
    labelled_names,
    objective_names,
    output_keys,
    target_names,
)
from diag.report import diff, gate
from diag.report.document import document_from_result
from diag.report.gate import Gates

#: sweep objectives that are not held-out metrics: a recipe's speed and its file's size.
NOT_HELD_OUT = ("latency", "size")


def _subparser(verb: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[verb]


def test_no_name_is_in_two_rows():
    for column in ("key", "target", "objective", "gate"):
        names = [getattr(m, column) for m in METRICS if getattr(m, column) is not None]
        assert len(names) == len(set(names)), f"a {column} in two rows: {names}"


def test_diff_compares_the_tables_keys_in_its_order_and_directions():
    assert list(diff.OUTPUT_METRICS.items()) == list(output_keys().items())


def test_every_gate_bounds_a_tables_key_in_its_direction():
    assert gate.METRIC_GATES.keys() == gate_flags().keys()
    for flag, (key, kind, _) in gate.METRIC_GATES.items():
        row = next(m for m in METRICS if m.gate == flag)
        assert key == row.key
        assert kind == ("min" if row.higher_is_better else "max")
        assert flag.startswith(f"{kind}-"), f"--{flag} bounds a metric where {kind} is the bound"


def test_every_gate_is_a_field_of_gates_and_a_flag_of_diag_check():
    fields = {f.name for f in dataclasses.fields(Gates)} - {"max_grade", "outputs"}
    assert fields == {flag.replace("-", "_") for flag in gate_flags()}
    flags = {s for a in _subparser("check")._actions for s in a.option_strings}
    bounds = {f[2:] for f in flags if re.fullmatch(r"--(min|max)-.+", f)} - {"max-grade"}
    assert bounds == gate_flags().keys()


@pytest.mark.parametrize("flag", list(gate_flags()))
def test_every_gate_is_range_checked_and_lands_in_metric_bounds(flag):
    gates = Gates(**{flag.replace("-", "_"): math.nan})
    assert gates.metric_bounds()[0][0] == flag
    with pytest.raises(DiagError, match=f"--{flag} nan"):
        gates.validate()


def test_every_target_is_the_tables_in_its_direction():
    assert list(evaluate.TARGET_METRICS) == list(target_names())
    for name, higher in target_names().items():
        op, other = (">=", "<=") if higher else ("<=", ">=")
        assert evaluate.TARGET_METRICS[name][0] == op
        assert parse_target(f"{name}{op}0.5").metric == name
        with pytest.raises(DiagError, match="is better"):
            parse_target(f"{name}{other}0.5")
    assert evaluate.WORST.keys() <= target_names().keys()


def test_every_sweep_objective_is_the_tables_in_its_direction():
    assert list(sweep.OBJECTIVES) == list(objective_names())
    for name, higher in objective_names().items():
        assert sweep.OBJECTIVES[name][0] == ("max" if higher else "min")
    choices = next(a.choices for a in _subparser("sweep")._actions if "--objective" in a.option_strings)
    assert list(choices) == list(objective_names())


def test_a_target_and_an_objective_on_one_row_are_one_held_out_figure():
    held_out = {f.name for f in dataclasses.fields(HeldOutMetrics)} | {"accuracy_drop", "f1_drop"}
    for m in METRICS:
        if m.target is not None and m.objective is not None:
            assert m.target == m.objective, m
        for name in (m.target, m.objective):
            if name is not None and name not in NOT_HELD_OUT:
                assert name in held_out, f"{name} is not a HeldOutMetrics figure"
    metrics = HeldOutMetrics(samples=1, cosine=0.9, cosine_mean=0.95, max_abs=0.1, agreement=1.0)
    for name in target_names():
        assert name in metrics.to_dict(), f"{name} is not written where sweep reads it"


def test_every_key_is_in_each_output_of_the_written_document(built):
    """A document written now (the golden file is an older run's, kept as a renderer's input)."""
    b = built("convnet")
    feeds = FeedSpec(inputs=str(b.inputs_path), batch=8)
    result = diagnose(b.fp32, b.int8["qdq"], feeds, CompareOptions(progress=False, effects=0, sensitivity=0))
    outputs = document_from_result(result)["verdict"]["outputs"]
    assert outputs
    for out in outputs:
        assert output_keys().keys() <= out.keys(), f"not in diag.json: {sorted(output_keys().keys() - out.keys())}"


def test_the_help_texts_list_every_target_and_objective():
    for name in target_names():
        assert re.search(rf"^  {name}(>=|<=)V ", cli.EXCLUDE_TARGET_HELP, re.M), name
    for name in objective_names():
        assert re.search(rf"^  {name} ", cli.SWEEP_HELP, re.M), name


def test_every_name_carries_what_its_vocabulary_prints():
    """A row with a gate, a target or an objective carries the texts and bounds that vocabulary needs
    (the help lines would otherwise print a name with nothing after it, or the gate no range)."""
    for m in METRICS:
        assert (m.gate is None) == (m.check is None), (
            f"{m.gate or m.key}: a gate and its help, format, range go together"
        )
        if m.check is not None:
            assert m.check.low < m.check.high and m.check.help and m.check.hint, m
            assert format(0.5, m.check.fmt), m
        if m.target is not None:
            assert m.how and m.worst is not None and m.target_help, f"target {m.target}: how, worst value, help lines"
        if m.objective is not None:
            assert m.what and m.objective_help, f"objective {m.objective}: what it is, help lines"
        assert all(len(line) <= 100 for line in (*m.target_help, *m.objective_help)), m


def test_the_check_flags_say_what_the_table_says():
    actions = {a.option_strings[0]: a for a in _subparser("check")._actions if a.option_strings}
    for flag, (_, _, check) in gates().items():
        action = actions[f"--{flag}"]
        assert (action.metavar, action.help.replace("%%", "%")) == (check.metavar, check.help)


def test_a_nan_output_gives_each_target_its_worst_value():
    measured = {f.name: 0.5 for f in dataclasses.fields(HeldOutMetrics) if f.name in target_names()}
    metrics = HeldOutMetrics(**{"samples": 2, "cosine_mean": 0.5, **measured, "nonfinite_samples": 1})
    for m in METRICS:
        if m.target is not None and not m.labels:
            assert metrics.value(m.target) == m.worst, m.target


@pytest.mark.parametrize("name", sorted(labelled_names()))
def test_a_labelled_target_without_labels_is_refused_before_any_work(name):
    row = next(m for m in METRICS if name in (m.target, m.objective))
    with pytest.raises(DiagError, match="needs --labels"):
        search_target(f"{name}{'>=' if row.higher_is_better else '<='}0.5", None, None, None, None)


def test_the_fix_report_lists_every_held_out_figure_an_evaluation_writes():
    metrics = HeldOutMetrics(
        samples=1, cosine=0.9, cosine_mean=0.95, max_abs=0.1, agreement=1.0, f1_fp32=0.9, f1_int8=0.8
    )
    written = metrics.to_dict()
    assert set(held_out_names()) <= written.keys()
    figures = set(target_names()) | (set(objective_names()) - set(NOT_HELD_OUT))
    assert set(held_out_names()) == figures, "exclude_view's rows are the held-out targets and objectives"
