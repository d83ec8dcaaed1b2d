"""The fixing verbs' flags map to exactly the options they document: every flag to its own field.

Each case parses a real command line with ``diag.cli.commands.build_parser()`` and builds the verb's
options with its builder; every flag is given a value different from its default, so a flag wired
to the wrong field (or dropped) changes the object and fails the test. A second test checks that
each verb passes that very object to its one library call (``diag.cli.verbs``). No model is needed.
"""

from __future__ import annotations

from typing import Any

import pytest

from diag.cli import commands as cli
from diag.core.feeds import FeedSpec
from diag.fix.bench import BenchOptions
from diag.fix.exclude import ExcludeOptions
from diag.fix.quantize import QuantizeOptions
from diag.fix.sweep import SweepOptions
from diag.fix.tiers import TierOptions
from diag.foundations.errors import DiagError

SEARCH_FLAGS = [
    "--target",
    "cosine>=0.98",
    "--holdout",
    "0.25",
    "--labels",
    "labels.npy",
    "--metric",
    "plugin:make",
    "--threads",
    "3",
    "--bench-runs",
    "7",
    "--max-trials",
    "11",
    "--time-budget",
    "13.5",
    "--max-memory",
    "2GB",
    "--quiet",
]
SEARCH_FIELDS: dict[str, Any] = {
    "target": "cosine>=0.98",
    "holdout": 0.25,
    "labels": "labels.npy",
    "metric": "plugin:make",
    "threads": 3,
    "bench_runs": 7,
    "max_trials": 11,
    "time_budget": 13.5,
    "max_memory": 2 * 2**30,
    "progress": False,
}

CASES: list[tuple[str, list[str], Any, Any]] = [
    (
        "exclude",
        ["exclude", "m.onnx", "--random", *SEARCH_FLAGS, "--no-estimates", "--scheduler", "local:2"],
        cli._exclude_options,
        ExcludeOptions(**SEARCH_FIELDS, estimates=False, scheduler="local:2"),
    ),
    (
        "exclude --int8 --requantize",
        ["exclude", "m.onnx", "--random", "--target", "max_abs<=0.1", "--int8", "q.onnx", "--requantize"],
        cli._exclude_options,
        ExcludeOptions("max_abs<=0.1", int8="q.onnx", requantize=True),
    ),
    (
        "exclude (defaults)",
        ["exclude", "m.onnx", "--random", "--target", "max_abs<=0.1"],
        cli._exclude_options,
        ExcludeOptions("max_abs<=0.1", bench_runs=20, progress=True, estimates=True, scheduler=None),
    ),
    (
        "exclude --tiers",
        ["exclude", "m.onnx", "--random", *SEARCH_FLAGS, "--tiers", "int4,int8,fp32"],
        cli._tier_options,
        TierOptions(**SEARCH_FIELDS, tiers="int4,int8,fp32"),
    ),
    (
        "sweep",
        [
            "sweep",
            "m.onnx",
            "--random",
            "--batch",
            "4",
            "--calib",
            "calib.npz",
            "--grid",
            "grid.toml",
            "--objective",
            "latency",
            "--target",
            "cosine>=0.99",
            "--labels",
            "labels.npy",
            "--holdout",
            "0.3",
            "--runs",
            "9",
            "--warmup",
            "2",
            "--repeats",
            "5",
            "--threads",
            "2",
            "--scheduler",
            "local:3",
            "--quiet",
        ],
        cli._sweep_options,
        SweepOptions(
            grid="grid.toml",
            calib=FeedSpec(inputs="calib.npz", batch=4),
            objective="latency",
            target="cosine>=0.99",
            labels="labels.npy",
            holdout=0.3,
            runs=9,
            warmup=2,
            repeats=5,
            threads=2,
            progress=False,
            scheduler="local:3",
        ),
    ),
    (
        "sweep (defaults)",
        ["sweep", "m.onnx", "--random"],
        cli._sweep_options,
        SweepOptions(),
    ),
    (
        "bench",
        [
            "bench",
            "a.onnx",
            "b.onnx",
            "--random",
            "--runs",
            "9",
            "--warmup",
            "2",
            "--threads",
            "3",
            "--json",
            "bench.json",
            "--quiet",
        ],
        cli._bench_options,
        BenchOptions(runs=9, warmup=2, threads=3, progress=False, json_path="bench.json"),
    ),
    ("bench (defaults)", ["bench", "a.onnx", "--random"], cli._bench_options, BenchOptions()),
    (
        "quantize",
        [
            "quantize",
            "m.onnx",
            "--recipe",
            "recipe.json",
            "-o",
            "q.onnx",
            "--calib",
            "calib.npz",
            "--samples",
            "16",
            "--batch",
            "4",
            "--verbose",
            "--quiet",
        ],
        cli._quantize_options,
        QuantizeOptions(
            recipe="recipe.json",
            out="q.onnx",
            calibration=FeedSpec(inputs="calib.npz", batch=4),
            samples=16,
            progress=False,
            verbose=True,
        ),
    ),
    (
        "quantize --reader",
        ["quantize", "m.onnx", "--recipe", "r.json", "-o", "q.onnx", "--reader", "mod:make"],
        cli._quantize_options,
        QuantizeOptions(recipe="r.json", out="q.onnx", calibration=FeedSpec(reader="mod:make")),
    ),
]


@pytest.mark.parametrize(("name", "argv", "build", "expected"), CASES, ids=[c[0] for c in CASES])
def test_every_flag_of_a_fixing_verb_lands_in_its_own_option_field(name, argv, build, expected):
    assert build(cli.build_parser().parse_args(argv)) == expected


def test_the_search_flags_the_tier_search_cannot_honour_are_refused():
    for flag in (["--scheduler", "local:2"], ["--no-estimates"]):
        args = cli.build_parser().parse_args(["exclude", "m.onnx", "--target", "cosine>=0.9", "--tiers", "a", *flag])
        with pytest.raises(DiagError) as e:
            cli._tier_options(args)
        assert e.value.slug == "bad-option" and "with --tiers" in e.value.obj


CALLS = [
    ("diag.cli.verbs.exclude_to_dir", CASES[0][1], 3),
    ("diag.cli.verbs.tier_plan_to_dir", CASES[3][1], 3),
    ("diag.cli.verbs.sweep_to_dir", CASES[4][1], 3),
    ("diag.cli.verbs.bench_to_json", CASES[6][1], 2),
    ("diag.cli.verbs.quantize_to_file", CASES[8][1], 1),
]


@pytest.mark.parametrize(("target", "argv", "position"), CALLS, ids=[c[0].rsplit(".", 1)[1] for c in CALLS])
def test_each_fixing_verb_hands_its_options_to_its_one_library_call(target, argv, position, monkeypatch):
    seen: list[Any] = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[position])
        raise SystemExit(0)

    monkeypatch.setattr(target, fake)
    with pytest.raises(SystemExit):
        cli.main(argv)
    build = next(c[2] for c in CASES if c[1] is argv)
    assert seen == [build(cli.build_parser().parse_args(argv))]
