"""Every verb's flags map onto the options of its one library call, field by field.

Real command lines go through ``commands.build_parser`` and the verb's options builder
(``cli.<verb>_options``); no model is read. Every flag gets a value that differs from its default
and from every other flag's, so a flag wired to the wrong field (or not wired) fails, and a
verb's bare command line must give the library's own defaults, so the CLI and the library
document the same defaults. exclude / sweep / bench / quantize are tested with their options
objects elsewhere.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from diag.analysis.compare import CompareOptions
from diag.cli import commands as cli
from diag.cli.verbs import (
    DemoOptions,
    InspectOptions,
    LintOptions,
    MergeOptions,
    ReportOptions,
)
from diag.core.feeds import FeedSpec
from diag.foundations.metricnames import gates
from diag.report.diff import DiffOptions
from diag.report.gate import CheckOptions, Gates

FEED_FLAGS = ["--inputs", "x.npz", "--random", "--reader", "mod:factory", "--samples", "5", "--batch", "2"]
FEED_FLAGS += ["--seed", "7", "--shape", "x=2,3", "--shape", "y=4", "--int-range", "3,30522"]

# --ort-opt-level is --deploy-level's old name: one field, the last given wins.
COMPARE_FLAGS = ["--out", "outdir", "--ort-opt-level", "basic", "--deploy-level", "extended", "--threads", "3"]
COMPARE_FLAGS += ["--max-memory", "4GB"]
COMPARE_FLAGS += ["--shard", "1/4", "--reductions", "graph", "--no-local", "--no-distributions"]
COMPARE_FLAGS += ["--outlier-factor", "9.5", "--sensitivity", "4", "--recipe", "r.json"]
COMPARE_FLAGS += ["--output-kind", "logits=probabilities", "--effects", "6", "--effect-samples", "11"]
COMPARE_FLAGS += ["--accuracy-level-check", "4", "--labels", "y.npy", "--metric", "plug:metric"]
COMPARE_FLAGS += ["--scheduler", "local:2", "--deploy-isa", "avx2", "--quiet", "--local-samples", "13"]
# --mask-input with --no-mask is refused by the run, not by the parser
COMPARE_FLAGS += ["--mask-input", "am", "--no-mask", "--encodings", "m.encodings", "--settings", "always"]

#: One value per metric gate (diag.foundations.metricnames' table: a new gate is tested without a new line here),
#: each different from the others, so a flag wired to another gate's field fails.
GATE_VALUES = {flag: 0.25 + i / 64 for i, flag in enumerate(gates())}
CHECK_FLAGS = [a for flag, value in GATE_VALUES.items() for a in (f"--{flag}", str(value))]
CHECK_FLAGS += ["--max-grade", "marginal", "--output", "logits", "--output", "boxes"]

#: (verb, every flag given, the options expected, a bare command line, the defaults expected)
CASES: list[tuple[str, list[str], Any, list[str], Any]] = [
    (
        "compare",
        ["a.onnx", "b.onnx", *FEED_FLAGS, *COMPARE_FLAGS],
        CompareOptions(
            opt_level="extended",
            threads=3,
            max_memory=4 * 1024**3,
            shard=(1, 4),
            local=False,
            local_samples=13,
            progress=False,
            labels="y.npy",
            distributions=False,
            outlier_factor=9.5,
            sensitivity=4,
            recipe="r.json",
            output_kinds={"logits": "probabilities"},
            effects=6,
            effect_samples=11,
            accuracy_level_check=4,
            deploy_isa="avx2",
            metric="plug:metric",
            reductions="graph",
            scheduler="local:2",
            mask_input="am",
            no_mask=True,
            encodings="m.encodings",
            settings="always",
        ),
        ["a.onnx", "b.onnx"],
        CompareOptions(),
    ),
    (
        "inspect",
        ["m.onnx", "--recipe", "--recipe-out", "r.toml"],
        InspectOptions("m.onnx", recipe=True, recipe_out="r.toml"),
        ["m.onnx"],
        InspectOptions("m.onnx"),
    ),
    (
        "merge",
        ["p0/diag.json", "p1/diag.json", "--out", "all", "--fp32", "f.onnx", "--int8", "q.onnx"],
        MergeOptions(("p0/diag.json", "p1/diag.json"), out="all", fp32="f.onnx", int8="q.onnx"),
        ["p0/diag.json"],
        MergeOptions(("p0/diag.json",)),
    ),
    (
        "report",
        ["run/diag.json", "--out", "one.html"],
        ReportOptions("run/diag.json", out="one.html"),
        ["run/diag.json"],
        ReportOptions("run/diag.json"),
    ),
    (
        "demo",
        ["--out", "d", "--fixture", "convnet", "--format", "qdq", "--samples", "9", "--no-fix", "--quiet"],
        DemoOptions(out="d", fixture="convnet", format="qdq", samples=9, progress=False, fix=False),
        [],
        DemoOptions(),
    ),
    (
        "check",
        ["run/diag.json", *CHECK_FLAGS],
        CheckOptions(
            "run/diag.json",
            Gates(
                **{flag.replace("-", "_"): value for flag, value in GATE_VALUES.items()},
                max_grade="marginal",
                outputs=("logits", "boxes"),
            ),
        ),
        ["run/diag.json"],
        CheckOptions("run/diag.json", Gates()),
    ),
    (
        "diff",
        ["a.json", "b.json", "--top", "4", "--json"],
        DiffOptions("a.json", "b.json", top=4, as_json=True),
        ["a.json", "b.json"],
        DiffOptions("a.json", "b.json"),
    ),
    (
        "lint",
        ["r.toml", "--model", "f.onnx", "--inputs", "x.npz", "--batch", "4", "--no-measure", "--threads", "3"],
        LintOptions("r.toml", model="f.onnx", inputs=FeedSpec(inputs="x.npz", batch=4), measure=False, threads=3),
        ["r.toml"],
        LintOptions("r.toml"),
    ),
]


def _options(verb: str, argv: list[str]) -> Any:
    args = cli.build_parser().parse_args([verb, *argv])
    return getattr(cli, f"{verb}_options")(args)


def _flags_of(verb: str) -> set[str]:
    """Every option string of a verb's subparser (its --debug, --custom-op-library and -h are the CLI's own)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[verb]._actions
    return {s for a in actions for s in a.option_strings if a.dest not in ("help", "debug", "custom_op_library")}


