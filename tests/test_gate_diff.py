"""`diag check` (CI gate) and `diag diff` on real runs: a transformer quantized twice, the second time
with the fixture's culprit in ``nodes_to_exclude``, both compared on the same inputs."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from diag.cli import commands as cli
from diag.fixtures import models, quantize
from diag.foundations.errors import GATE_FAILED, OK, USER_ERROR
from diag.report.diff import OUTPUT_METRICS, diff_documents
from diag.report.gate import Gates, check_document
from diag.report.view import OUTPUT_NAMES, load_document


class Runs:
    """Two real `diag compare` runs: ``base`` (everything quantized) and ``excl`` (culprit kept in FP32)."""

    def __init__(self, folder: Path) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        fx = models.transformer()
        self.culprit = fx.expected.culprit_node
        assert self.culprit is not None
        fp32 = folder / "fp32.onnx"
        onnx.save(fx.model, fp32)
        # reduce_range: 7-bit weights keep onnxruntime's u8s8 kernels exact on CPUs without VNNI,
        # so both runs give the same figures on every CI machine.
        quantize.quantize(fp32, folder / "base.onnx", "dynamic", reduce_range=True)
        logging.getLogger().setLevel(logging.ERROR)
        # Same settings as the base model, plus the exclusion.
        quantize_dynamic(
            fp32,
            folder / "excl.onnx",
            weight_type=QuantType.QInt8,
            reduce_range=True,
            nodes_to_exclude=[self.culprit],
        )
        np.savez(folder / "in.npz", **fx.make_inputs(32, 12))
        for name in ("base", "excl"):
            argv = ["compare", str(fp32), str(folder / f"{name}.onnx"), "--inputs", str(folder / "in.npz")]
            assert cli.main([*argv, "--batch", "8", "--out", str(folder / name), "--quiet"]) == OK
        self.base = folder / "base" / "diag.json"
        self.excl = folder / "excl" / "diag.json"
        self.folder = folder

    def doc(self, name: str = "base") -> dict[str, Any]:
        return load_document(self.base if name == "base" else self.excl)

    def write(self, doc: dict[str, Any], name: str) -> Path:
        path = self.folder / name
        path.write_text(json.dumps(doc))
        return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("gate_diff"))


def _check(capsys: pytest.CaptureFixture[str], path: Path, *flags: str) -> tuple[int, list[str], str]:
    code = cli.main(["check", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _logits(doc: dict[str, Any]) -> dict[str, Any]:
    (out,) = doc["verdict"]["outputs"]
    assert out["name"] == "logits"
    return out


# ---------------------------------------------------------------- diag check


def test_check_passes_with_exit_0_and_prints_every_gate(runs, capsys):
    o = _logits(runs.doc())
    flags = [
        "--min-sqnr",
        str(o["sqnr_db"] - 1),
        "--min-cosine",
        str(round(o["cosine_min"] - 0.001, 6)),
        "--max-abs",
        str(o["max_abs"] * 2),
        "--min-agreement",
        str(o["top1_agreement"]),  # equal to the bound passes
        "--max-grade",
        "reject",
    ]
    code, lines, err = _check(capsys, runs.base, *flags)
    assert code == OK, (lines, err)
    assert [line.split(":")[0] for line in lines] == [
        "PASS min-sqnr",
        "PASS min-cosine",
        "PASS max-abs",
        "PASS min-agreement",
        "PASS max-grade",
        "check passed",
    ]
    assert lines[1] == (
        f"PASS min-cosine: output 'logits' cosine_min {o['cosine_min']:.5f} >= {round(o['cosine_min'] - 0.001, 6):g}"
        " (margin 0.00100)"
    )
    assert lines[3].endswith("(margin 0.00000)")
    assert lines[-1] == "check passed: 5 passed, 0 failed, 0 skipped"


@pytest.mark.parametrize(
    ("flag", "key", "offset", "word"),
    [
        ("--min-sqnr", "sqnr_db", +2.5, "short by 2.50"),
        ("--min-cosine", "cosine_min", +0.0025, "short by 0.00250"),
        ("--max-abs", "max_abs", -0.0125, "over by 0.0125"),
        ("--min-agreement", "top1_agreement", +0.02, "short by 0.02000"),
    ],
)
def test_each_failing_metric_gate_exits_3_and_says_by_how_much(runs, capsys, flag, key, offset, word):
    value = _logits(runs.doc())[key]
    bound = round(value + offset, 6)
    code, lines, _ = _check(capsys, runs.base, flag, str(bound), "--max-grade", "reject")
    assert code == GATE_FAILED
    fail = [line for line in lines if line.startswith("FAIL")]
    assert len(fail) == 1
    op = "<" if flag.startswith("--min") else ">"
    assert fail[0].startswith(f"FAIL {flag[2:]}: output 'logits' {key} ")
    assert f" {op} {bound:g} ({word})" in fail[0]
    assert "PASS max-grade: model grade" in lines[1]  # the other gate is still printed
    assert lines[-1] == "check FAILED: 1 passed, 1 failed, 0 skipped"


def test_max_grade_gate_fails_by_the_number_of_bands(runs, capsys):
    doc = runs.doc()
    assert doc["verdict"]["grade"] == "marginal"  # the fixture's defect costs two bands, not more
    code, lines, _ = _check(capsys, runs.base, "--max-grade", "excellent")
    assert code == GATE_FAILED
    assert lines == [
        "FAIL max-grade: model grade marginal is worse than excellent (by 2 bands)",
        "check FAILED: 0 passed, 1 failed, 0 skipped",
    ]
    doc["verdict"]["grade"] = "reject"
    code, lines, _ = _check(capsys, runs.write(doc, "reject.json"), "--max-grade", "acceptable")
    assert code == GATE_FAILED and lines[0].endswith("worse than acceptable (by 2 bands)")


def test_accuracy_gate_without_labels_is_skipped_per_output_and_fails_overall(runs, capsys):
    code, lines, _ = _check(capsys, runs.base, "--max-accuracy-drop", "0.01")
    assert code == GATE_FAILED
    assert lines[0].startswith("SKIP max-accuracy-drop: output 'logits' has no accuracy drop")
    assert lines[1] == (
        "FAIL max-accuracy-drop: model accuracy_drop is not applicable to any output ('logits'); the gate cannot pass"
    )


def test_accuracy_gate_with_labels_passes_or_fails_on_the_drop(runs, capsys):
    doc = runs.doc()
    _logits(doc).update(accuracy_fp32=0.9, accuracy_int8=0.88, accuracy_drop=0.02)
    path = runs.write(doc, "labels.json")
    assert _check(capsys, path, "--max-accuracy-drop", "0.05")[0] == OK
    code, lines, _ = _check(capsys, path, "--max-accuracy-drop", "0.005")
    assert code == GATE_FAILED
    assert lines[0] == "FAIL max-accuracy-drop: output 'logits' accuracy_drop 0.02000 > 0.005 (over by 0.01500)"


def test_agreement_gate_skips_non_class_like_output_but_gates_the_class_like_one(runs, capsys):
    doc = runs.doc()
    agreement = _logits(doc)["top1_agreement"]
    emb = copy.deepcopy(_logits(doc))
    emb.update(name="embedding", top1_agreement=None)
    doc["verdict"]["outputs"].append(emb)
    path = runs.write(doc, "two_outputs.json")
    code, lines, _ = _check(capsys, path, "--min-agreement", str(agreement - 0.01))
    assert code == OK
    assert lines[0].startswith("PASS min-agreement: output 'logits' top1_agreement")
    assert lines[1] == (
        "SKIP min-agreement: output 'embedding' has no top-1 agreement (not class-like); gate not applied"
    )
    assert lines[2] == "check passed: 1 passed, 0 failed, 1 skipped"
    # Restricted to the embedding, the gate measures nothing and must fail, not pass vacuously.
    code, lines, _ = _check(capsys, path, "--min-agreement", "0.5", "--output", "embedding")
    assert code == GATE_FAILED
    assert lines[1] == (
        "FAIL min-agreement: model top1_agreement is not applicable to any output ('embedding'); the gate cannot pass"
    )


def test_nan_fails_and_infinite_sqnr_passes(runs):
    doc = runs.doc()
    _logits(doc).update(cosine_min="nan", sqnr_db="inf")
    results = check_document(doc, Gates(min_cosine=-1.0, min_sqnr=1000.0))
    assert [(r.gate, r.status) for r in results] == [("min-sqnr", "pass"), ("min-cosine", "fail")]
    assert results[0].line() == "PASS min-sqnr: output 'logits' sqnr_db inf >= 1000"
    assert "not a number" in results[1].line()


@pytest.mark.parametrize(
    ("flags", "slug"),
    [
        ([], "bad-option"),  # no gate given
        (["--min-cosine", "1.5"], "bad-option"),
        (["--min-agreement", "99"], "bad-option"),  # a percentage where a fraction is expected
        (["--max-abs", "-1"], "bad-option"),
        (["--min-sqnr", "20", "--output", "nope"], "bad-option"),
    ],
)
def test_check_user_errors_exit_2_with_a_slug(runs, capsys, flags, slug):
    code, lines, err = _check(capsys, runs.base, *flags)
    assert code == USER_ERROR and lines == []
    assert err.startswith(f"diag: error[{slug}]: ") and "Hint:" in err


def test_check_bad_files_exit_2(runs, capsys, tmp_path):
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"schema": "something/else"}')
    doc = runs.doc()
    doc["schema_version"] = 99
    future = runs.write(doc, "future.json")
    cases = [
        (tmp_path / "missing.json", "missing-file"),
        (tmp_path / "junk.json", "bad-report"),
        (tmp_path / "other.json", "bad-report"),
        (future, "bad-report"),
    ]
    for path, slug in cases:
        code, lines, err = _check(capsys, path, "--min-sqnr", "20")
        assert (code, lines) == (USER_ERROR, []), path
        assert err.startswith(f"diag: error[{slug}]: "), err


def test_check_and_diff_flags_map_onto_one_library_call_each(monkeypatch):
    import diag.report.diff
    import diag.report.gate

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(diag.report.gate, "check_file", lambda path, gates: calls.append((path, gates)) or [])
    argv = ["check", "x.json", "--max-abs", "0.1", "--min-sqnr", "20", "--min-agreement", "0.99"]
    argv += ["--min-cosine", "0.9", "--max-accuracy-drop", "0.02", "--max-grade", "marginal", "--output", "logits"]
    assert cli.main(argv) == OK
    assert calls == [
        (
            "x.json",
            Gates(
                min_sqnr=20.0,
                min_cosine=0.9,
                max_abs=0.1,
                min_agreement=0.99,
                max_accuracy_drop=0.02,
                max_grade="marginal",
                outputs=("logits",),
            ),
        )
    ]
    assert calls[0][1].metric_bounds()[0] == ("min-sqnr", 20.0)  # fixed order, not flag order
    empty = diag.report.diff.DocumentDiff("a", "b", ("excellent", "excellent", "same"))
    monkeypatch.setattr(diag.report.diff, "diff_files", lambda a, b, top: calls.append((a, b, top)) or empty)
    assert cli.main(["diff", "a.json", "b.json", "--top", "4"]) == OK
    assert calls[-1] == ("a.json", "b.json", 4)


# ---------------------------------------------------------------- diag diff


def test_diff_reports_the_excluded_culprit_as_no_longer_quantized_and_cosine_better(runs):
    base, excl = runs.doc("base"), runs.doc("excl")
    d = diff_documents(base, excl)
    left = [c for c in d.status_changes if c.quantized == (True, False)]
    assert [c.name for c in left] == [runs.culprit]
    assert left[0].role[0] == "root-cause" and left[0].role[1] != "root-cause"
    cos = next(m for m in d.outputs if m.metric == "cosine_min")
    assert cos.change == "better"
    assert cos.delta == pytest.approx(_logits(excl)["cosine_min"] - _logits(base)["cosine_min"])
    assert cos.delta > 0
    sqnr = next(m for m in d.outputs if m.metric == "sqnr_db")
    assert sqnr.change == "better" and sqnr.delta > 0
    # The culprit's local error vanishes (kept in FP32): the largest local change there is.
    assert d.sqnr_changes["local"][0].name == runs.culprit
    assert d.exclude == ([runs.culprit], [])
    assert d.settings == {"int8.path": (str(runs.folder / "base.onnx"), str(runs.folder / "excl.onnx"))}
    assert d.environment == {}


def test_diff_sign_conventions_max_abs_down_and_grade_up_are_better(runs):
    base = runs.doc()
    worse = copy.deepcopy(base)
    o = _logits(worse)
    o["max_abs"] = _logits(base)["max_abs"] * 2
    o["sqnr_db"] = _logits(base)["sqnr_db"] - 3
    worse["verdict"]["grade"] = "reject"
    d = diff_documents(base, worse)
    change = {m.metric: m.change for m in d.outputs}
    assert change["max_abs"] == "worse" and change["sqnr_db"] == "worse" and change["cosine_min"] == "same"
    assert d.grade == ("marginal", "reject", "worse")
    back = diff_documents(worse, base)
    assert {m.metric: m.change for m in back.outputs}["max_abs"] == "better"
    assert back.grade[2] == "better"


def test_diff_lists_version_changes_and_nodes_in_one_run_only(runs):
    a, b = runs.doc(), runs.doc()
    a["environment"]["onnxruntime"] = "1.17.0"
    a["environment"]["date"] = "2020-01-01 00:00 UTC"  # volatile: never reported
    dropped = b["nodes"].pop(3)["name"]
    d = diff_documents(a, b)
    assert d.environment == {"onnxruntime": ("1.17.0", b["environment"]["onnxruntime"])}
    assert d.nodes_only == {"a": [dropped], "b": []}
    assert d.status_changes == [] and {m.change for m in d.outputs} == {"same"}
    text = d.lines()
    assert f"environment onnxruntime: 1.17.0 -> {b['environment']['onnxruntime']}" in text
    assert f"nodes only in a (1): {dropped}" in text
    assert text[-1].endswith("no metric moved")
    b["verdict"]["outputs"][0]["name"] = "scores"
    renamed = diff_documents(a, b)
    assert renamed.outputs_only == {"a": ["logits"], "b": ["scores"]} and renamed.outputs == []
    assert "outputs only in b: scores" in renamed.lines()


def test_diff_cli_text_and_json(runs, capsys):
    assert cli.main(["diff", str(runs.base), str(runs.excl), "--top", "3"]) == OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [f"a: {runs.base}", f"b: {runs.excl}", "grade: marginal -> excellent (better)"]
    i = next(k for k, line in enumerate(lines) if line.startswith("nodes whose status changed (a -> b): "))
    # The excluded culprit comes first; its victims only changed role.
    assert lines[i + 1] == f"  {runs.culprit} (MatMul): no longer quantized, role root-cause -> ok"
    assert all(": role victim -> " in x for x in lines[i + 2 : i + 4])
    assert lines[i + 4].startswith("  ... and ")  # --top 3
    cos = next(line for line in lines if line.strip().startswith("cosine_min"))
    assert cos.endswith("better")
    j = lines.index("largest accumulated SQNR changes (dB):")
    assert [x.endswith("better)") for x in lines[j + 1 : j + 5]] == [True, True, True, False]  # --top 3
    k = lines.index("largest local SQNR changes (dB):")
    # Local error is local: only the excluded node's changed (to inf: kept in FP32, no error).
    local = next(n["local"]["sqnr_db"] for n in runs.doc()["nodes"] if n["name"] == runs.culprit)
    assert lines[k + 1 : k + 3] == [f"  {runs.culprit}: {local:.1f} -> inf (+inf, better)", lines[k + 2]]
    assert not lines[k + 2].startswith("  ")
    # The summary counts the metric lines (as many as diag.foundations.metricnames has keys the run measured).
    moved = [x.split()[-1] for x in lines if x.startswith("  ") and x.split()[0] in OUTPUT_METRICS]
    assert moved.count("better") >= 5 and "worse" not in moved
    summary = f"summary: grade better; {moved.count('better')} output metric(s) better, 0 worse; 1 node(s) no longer"
    assert lines[-1].startswith(summary)

    assert cli.main(["diff", str(runs.base), str(runs.excl), "--json"]) == OK
    data = json.loads(capsys.readouterr().out)
    assert list(data)[:5] == ["schema", "schema_version", "a", "b", "grade"]
    assert data["grade"] == {"a": "marginal", "b": "excellent", "change": "better"}
    assert data["status_changes"][0] == {
        "name": runs.culprit,
        "op_type": "MatMul",
        "quantized": [True, False],
        "role": ["root-cause", "ok"],
    }
    assert [c["name"] for c in data["status_changes"] if c["quantized"][0] != c["quantized"][1]] == [runs.culprit]
    assert len(data["status_changes"]) > 3  # JSON has them all, --top only limits the text
    assert data["sqnr_changes"]["local"][0]["b"] == "inf"
    assert data["nodes_to_exclude"] == {"a": [runs.culprit], "b": []}


def test_diff_user_errors_exit_2(runs, capsys, tmp_path):
    assert cli.main(["diff", str(runs.base), str(tmp_path / "nope.json")]) == USER_ERROR
    assert capsys.readouterr().err.startswith("diag: error[missing-file]: ")
    assert cli.main(["diff", str(runs.base), str(runs.excl), "--top", "0"]) == USER_ERROR
    assert capsys.readouterr().err.startswith("diag: error[bad-option]: --top 0 ")


def test_readme_failing_check_example_is_real_output(tmp_path, monkeypatch, capsys):
    """test_readme runs only examples that exit 0; this one runs the docs' exit-3 example (diag check's page)."""
    from diag.cli.demo import run_demo

    readme = (Path(__file__).resolve().parents[1] / "docs" / "verbs" / "check.md").read_text().splitlines()
    start = readme.index("A failing run (exit code 3):") + 4
    end = readme.index("```", start)
    command, expected = readme[start - 1], readme[start:end]
    assert command.startswith("diag check demo/diag.json ")
    monkeypatch.chdir(tmp_path)
    demo = run_demo("demo", progress=False)
    capsys.readouterr()
    # one Summary, no tuple: the lines diag demo prints (the comparison's, then the fix's), and both verbs' own
    # compare writes the report set; the fix's overlay of kept-in-float nodes is the exclusion's
    written = {n: Path("demo", n) for n in OUTPUT_NAMES if n != "modelexplorer.kept_in_float.json"}
    assert demo.files == demo.result.compare.files == written
    assert demo.lines[:-2] == demo.result.compare.lines
    assert demo.lines[-1] == "wrote the fix's report: demo/fix/report.html"
    assert demo.result.fix.files["exclusion.json"] == Path("demo/fix/exclusion.json")
    assert demo.result.fix.result.reachable
    assert cli.main(command.split()[1:]) == GATE_FAILED
    assert capsys.readouterr().out.splitlines() == expected
