"""A real Paddle export (RapidOCR's cls MobileNet) quantized by NNCF itself, read by diag as is.

NNCF (``nncf.quantize``, its ONNX backend) places its own Q/DQ pairs, calibrates, corrects biases
and names the model's unnamed nodes. diag must say who made the model, pair every FP32 tensor with
NNCF's, and name nodes as NNCF does, or ``nncf.IgnoredScope(names=[...])`` would not find them.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from diag.cli.commands import main
from diag.fixtures import thirdparty


@pytest.fixture(scope="module")
def cls_by_nncf(tmp_path_factory) -> tuple[str, str, str, onnx.ModelProto]:
    """(FP32 path, NNCF INT8 path, inputs path, the FP32 model as loaded) for the cls model."""
    root = tmp_path_factory.mktemp("nncf-cls")
    fp32 = str(thirdparty.rapidocr_model("cls"))
    model = onnx.load(fp32)
    calibration = thirdparty.one_sample_batches({"x": thirdparty.text_images(16, 48, 192, seed=3)})
    q = thirdparty.nncf_quantized(model, calibration)
    int8 = str(root / "cls.nncf.onnx")
    onnx.save(q, int8)
    x = str(root / "x.npz")
    np.savez(x, x=thirdparty.text_images(8, 48, 192, seed=5))
    return fp32, int8, x, model


@pytest.fixture(scope="module")
def compared(cls_by_nncf, tmp_path_factory) -> dict:
    """diag.json of ``diag compare`` on the export and NNCF's model."""
    fp32, int8, x, _ = cls_by_nncf
    out = tmp_path_factory.mktemp("nncf-cmp")
    assert main(["compare", fp32, int8, "--inputs", x, "--batch", "4", "--quiet", "--out", str(out)]) in (0, 3)
    return json.loads((out / "diag.json").read_text())


def test_inspect_says_nncf_made_it_by_its_marks(cls_by_nncf, capsys) -> None:
    fp32, int8, _, model = cls_by_nncf
    assert model.SerializeToString() == onnx.load(fp32).SerializeToString(), "NNCF renamed the caller's model"
    assert main(["inspect", int8]) == 0
    lines = capsys.readouterr().out.splitlines()
    made = next(line for line in lines if line.startswith("made by:"))
    assert made.startswith("made by:    NNCF (tensor name 'dq_output_x_1'"), made
    assert "producer PaddlePaddle" in next(line for line in lines if line.startswith("opsets:"))


def test_compare_pairs_every_tensor_and_names_nodes_as_nncf_does(cls_by_nncf, compared) -> None:
    int8, doc = cls_by_nncf[1], compared
    matching = doc["matching"]
    assert matching["coverage"] == 1.0 and not matching["unmatched_tensors"] and matching["compared"] > 200, matching
    # diag's labels for the FP32 nodes are the names NNCF's graph has (the export leaves some
    # unnamed and NNCF names them), so an IgnoredScope built from diag's answer names nodes NNCF finds.
    nncf_names = {n.name for n in onnx.load(int8).graph.node}
    convs = [n["name"] for n in doc["nodes"] if n["op_type"] == "Conv"]
    assert len(convs) == 53 and set(convs) <= nncf_names, sorted(set(convs) - nncf_names)[:5]
    assert doc["verdict"]["headline"]["kind"] in ("single-cause", "lever", "refuted", "spread"), doc["verdict"]["cause"]


def test_the_op_type_levers_of_an_nncf_model_are_worded_as_nncf_switches(compared) -> None:
    """An NNCF user cannot set onnxruntime's op_types_to_quantize: a measured op-type group is named
    by NNCF's own switch, ``nncf.IgnoredScope(types=[...])``."""
    doc = compared
    groups = (doc["effects"] or {}).get("groups") or []
    conv = next(g for g in groups if g["label"].startswith("every quantized Conv"))
    assert conv["lever"] == "NNCF quantizes every Conv", conv
    assert conv["fix"] == "nncf.IgnoredScope(types=['Conv']) in your nncf.quantize call", conv
    assert not [g for g in groups if "op_types_to_quantize" in g["lever"] + g["fix"]], groups
    if doc["verdict"]["headline"]["kind"] == "lever":
        assert "op_types_to_quantize" not in doc["verdict"]["cause"], doc["verdict"]["cause"]