@pytest.mark.parametrize(("verb", "argv", "expected", "bare", "defaults"), CASES, ids=[c[0] for c in CASES])
def test_every_flag_lands_in_its_own_field(verb: str, argv: list[str], expected: Any, bare: Any, defaults: Any):
    assert _options(verb, argv) == expected
    given = {a for a in argv if a.startswith("-")}
    assert _flags_of(verb) - given == set(), "a flag this test does not set: give it a value and its field"


@pytest.mark.parametrize(("verb", "argv", "expected", "bare", "defaults"), CASES, ids=[c[0] for c in CASES])
def test_a_bare_command_line_gives_the_librarys_defaults(
    verb: str, argv: Any, expected: Any, bare: list[str], defaults: Any
):
    assert _options(verb, bare) == defaults


def test_every_verb_of_the_registry_is_covered_here_or_with_the_fixing_verbs():
    from test_verb_flags_fix import CASES as FIX_CASES

    fixing = {argv[0] for _, argv, _, _ in FIX_CASES}
    assert fixing == {"exclude", "sweep", "bench", "quantize"}
    assert {c[0] for c in CASES} | fixing == set(cli.VERBS)


def test_the_parser_has_one_subparser_per_registered_verb_with_its_docstring_as_help():
    """The registry is the one list of verbs: the subparsers, their order and their help derive from it."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(cli.VERBS)
    listed = {a.dest: a.help for a in sub._choices_actions}
    for name, verb in cli.VERBS.items():
        assert sub.choices[name].description == verb.description and verb.description
        assert listed[name] == verb.help and "\n" not in verb.help and verb.help.endswith(".")
    handlers = {name for name in vars(cli) if name.startswith("cmd_")}
    assert handlers == {v.handler.__name__ for v in cli.VERBS.values()}, "a cmd_<verb> no verb is registered with"


def test_compare_inputs_flags_map_onto_the_feed_spec():
    args = cli.build_parser().parse_args(["compare", "a.onnx", "b.onnx", *FEED_FLAGS])
    assert cli.feed_spec(args) == FeedSpec(
        inputs="x.npz",
        random=True,
        reader="mod:factory",
        samples=5,
        batch=2,
        seed=7,
        shapes={"x": (2, 3), "y": (4,)},
        int_range=(3, 30522),
    )
    bare = cli.build_parser().parse_args(["compare", "a.onnx", "b.onnx"])
    assert cli.feed_spec(bare) == FeedSpec()


def test_sensitivity_without_a_value_takes_the_top_5():
    assert _options("compare", ["a.onnx", "b.onnx", "--sensitivity"]).sensitivity == 5


def test_compare_makes_one_library_call_with_its_positionals_and_options(monkeypatch):
    seen: list[tuple[Any, ...]] = []

    def fake_compare_to_dir(*args: Any) -> Any:
        seen.append(args)
        raise SystemExit(0)

    monkeypatch.setattr("diag.cli.verbs.compare_to_dir", fake_compare_to_dir)
    argv = ["compare", "a.onnx", "b.onnx", *FEED_FLAGS, *COMPARE_FLAGS]
    with pytest.raises(SystemExit):
        cli.main(argv)
    args = cli.build_parser().parse_args(argv)
    assert seen == [("a.onnx", "b.onnx", cli.feed_spec(args), "outdir", cli.compare_options(args))]
