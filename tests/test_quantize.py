"""Guarded quantization with real onnxruntime: formats, exclusions, guards, clean folders, real-model traps."""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import diag.fix.modelprep
from diag.cli.commands import main
from diag.core.feeds import FeedSpec
from diag.core.load import detect_format
from diag.core.recipe import Recipe
from diag.fix.quantize import default_opset, lift_constants, quantize_model, upgrade_opset
from diag.fixtures import models
from diag.foundations.errors import DiagError

QDQ = Recipe(quant_format="QDQ", activation_type="QUInt8")
QOPERATOR = Recipe(quant_format="QOperator", activation_type="QUInt8")
DYNAMIC = Recipe(mode="dynamic")


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("convnet")
    fx = models.build("convnet")
    onnx.save(fx.model, folder / "convnet.onnx")
    np.savez(folder / "calib.npz", **fx.make_inputs(8, 11))
    return {"fp32": folder / "convnet.onnx", "calib": folder / "calib.npz"}


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point tempfile (and so onnxruntime's own temp folders) at a folder the test can inspect."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _nodes(path: Path) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in onnx.load(str(path)).graph.node}


@pytest.mark.parametrize(("recipe", "kind"), [(DYNAMIC, "dynamic"), (QDQ, "qdq"), (QOPERATOR, "qoperator")])
def test_each_mode_writes_a_loadable_model_of_that_format(
    convnet: dict[str, Path],
    tmp_path: Path,
    private_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    recipe: Recipe,
    kind: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    before = _sha(convnet["fp32"])
    calib = FeedSpec(inputs=str(convnet["calib"])) if recipe.mode == "static" else None
    report = quantize_model(convnet["fp32"], recipe, tmp_path / "out" / "int8.onnx", calib)
    assert report.output == tmp_path / "out" / "int8.onnx"
    assert report.format == kind
    assert detect_format(onnx.load(str(report.output))).kind == kind
    ort.InferenceSession(str(report.output), providers=["CPUExecutionProvider"])
    assert report.actions[-1] == f"verified: the INT8 model loads in onnxruntime (format {kind})"
    if recipe.mode == "static":
        assert "calibrated with MinMax on 8 sample(s) from calib.npz (8 samples, batch 1)" in report.actions
    assert not any(a.startswith("note: onnxruntime warns") for a in report.actions), "QUInt8 activations are fine"
    assert _sha(convnet["fp32"]) == before, "the FP32 model is never modified"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "scratch"], "nothing left in the current folder"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["int8.onnx"], "no temp file next to the output"
    assert list(private_tmp.iterdir()) == [], "onnxruntime's and diag's temp folders are removed"
    assert report.output.stat().st_mode & 0o044, "readable by others like any file the user writes"
    assert not any("Please consider" in a for a in report.actions), "onnxruntime's log stays out of the actions"


@pytest.mark.parametrize("recipe", [DYNAMIC, QDQ])
def test_nodes_to_exclude_keeps_the_node_in_float(convnet: dict[str, Path], tmp_path: Path, recipe: Recipe) -> None:
    calib = FeedSpec(inputs=str(convnet["calib"])) if recipe.mode == "static" else None
    plain = _nodes(quantize_model(convnet["fp32"], recipe, tmp_path / "plain.onnx", calib).output)
    excluded = _nodes(
        quantize_model(convnet["fp32"], recipe.with_excluded(["conv3"]), tmp_path / "x.onnx", calib).output
    )
    # Quantized, conv3 is a ConvInteger (dynamic) or a Conv reading a dequantized weight (QDQ) ...
    assert "conv3" not in plain or plain["conv3"].input[1] != "conv3.weight"
    # ... excluded, it is the FP32 Conv reading the FP32 weight, while conv2 is still quantized.
    assert excluded["conv3"].op_type == "Conv" and excluded["conv3"].input[1] == "conv3.weight"
    assert "conv2" not in excluded or excluded["conv2"].input[1] != "conv2.weight"


def test_recipe_calibration_path_is_relative_to_the_recipe_file(convnet: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    np.savez(tmp_path / "cfg" / "c.npz", **np.load(convnet["calib"]))
    recipe = tmp_path / "cfg" / "r.json"
    recipe.write_text('{"quant_format": "QDQ", "calibration": "c.npz", "calibration_samples": 3}')
    report = quantize_model(convnet["fp32"], recipe, tmp_path / "q.onnx")
    assert "calibrated with MinMax on 3 sample(s) from c.npz (3 samples, batch 1)" in report.actions
    report = quantize_model(convnet["fp32"], recipe, tmp_path / "q.onnx", samples=5)
    assert "calibrated with MinMax on 5 sample(s) from c.npz (5 samples, batch 1)" in report.actions


def test_calibration_from_a_reader_a_folder_or_a_feed_source_honours_samples(
    convnet: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diag.core.feeds import feed_source

    arrays = dict(np.load(convnet["calib"]))
    (tmp_path / "calib").mkdir()
    for i in range(4):
        np.savez(tmp_path / "calib" / f"{i}.npz", image=arrays["image"][i : i + 1])
    (tmp_path / "calib_reader.py").write_text(
        "import numpy as np\n"
        f"DATA = np.load({str(convnet['calib'])!r})['image']\n"
        "class Reader:\n"
        "    def __init__(self):\n"
        "        self.rows = iter([{'image': DATA[i : i + 1]} for i in range(len(DATA))])\n"
        "    def get_next(self):\n"
        "        return next(self.rows, None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fp32 = convnet["fp32"]
    via_reader = quantize_model(fp32, QDQ, tmp_path / "r.onnx", FeedSpec(reader="calib_reader:Reader"), samples=5)
    assert "calibrated with MinMax on 5 sample(s) from reader calib_reader:Reader" in via_reader.actions
    via_folder = quantize_model(fp32, QDQ, tmp_path / "f.onnx", FeedSpec(inputs=str(tmp_path / "calib")))
    assert "calibrated with MinMax on 4 sample(s) from folder calib (4 feed files)" in via_folder.actions
    source = feed_source(onnx.load(str(fp32)), FeedSpec(inputs=str(convnet["calib"]), batch=3))
    via_source = quantize_model(fp32, QDQ, tmp_path / "s.onnx", source, samples=4)
    assert "calibrated with MinMax on 4 sample(s) from calib.npz (8 samples, batch 3)" in via_source.actions


@pytest.mark.parametrize(
    ("recipe", "slug", "expected"),
    [
        (QDQ, "bad-recipe", "needs calibration inputs and none were given"),
        (DYNAMIC.with_excluded(["conv_3"]), "bad-recipe", "did you mean 'conv3'?"),
        (Recipe(mode="dynamic", op_types_to_quantize=["Matmul"]), "bad-recipe", "did you mean 'MatMul'?"),
        (Recipe(mode="dynamic", weight_type="QUint8"), "bad-recipe", "did you mean 'QUInt8'?"),
    ],
)
def test_recipe_mistakes_onnxruntime_would_ignore_are_errors(
    convnet: dict[str, Path], tmp_path: Path, recipe: Recipe, slug: str, expected: str
) -> None:
    with pytest.raises(DiagError) as e:
        quantize_model(convnet["fp32"], recipe, tmp_path / "q.onnx")
    assert e.value.slug == slug and expected in str(e.value)
    assert not (tmp_path / "q.onnx").exists()


def test_extra_options_onnxruntime_does_not_read_are_warned_about(convnet: dict[str, Path], tmp_path: Path) -> None:
    recipe = Recipe(mode="dynamic", extra_options={"WeightSymetric": True, "QuantizationPrecision": "int8"})
    report = quantize_model(convnet["fp32"], recipe, tmp_path / "q.onnx")
    assert report.actions[0].startswith("warning: extra_options key 'WeightSymetric' is not read by onnxruntime ")
    assert report.actions[0].endswith("it has no effect (did you mean 'WeightSymmetric'?)")
    assert report.actions[1].endswith(
        "'QuantizationPrecision' is not read by onnxruntime " + ort.__version__ + ": it has no effect"
    )
    ok = quantize_model(
        convnet["fp32"], Recipe(mode="dynamic", extra_options={"WeightSymmetric": True}), tmp_path / "k.onnx"
    )
    assert not any("extra_options" in a for a in ok.actions)


def test_quantizer_failure_is_one_line_and_writes_nothing(convnet: dict[str, Path], tmp_path: Path) -> None:
    recipe = Recipe(quant_format="QOperator", activation_type="QInt16")
    with pytest.raises(DiagError) as e:
        quantize_model(convnet["fp32"], recipe, tmp_path / "out" / "q.onnx", FeedSpec(inputs=str(convnet["calib"])))
    assert e.value.slug == "quantize-failed"
    assert "quantize_static | raised ValueError: Only QuantFormat.QDQ supports 16-bit quantization types." in str(
        e.value
    )
    assert list((tmp_path / "out").iterdir()) == []


def test_op_types_the_model_lacks_are_allowed_but_quantizing_nothing_is_said(
    convnet: dict[str, Path], tmp_path: Path
) -> None:
    report = quantize_model(convnet["fp32"], Recipe(mode="dynamic", op_types_to_quantize=["LSTM"]), tmp_path / "q.onnx")
    assert report.format == "fp32"
    assert report.actions[-2].startswith("warning: no operator was quantized")


def test_a_recipe_node_that_pre_processing_fuses_away_is_warned_about(tmp_path: Path) -> None:
    h, tp = onnx.helper, onnx.TensorProto
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        *(onnx.numpy_helper.from_array(rng.random(4).astype(np.float32) + 0.5, n) for n in ("s", "b", "m", "v")),
    ]
    graph = h.make_graph(
        [
            h.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            h.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["bn"], name="bn"),
            h.make_node("Relu", ["bn"], ["y"], name="relu"),
        ],
        "g",
        [h.make_tensor_value_info("x", tp.FLOAT, [1, 3, 8, 8])],
        [h.make_tensor_value_info("y", tp.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), tmp_path / "bn.onnx")
    recipe = Recipe(mode="dynamic", preprocess=True, nodes_to_exclude=["bn"])
    report = quantize_model(tmp_path / "bn.onnx", recipe, tmp_path / "q.onnx")
    assert any(
        a.startswith("warning: 1 nodes_to_exclude name(s) no longer exist after pre-processing (bn)")
        for a in report.actions
    )
    assert "bn" not in _nodes(report.output)


def test_output_may_not_overwrite_the_input_and_dynamic_takes_no_calibration(
    convnet: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(DiagError) as e:
        quantize_model(convnet["fp32"], DYNAMIC, convnet["fp32"])
    assert e.value.slug == "bad-out"
    with pytest.raises(DiagError) as e:
        quantize_model(convnet["fp32"], DYNAMIC, tmp_path / "q.onnx", FeedSpec(inputs=str(convnet["calib"])))
    assert e.value.slug == "bad-option" and "mode is 'dynamic'" in str(e.value)


def test_an_int8_model_is_refused_as_input(convnet: dict[str, Path], tmp_path: Path) -> None:
    q = quantize_model(convnet["fp32"], DYNAMIC, tmp_path / "q.onnx").output
    with pytest.raises(DiagError) as e:
        quantize_model(q, DYNAMIC, tmp_path / "qq.onnx")
    assert e.value.slug == "fp32-is-quantized"


def test_constant_node_weights_are_lifted_and_said(tmp_path: Path) -> None:
    fx = models.build("convnet")
    m = onnx.ModelProto()
    m.CopyFrom(fx.model)
    weights = [t for t in m.graph.initializer if t.name.endswith(".weight")]
    for t in weights:  # what paddle2onnx does: weights as Constant nodes
        m.graph.node.insert(0, onnx.helper.make_node("Constant", [], [t.name], name=f"const_{t.name}", value=t))
        m.graph.initializer.remove(t)
    onnx.save(m, tmp_path / "consts.onnx")
    report = quantize_model(tmp_path / "consts.onnx", DYNAMIC, tmp_path / "q.onnx")
    # Only the weights quantize_dynamic reads (the 3 Conv weights): the Gemm's, which it does not
    # quantize, stays the Constant the export wrote (issue 42 item 4: no rewrite for a false reason).
    assert report.actions[0].startswith("lifted 3 Constant node(s) to initializers")
    nodes = _nodes(report.output)
    assert [n.name for n in nodes.values() if n.op_type == "Constant" and n.name.startswith("const_")] == [
        "const_fc.weight"
    ]
    assert sum(n.op_type == "ConvInteger" for n in nodes.values()) == 3


def test_inspect_warns_about_constants_only_where_they_hold_quantizable_weights(tmp_path: Path) -> None:
    """A standard export's shape and scalar Constants quantize fine: no warning (issue 42 item 4)."""
    from diag.core.load import constant_weights, model_summary

    fx = models.build("convnet")
    m = onnx.ModelProto()
    m.CopyFrom(fx.model)
    fc = next(t for t in m.graph.initializer if t.name == "fc.weight")
    m.graph.node.insert(0, onnx.helper.make_node("Constant", [], [fc.name], name="const_fc", value=fc))
    m.graph.initializer.remove(fc)  # a Gemm weight: quantize_dynamic does not quantize Gemm
    onnx.save(m, tmp_path / "gemm_const.onnx")
    assert constant_weights(m, "dynamic") == [] and constant_weights(m, "static") == ["fc.weight"]
    assert not [p for p in model_summary(tmp_path / "gemm_const.onnx").problems if "Constant" in p]
    conv = next(t for t in m.graph.initializer if t.name == "conv2.weight")
    m.graph.node.insert(0, onnx.helper.make_node("Constant", [], [conv.name], name="const_conv2", value=conv))
    m.graph.initializer.remove(conv)
    onnx.save(m, tmp_path / "conv_const.onnx")
    said = [p for p in model_summary(tmp_path / "conv_const.onnx").problems if "Constant" in p]
    assert said == [
        "1 Constant node(s) hold weights of quantizable nodes (e.g. 'conv2.weight'): quantize_dynamic fails with "
        "'Expected ... to be an initializer' on them; diag quantize lifts them to initializers (or run "
        "onnxruntime's quant_pre_process first)"
    ]


def test_lift_constants_never_modifies_its_argument() -> None:
    m = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.ones(2, np.float32)))],
            "g",
            [],
            [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [2])],
        )
    )
    lifted, n = lift_constants(m)
    assert n == 1 and len(m.graph.node) == 1 and len(lifted.graph.node) == 0
    assert [t.name for t in lifted.graph.initializer] == ["c"]