def test_weights_nncf_smoothquant_rescaled_are_compared_as_rescaled() -> None:
    """Issue 43 item 2 on a real NNCF run: ``ModelType.TRANSFORMER`` inserts ``nncf_smooth_quant``
    Muls and quantizes ``W / v``. Every such weight's figure is its error against ``W / v``,
    recomputed with numpy from NNCF's file (it read -12 dB against ``W`` before)."""
    from diag.analysis.weights import weight_report
    from diag.fixtures import models

    fx = models.build("transformer")
    q = thirdparty.nncf_quantized(fx.model, thirdparty.one_sample_batches(fx.make_inputs(16, 3)), transformer=True)
    inits = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in q.graph.initializer}
    fp = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in fx.model.graph.initializer}
    producer = {o: n for n in q.graph.node for o in n.output}
    report = weight_report(fx.model, q)
    found = {w.fp_name: w for w in report.findings}
    smoothed = 0
    for mm in (n for n in q.graph.node if n.op_type == "MatMul" and n.input[1].startswith("dq_output_")):
        act_q = producer[producer[mm.input[0]].input[0]]
        mul = producer.get(act_q.input[0])
        if mul is None or not mul.name.endswith("nncf_smooth_quant"):
            continue
        wdq = producer[mm.input[1]]
        w_q, scale, zp = (inits[x] for x in wdq.input)
        axis = next((a.i for a in wdq.attribute if a.name == "axis"), 1) % w_q.ndim
        shape = [1, 1]
        shape[axis] = -1
        deq = (w_q - zp.reshape(shape)) * scale.reshape(shape)
        name = wdq.input[0].removeprefix("q_output_").removesuffix("_1")
        truth = fp[name] / inits[mul.input[1]].reshape(-1, 1)
        want = 10 * np.log10((truth**2).sum() / ((deq - truth) ** 2).sum())
        assert found[name].sqnr_db == pytest.approx(want, abs=0.1), name
        assert found[name].sqnr_db > 35 and mul.name in (found[name].folded or "")
        smoothed += 1
    assert smoothed >= 8
    # The inserted Muls are listed as NNCF's, strongest first, with the channel each shrinks most.
    muls = {n.name: n for n in q.graph.node if n.name.endswith("nncf_smooth_quant")}
    assert {s.mul for s in report.smoothing} == set(muls)
    first = report.smoothing[0]
    v = inits[muls[first.mul].input[1]].reshape(-1)
    assert first.strongest_channel == int(np.argmin(v)) and first.divided_by == pytest.approx(1 / v.min())
    assert first.divided_by == max(s.divided_by for s in report.smoothing)


def test_nncfs_bias_correction_is_reported_as_the_producers_not_as_error() -> None:
    """Issue 43 item 3: NNCF's fast bias correction changes float biases on purpose; diag lists exactly
    the biases that differ from the FP32 model's, with the change numpy measures on the two files."""
    from diag.analysis.weights import weight_report
    from diag.fixtures import models

    fx = models.build("transformer")
    q = thirdparty.nncf_quantized(fx.model, thirdparty.one_sample_batches(fx.make_inputs(16, 3)), transformer=True)
    fp = {t.name: onnx.numpy_helper.to_array(t) for t in fx.model.graph.initializer}
    mine = {t.name: onnx.numpy_helper.to_array(t) for t in q.graph.initializer}
    changed = {k for k in fp if k.endswith(".bias") and k in mine and not np.array_equal(fp[k], mine[k])}
    report = weight_report(fx.model, q)
    assert changed and {b.name for b in report.bias_corrections} == changed
    for b in report.bias_corrections:
        assert b.max_change == pytest.approx(float(np.abs(mine[b.name].astype(np.float64) - fp[b.name]).max()))
        assert b.name not in {w.fp_name for w in report.findings}  # not counted as quantization error
