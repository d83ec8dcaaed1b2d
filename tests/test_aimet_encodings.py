"""AIMET's standard export, FP32 ``.onnx`` + ``.encodings`` (issue 43 item 6).

Ground truth: an onnxruntime static QDQ model's quantization parameters written as an AIMET
encodings file (``fixtures.producers.aimet_encodings``, in each of AIMET's three layouts). The QDQ
model diag builds from the FP32 graph and that file must compute exactly what onnxruntime's model
computes, and ``diag compare`` on the AIMET pair must report the figures ``diag compare`` reports
on onnxruntime's model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli

from diag.core.encodings import qdq_from_encodings, read_encodings
from diag.fixtures import models, producers, quantize

VERSIONS = ("0.6.1", "1.0.0", "2.0.0")


def _outputs(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)


#: (fixture, per-channel weights, weight type): onnxruntime's QInt4 model is a w4a8 export (4-bit
#: weights, 8-bit activations, com.microsoft Q/DQ), as AIMET writes 4-bit parameter encodings.
PAIRS = [
    ("convnet", True, "QInt8"),
    ("convnet", False, "QInt8"),
    ("transformer", True, "QInt8"),
    ("convnet", True, "QInt4"),
]


@pytest.fixture(scope="module", params=PAIRS, ids=str)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    name, per_channel, weight_type = request.param
    d = tmp_path_factory.mktemp(f"aimet-{name}-{per_channel}-{weight_type}")
    fx = models.build(name)
    fp32, qdq = d / "fp32.onnx", d / "qdq.onnx"
    onnx.save(fx.model, fp32)
    quantize.quantize(fp32, qdq, "qdq", fx.make_inputs(16, 3), per_channel=per_channel, weight_type=weight_type)
    feeds = fx.make_inputs(8, 5)
    np.savez(d / "feeds.npz", **feeds)
    for version in VERSIONS:
        (d / f"{version}.encodings").write_text(json.dumps(producers.aimet_encodings(onnx.load(str(qdq)), version)))
    return {"dir": d, "fx": fx, "fp32": fp32, "qdq": qdq, "feeds": feeds}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_model_built_from_encodings_computes_what_the_quantized_model_they_describe_computes(pair, version) -> None:
    d = Path(str(pair["dir"]))
    enc = read_encodings(d / f"{version}.encodings")
    built = qdq_from_encodings(pair["fx"].model, enc)  # type: ignore[attr-defined]
    assert built.skipped == {}
    want = _outputs(Path(str(pair["qdq"])), pair["feeds"])  # type: ignore[arg-type]
    got = _outputs(built.model, pair["feeds"])  # type: ignore[arg-type]
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
    # Weights are integer initializers + DequantizeLinear, as onnxruntime writes them.
    ours = {i.name: i for i in built.model.graph.initializer if i.name.endswith("_quantized")}
    theirs = {i.name: i for i in onnx.load(str(pair["qdq"])).graph.initializer if i.name.endswith("_quantized")}
    assert sorted(ours) == sorted(theirs)
    for k, t in theirs.items():
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(ours[k]), onnx.numpy_helper.to_array(t))


def test_compare_reads_the_encodings_beside_aimets_export_and_reports_that_models_figures(
    pair, capsys: pytest.CaptureFixture[str]
) -> None:
    d = Path(str(pair["dir"]))
    aimet = d / "aimet.onnx"
    aimet.write_bytes(Path(str(pair["fp32"])).read_bytes())
    (d / "aimet.encodings").write_text((d / "1.0.0.encodings").read_text())
    before = aimet.read_bytes()
    code, out, _ = run_cli(
        ["compare", pair["fp32"], aimet, "--inputs", d / "feeds.npz", "--out", d / "a", "--quiet"], capsys
    )
    assert code in (0, 3)
    assert aimet.read_bytes() == before  # the user's file is never touched
    code, _, _ = run_cli(
        ["compare", pair["fp32"], pair["qdq"], "--inputs", d / "feeds.npz", "--out", d / "o", "--quiet"], capsys
    )
    ours, theirs = (json.loads((d / x / "diag.json").read_text()) for x in ("a", "o"))
    int8 = ours["models"]["int8"]
    assert int8["path"] == str(aimet) and int8["format"] == "qdq"
    assert "built by diag from AIMET encodings 'aimet.encodings' (version 1.0.0)" in int8["built"]
    assert int8["producer"] == "Qualcomm AIMET (aimet-onnx)"  # not the onnxruntime layout diag built it in
    assert out.startswith("verdict: ") and "\n  note: INT8 model aimet.onnx built by diag from AIMET encodings" in out
    assert "- note: INT8 model `aimet.onnx` built by diag from AIMET encodings" in (d / "a" / "summary.md").read_text()
    # Every tensor both runs measure, the outputs and the weights: the same figures.
    shared = set(ours["tensors"]) & set(theirs["tensors"])
    assert len(shared) >= 0.6 * len(theirs["tensors"])
    for name in shared:
        a, b = ours["tensors"][name]["accumulated"], theirs["tensors"][name]["accumulated"]
        assert a["sqnr_db"] == pytest.approx(b["sqnr_db"], abs=1e-4), name
    for mine, other in zip(ours["verdict"]["outputs"], theirs["verdict"]["outputs"], strict=True):
        assert mine["cosine_min"] == pytest.approx(other["cosine_min"], abs=1e-6)
    weights = {w["fp_name"]: w["sqnr_db"] for w in ours["weights"]["findings"]}
    assert weights and weights == pytest.approx(
        {w["fp_name"]: w["sqnr_db"] for w in theirs["weights"]["findings"]}, abs=1e-4
    )
    # The command that fixes it names the user's export (diag exclude reads the encodings beside it).
    assert ours["recommendation"]["verify_command"].startswith(f"diag exclude {pair['fp32']} --int8 {aimet} --inputs")


def test_inspect_names_the_encodings_beside_an_fp32_export(pair, capsys: pytest.CaptureFixture[str]) -> None:
    d = Path(str(pair["dir"]))
    model = d / "insp.onnx"
    model.write_bytes(Path(str(pair["fp32"])).read_bytes())
    (d / "insp.encodings").write_text((d / "0.6.1.encodings").read_text())
    code, out, _ = run_cli(["inspect", model], capsys)
    enc = read_encodings(d / "0.6.1.encodings")
    assert code == 0
    line = f"encodings:  AIMET 'insp.encodings' beside it (version 0.6.1, {len(enc.activations)} activation and "
    assert line + f"{len(enc.params)} parameter encodings): diag compare FP32 insp.onnx" in out


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (
            {"name": "image", "enc_type": "VECTOR", "bw": 4, "is_sym": True, "scale": [1.0], "offset": [0]},
            "is VECTOR; diag reads per-tensor, per-channel, per-block, LPBQ",
        ),
        (
            {"name": "image", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": False, "scale": [0.0], "offset": [0]},
            "not positive",
        ),
        (  # 4-, 8-, 16- and 32-bit grids are built; no Q/DQ type holds 12 bits
            {"name": "logits", "enc_type": "PER_TENSOR", "bw": 12, "is_sym": False, "scale": [0.1], "offset": [0]},
            "has an unsigned 12-bit grid",
        ),
        (  # an offset off the 4-bit grid would wrap when stored (9 as INT4 reads back as -7)
            {"name": "logits", "enc_type": "PER_TENSOR", "bw": 4, "is_sym": True, "scale": [0.1], "offset": [-17]},
            "has an offset outside its 4-bit grid (zero point 9..9, the grid -8..7)",
        ),
        (  # names no tensor of the model: said of the user's files, never of diag's built copy
            {"name": "no_such", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": False, "scale": [0.1], "offset": [0]},
            "quantize no tensor of 'bad.onnx' (1 left out; 'no_such': no tensor of that name)",
        ),
    ],
)
def test_encodings_diag_cannot_build_are_one_line_errors(pair, capsys, entry, says) -> None:
    d = Path(str(pair["dir"]))
    bad = d / "bad.onnx"
    bad.write_bytes(Path(str(pair["fp32"])).read_bytes())
    (d / "bad.encodings").write_text(
        json.dumps({"version": "1.0.0", "activation_encodings": [entry], "param_encodings": []})
    )
    code, _, err = run_cli(["compare", pair["fp32"], bad, "--inputs", d / "feeds.npz", "--out", d / "bad"], capsys)
    assert code == 2 and "error[bad-encodings]: encoding" in err and says in err
    assert len(err.strip().splitlines()) == 1 and not (d / "bad").exists()


def test_a_weight_encoding_of_the_wrong_width_is_refused(pair, capsys) -> None:
    d = Path(str(pair["dir"]))
    doc = json.loads((d / "1.0.0.encodings").read_text())
    weight = next(p for p in doc["param_encodings"] if p["name"].endswith("weight"))
    weight["enc_type"], weight["scale"], weight["offset"] = "PER_CHANNEL", [0.1] * 3, [-128] * 3
    wrong = d / "wrong.onnx"
    wrong.write_bytes(Path(str(pair["fp32"])).read_bytes())
    (d / "wrong.encodings").write_text(json.dumps(doc))
    code, _, err = run_cli(["compare", pair["fp32"], wrong, "--inputs", d / "feeds.npz", "--out", d / "w"], capsys)
    assert code == 2 and "error[bad-encodings]" in err
    assert f"encoding of '{weight['name']}' in wrong.encodings | has 3 channels but the weight has" in err


def test_a_verb_that_does_not_read_encodings_says_which_do(pair, capsys) -> None:
    d = Path(str(pair["dir"]))
    model = d / "ex.onnx"
    model.write_bytes(Path(str(pair["fp32"])).read_bytes())
    (d / "ex.encodings").write_text((d / "2.0.0.encodings").read_text())
    code, _, err = run_cli(["inspect", model, "--recipe"], capsys)
    assert code == 2 and "error[not-quantized]" in err and "(AIMET encodings 'ex.encodings' are beside it)" in err
    assert "Hint: diag compare and diag exclude --int8 read AIMET encodings beside the model" in err
    code, _, err = run_cli(
        [
            "compare",
            pair["fp32"],
            pair["qdq"],
            "--encodings",
            d / "ex.encodings",
            "--inputs",
            d / "feeds.npz",
            "--out",
            d / "ex2",
        ],
        capsys,
    )
    assert code == 2 and "error[bad-option]: --encodings" in err