def test_external_data_model_is_quantized_with_external_data_next_to_the_output(
    convnet: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(
        onnx.load(str(convnet["fp32"])),
        src / "m.onnx",
        save_as_external_data=True,
        location="m.onnx.data",
        size_threshold=0,
    )
    assert (src / "m.onnx.data").exists()
    before = {p.name: _sha(p) for p in src.iterdir()}
    # NOTE: diag.core.load.model_from_path runs onnx.checker on a weight-free proto, which resolves the
    # .data file against the current folder: from any other folder a valid model is refused
    # (reported). Run from the model's folder until the loader is fixed.
    monkeypatch.chdir(src)
    report = quantize_model(src / "m.onnx", QDQ, tmp_path / "out" / "q.onnx", FeedSpec(inputs=str(convnet["calib"])))
    assert any("use_external_data_format=True" in a for a in report.actions)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["q.onnx", "q.onnx.data"]
    ort.InferenceSession(str(report.output), providers=["CPUExecutionProvider"])
    assert {p.name: _sha(p) for p in src.iterdir()} == before


def test_preprocess_without_sympy_runs_without_symbolic_shapes_and_says_so(
    convnet: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sympy", None)  # import sympy -> ImportError, as when not installed
    monkeypatch.delitem(sys.modules, "onnxruntime.tools.symbolic_shape_infer", raising=False)
    recipe = Recipe(mode="dynamic", preprocess=True)
    report = quantize_model(convnet["fp32"], recipe, tmp_path / "q.onnx")
    assert report.actions[0] == (
        "ran quant_pre_process with skip_symbolic_shape=True because sympy is not installed "
        "(pip install sympy to enable symbolic shape inference)"
    )
    assert report.format == "dynamic"


def test_preprocess_with_sympy_runs_in_full(convnet: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("sympy", reason="sympy is in the test extras; without it the test above covers the path")
    report = quantize_model(convnet["fp32"], Recipe(mode="dynamic", preprocess=True), tmp_path / "q.onnx")
    assert report.actions[0] == "ran quant_pre_process (shape inference and graph optimization) before quantizing"


def test_cli_prints_actions_and_one_success_line(
    convnet: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q.onnx"
    code = main(
        [
            *("quantize", str(convnet["fp32"]), "--recipe", '{"quant_format": "QOperator"}', "-o", str(out)),
            *("--calib", str(convnet["calib"]), "--samples", "4", "--quiet"),
        ]
    )
    stdout = capsys.readouterr().out.splitlines()
    assert code == 0
    assert stdout[0] == "calibrated with MinMax on 4 sample(s) from calib.npz (4 samples, batch 1)"
    assert stdout[1].startswith("note: onnxruntime warns that QOperator with QInt8 activations and weights is slow")
    assert stdout[2] == "verified: the INT8 model loads in onnxruntime (format qoperator)"
    assert stdout[-1].startswith(f"wrote {out} (qoperator) in ")
    assert not any("Please consider" in line for line in stdout), "onnxruntime's advice only with --verbose"
    code = main(["quantize", str(convnet["fp32"]), "--recipe", '{"mode": "dynamic"}', "-o", str(out), "--verbose"])
    assert code == 0 and any(line.startswith("onnxruntime: ") for line in capsys.readouterr().out.splitlines())


# ---------------------------------------------------------------- real PaddleOCR models (PyPI wheel)


@pytest.mark.slow
def test_det_per_channel_qdq_on_opset_12_is_upgraded_and_preprocess_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PP-OCRv4 det: Constant weights, opset 12 with per-channel QDQ, and symbolic shape inference failing."""
    monkeypatch.chdir(tmp_path)  # the failing symbolic shape inference writes into the current folder
    pytest.importorskip("sympy", reason="the symbolic-shape failure needs sympy (in the test extras)")
    from diag.fixtures.thirdparty import rapidocr_model, text_images

    det = rapidocr_model("det")
    before = _sha(det)
    np.savez(tmp_path / "calib.npz", x=text_images(2, 64, 64))
    recipe = Recipe(activation_type="QUInt8", per_channel=True, preprocess=True, calibration="calib.npz")
    recipe.base_dir = str(tmp_path)
    report = quantize_model(det, recipe, tmp_path / "det.int8.onnx")
    # The float Constants quantized nodes read (318 of the export's 342; the rest are shapes and scalars).
    assert report.actions[0].startswith("lifted 318 Constant node(s) to initializers")
    assert report.actions[1].startswith("upgraded opset 12 -> 13 with onnx.version_converter: per-channel QDQ")
    assert report.actions[2] == (
        "ran quant_pre_process with skip_symbolic_shape=True because symbolic shape inference failed "
        "(Incomplete symbolic shape inference)"
    )
    assert report.actions[-1] == "verified: the INT8 model loads in onnxruntime (format qdq)"
    q = onnx.load(str(report.output))
    assert default_opset(q) >= 13
    assert any(n.op_type == "DequantizeLinear" and any(a.name == "axis" for a in n.attribute) for n in q.graph.node)
    assert _sha(det) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.npz", "det.int8.onnx"]


@pytest.mark.slow
def test_the_opset_trap_is_real_without_the_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: onnxruntime alone writes a per-channel QDQ model that does not load on opset 11 (cls)."""
    from onnxruntime.quantization import QuantType, quantize_static

    from diag.fixtures.thirdparty import rapidocr_model, text_images

    cls_model = rapidocr_model("cls")
    lifted, _ = lift_constants(onnx.load(str(cls_model)))
    onnx.save(lifted, tmp_path / "lifted.onnx")
    images = text_images(2, 48, 192)

    class Reader:
        def __init__(self) -> None:
            self.rows = iter([{"x": images[i : i + 1]} for i in range(len(images))])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.rows, None)

    quantize_static(
        tmp_path / "lifted.onnx", tmp_path / "raw.onnx", Reader(), per_channel=True, activation_type=QuantType.QUInt8
    )
    with pytest.raises(Exception, match="axis"):
        ort.InferenceSession(str(tmp_path / "raw.onnx"), providers=["CPUExecutionProvider"])
    np.savez(tmp_path / "calib.npz", x=images)
    report = quantize_model(
        cls_model,
        Recipe(per_channel=True, activation_type="QUInt8", preprocess=True),
        tmp_path / "cls.onnx",
        FeedSpec(inputs=str(tmp_path / "calib.npz")),
    )
    assert any(a.startswith("upgraded opset 11 -> 13") for a in report.actions)
    # The > 2 GB path: the same conversion without weights in the converter, weights put back by name.
    monkeypatch.setattr(diag.fix.modelprep, "STRIP_WEIGHTS_BYTES", 0)
    upgraded = upgrade_opset(lifted)
    assert {
        t.name: t.raw_data for t in upgraded.graph.initializer if t.name in {i.name for i in lifted.graph.initializer}
    } == {t.name: t.raw_data for t in lifted.graph.initializer}
    feed = {"x": images[:1]}
    want = ort.InferenceSession(str(tmp_path / "lifted.onnx"), providers=["CPUExecutionProvider"]).run(None, feed)
    got = ort.InferenceSession(upgraded.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert (
        "ran quant_pre_process with skip_symbolic_shape=True because symbolic shape inference failed "
        "(AssertionError in _infer_Concat)"
    ) in report.actions
    ort.InferenceSession(str(report.output), providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_dynamic_on_paddle_constant_weights_fails_raw_and_works_guarded(tmp_path: Path) -> None:
    from onnxruntime.quantization import quantize_dynamic

    from diag.fixtures.thirdparty import rapidocr_model

    det = rapidocr_model("det")
    with pytest.raises(ValueError, match=r"Expected conv2d_\d+\.w_0 to be an initializer"):
        quantize_dynamic(det, tmp_path / "raw.onnx")
    report = quantize_model(det, Recipe(mode="dynamic"), tmp_path / "det.dynamic.onnx")
    # The weights quantize_dynamic reads (the Conv weights), not the export's other Constants.
    assert report.actions[0].startswith("lifted 62 Constant node(s) to initializers")
    assert report.format == "dynamic"


def test_a_calibration_cache_gives_the_same_model_as_a_fresh_calibration_without_a_pass(tmp_path):
    fx = models.build("convnet")
    fp = tmp_path / "convnet.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp_path / "calib.npz", **fx.make_inputs(8, 11))
    recipe = Recipe(mode="static", quant_format="QDQ", activation_type="QUInt8", per_channel=True)
    calib = FeedSpec(inputs=str(tmp_path / "calib.npz"), batch=4)
    cache = tmp_path / "ranges.json"
    first = quantize_model(fp, recipe, tmp_path / "a.onnx", calibration=calib, calibration_cache=cache)
    assert first.calibrations == 1 and cache.is_file()
    # Ranges of the FP32 model do not depend on nodes_to_exclude: the cached ones are the fresh ones.
    excluded = recipe.with_excluded(["conv3"])
    again = quantize_model(fp, excluded, tmp_path / "b.onnx", calibration=calib, calibration_cache=cache)
    fresh = quantize_model(fp, excluded, tmp_path / "c.onnx", calibration=calib)
    assert again.calibrations == 0 and fresh.calibrations == 1
    assert any("no calibration pass" in a for a in again.actions)
    assert (tmp_path / "b.onnx").read_bytes() == (tmp_path / "c.onnx").read_bytes()
    assert (tmp_path / "a.onnx").read_bytes() != (tmp_path / "b.onnx").read_bytes()


def _tree_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("fmt", ["QOperator", "QDQ"])
def test_weight_only_reads_the_input_as_it_is_with_the_bytes_of_a_fixed_copy(tmp_path, monkeypatch, fmt):
    """A weight-only recipe on a model that needs no fix quantizes from the input itself (no 2 GB
    copy per trial at 500M); the output is byte-identical to quantizing from the copy."""
    import diag.fix.quantize as quantize
    from diag.fixtures.llm_models import llama_decoder, save_with_external_data

    src = tmp_path / "in"
    src.mkdir()
    fp = save_with_external_data(llama_decoder(layers=2).model, src / "llm.onnx")
    before = _tree_digest(src)
    recipe = Recipe(mode="weight_only", bits=4, block_size=32, quant_format=fmt)
    saved: list[Path] = []
    real_save = quantize._save

    def counting_save(model: onnx.ModelProto, path: Path, external: bool) -> Path:
        saved.append(path)
        return real_save(model, path, external)

    monkeypatch.setattr(quantize, "_save", counting_save)
    direct = quantize_model(fp, recipe, tmp_path / "direct" / "q.onnx")
    assert saved == []
    monkeypatch.setattr(quantize, "_has_constants", lambda model: True)  # the copying path
    copied = quantize_model(fp, recipe, tmp_path / "copied" / "q.onnx")
    assert len(saved) == 1
    assert _tree_digest(tmp_path / "direct") == _tree_digest(tmp_path / "copied")
    assert (direct.actions, direct.steps) == (copied.actions, copied.steps) and "external_data" in direct.steps
    assert _tree_digest(src) == before  # the input model is never written


def test_weight_only_on_a_model_with_constant_weights_still_lifts_them(tmp_path):
    fx = models.build("spread_mlp")
    weights = {t.name: t for t in fx.model.graph.initializer}
    model = onnx.ModelProto()
    model.CopyFrom(fx.model)
    del model.graph.initializer[:]
    consts = [onnx.helper.make_node("Constant", [], [name], value=t) for name, t in weights.items()]
    model.graph.node.insert(0, consts[0])
    for c in consts[1:]:
        model.graph.node.insert(0, c)
    fp = tmp_path / "consts.onnx"
    onnx.save(model, fp)
    r = quantize_model(fp, Recipe(mode="weight_only", bits=4, block_size=32), tmp_path / "q.onnx")
    assert any(a.startswith(f"lifted {len(consts)} Constant node(s)") for a in r.actions)
    assert detect_format(onnx.load(tmp_path / "q.onnx")).kind == "matmulnbits"


def test_a_model_whose_only_external_tensor_is_a_constant_stays_external(tmp_path):
    """External data is found in Constant values too, not only in initializers (review of the
    no-copy path: the output was written inline and the external_data step was missing)."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import convert_model_to_external_data

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "W")
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["W"], value=w, name="c"),
            helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    convert_model_to_external_data(model, location="m.onnx.data", size_threshold=0, convert_attribute=True)
    (tmp_path / "in").mkdir()
    onnx.save(model, tmp_path / "in" / "m.onnx")
    for mode, recipe in (
        ("dynamic", Recipe(mode="dynamic")),
        ("weight_only", Recipe(mode="weight_only", block_size=32)),
    ):
        out = tmp_path / mode / "q.onnx"
        r = quantize_model(tmp_path / "in" / "m.onnx", recipe, out)
        assert r.steps[:2] == ["external_data", "lift_constants"], mode
        assert (tmp_path / mode / "q.onnx.data").exists(), mode
