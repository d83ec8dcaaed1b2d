"""AIMET's per-block and LPBQ weight encodings, built as blocked DequantizeLinear (issue 43 item 2).

Ground truth for per-block: onnxruntime's own blocked QDQ model (``MatMulNBitsQuantizer`` in QDQ
format, 4-bit weights in blocks of 16 along each MatMul's input axis), written as AIMET encodings
(``fixtures.producers.aimet_encodings``): the model diag builds from the FP32 graph and that file
must compute what onnxruntime's model computes, bit for bit. For LPBQ (block scales that are small
integers times a float scale per channel, AIMET's low-power blockwise quantization) the truth is
the FP32 model with its MatMul weights dequantized by numpy from the same integers and scales.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli
from onnx import numpy_helper, version_converter
from onnxruntime.quantization import QuantFormat
from onnxruntime.quantization import matmul_nbits_quantizer as mnq

from diag.core.encodings import qdq_from_encodings, read_encodings
from diag.fixtures import models, producers

BLOCK = 16


def _outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The transformer fixture (opset 17) and onnxruntime's 4-bit blocked QDQ model of it (asymmetric:
    its symmetric scales can be negative, which no AIMET file holds), made at opset 21."""
    d = tmp_path_factory.mktemp("aimet-blocks")
    fx = models.build("transformer")
    fp = fx.model
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = mnq.MatMulNBitsQuantizer(
        version_converter.convert_version(fp, 21),
        block_size=BLOCK,
        is_symmetric=False,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=("MatMul",),
    )
    quantizer.process()
    feeds = fx.make_inputs(8, 5)
    np.savez(d / "feeds.npz", **feeds)
    onnx.save(fp, d / "fp32.onnx")
    return {"dir": d, "fp": fp, "qdq": quantizer.model.model, "feeds": feeds}


@pytest.mark.parametrize("version", ["1.0.0", "2.0.0"])
def test_per_block_encodings_build_onnxruntimes_blocked_model_bit_for_bit(blocked, version) -> None:
    d, fp, qdq = Path(str(blocked["dir"])), blocked["fp"], blocked["qdq"]
    doc = producers.aimet_encodings(qdq, version)  # type: ignore[arg-type]
    entries = doc["param_encodings"] if version == "1.0.0" else doc["encodings"]
    assert len(entries) == 13 and all(e.get("enc_type", "PER_BLOCK") == "PER_BLOCK" for e in entries)
    (d / f"{version}.encodings").write_text(json.dumps(doc))
    built = qdq_from_encodings(fp, read_encodings(d / f"{version}.encodings"))  # type: ignore[arg-type]
    assert built.params == 13 and not built.skipped
    assert max(o.version for o in built.model.opset_import if o.domain in ("", "ai.onnx")) == 21  # converted
    dqs = [n for n in built.model.graph.node if n.op_type == "DequantizeLinear"]
    assert {next(a.i for a in n.attribute if a.name == "block_size") for n in dqs} == {BLOCK}
    feeds: dict[str, np.ndarray] = blocked["feeds"]  # type: ignore[assignment]
    for ours, theirs in zip(_outputs(built.model, feeds), _outputs(qdq, feeds), strict=True):  # type: ignore[arg-type]
        assert np.array_equal(ours, theirs)


def _lpbq(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AIMET's LPBQ of MatMul weight ``w`` [K, N] (blocks along K): integer block scales in [1, 16]
    (4 bits decompressed to 8) and one float scale per output channel, as ``lpbq_utils`` computes them."""
    blocks = np.abs(w).reshape(-1, BLOCK, w.shape[1]).max(axis=1) / 7  # [nb, N]
    channel = (blocks.max(axis=0) / 16).astype(np.float32)  # [N]
    ints = np.clip(np.round(blocks / channel), 1, 16).astype(np.float32)
    return ints, channel


def _lpbq_entry(name: str, ints: np.ndarray, channel: np.ndarray, version: str) -> dict[str, object]:
    if version == "1.0.0":  # flat, channel-major; bw the decompressed width, offset its symmetric -128
        return {
            "name": name,
            "enc_type": "LPBQ",
            "dtype": "INT",
            "bw": 8,
            "compressed_bw": 4,
            "is_sym": True,
            "scale": channel.tolist(),
            "offset": [-128] * channel.size,
            "per_block_int_scale": ints.T.reshape(-1).tolist(),
            "block_size": BLOCK,
        }
    if version == "2.0.0":  # in the weight's rank; axis is the block axis
        return {
            "name": name,
            "output_dtype": "int4",
            "per_channel_float_scale": channel.reshape(1, -1).tolist(),
            "per_block_int_scale": ints.tolist(),
            "axis": 0,
            "block_size": BLOCK,
        }
    return {  # 2.1.0: the integers and the per-channel scale as one y_scale, with the channel axis
        "name": name,
        "output_dtype": "int4",
        "y_scale": {"x": ints.tolist(), "x_scale": channel.tolist(), "axis": 1},
        "axis": 0,
        "block_size": BLOCK,
    }


@pytest.mark.parametrize("version", ["1.0.0", "2.0.0", "2.1.0"])
def test_lpbq_encodings_build_the_weights_aimet_dequantizes(blocked, version) -> None:
    d, fp = Path(str(blocked["dir"])), blocked["fp"]
    truth = onnx.ModelProto()
    truth.CopyFrom(fp)  # type: ignore[arg-type]
    matmul_weights = {n.input[1] for n in truth.graph.node if n.op_type == "MatMul"}
    entries = []
    for init in truth.graph.initializer:
        if init.name not in matmul_weights:
            continue
        w = numpy_helper.to_array(init).astype(np.float32)
        ints, channel = _lpbq(w)
        scale = np.repeat(ints * channel, BLOCK, axis=0)  # the block scale, float32, per element
        init.CopyFrom(numpy_helper.from_array(np.clip(np.rint(w / scale), -8, 7) * scale, init.name))
        entries.append(_lpbq_entry(init.name, ints, channel, version))
    assert len(entries) == 13
    doc = (
        {"version": "1.0.0", "activation_encodings": [], "param_encodings": entries}
        if version == "1.0.0"
        else {"version": version, "encodings": entries}
    )
    (d / f"lpbq-{version}.encodings").write_text(json.dumps(doc))
    built = qdq_from_encodings(fp, read_encodings(d / f"lpbq-{version}.encodings"))  # type: ignore[arg-type]
    assert built.params == 13
    inits = {t.name: t for t in built.model.graph.initializer}
    assert all(inits[f"{e['name']}_quantized"].data_type == onnx.TensorProto.INT4 for e in entries)
    feeds: dict[str, np.ndarray] = blocked["feeds"]  # type: ignore[assignment]
    for ours, theirs in zip(_outputs(built.model, feeds), _outputs(truth, feeds), strict=True):
        assert np.array_equal(ours, theirs)


def test_lpbq_block_scales_are_aimets_integers_times_the_channel_scale(tmp_path) -> None:
    """AIMET's own test vector (``test_qc_quantize_op.py::test_lpbq_quantize_op``): 2 channels of 3
    blocks, integer scales [16, 11, 1] and [16, 3, 5], channel scales 1.6 / 16 and 16 / 16."""
    entry = {
        "name": "w",
        "enc_type": "LPBQ",
        "dtype": "INT",
        "bw": 8,
        "compressed_bw": 4,
        "is_sym": True,
        "scale": [0.1, 1.0],
        "offset": [-128, -128],
        "per_block_int_scale": [16, 11, 1, 16, 3, 5],
        "block_size": 3,
    }
    (tmp_path / "v.encodings").write_text(
        json.dumps({"version": "1.0.0", "activation_encodings": [], "param_encodings": [entry]})
    )
    w = read_encodings(tmp_path / "v.encodings").params["w"]
    assert (w.bitwidth, w.signed, w.block_size) == (4, True, 3)
    expected = np.array([16, 11, 1, 16, 3, 5], np.float32) * np.repeat(np.array([0.1, 1.0], np.float32), 3)
    assert np.array_equal(w.scale, expected) and not w.zero_point.any()


def test_compare_reads_a_per_block_aimet_export_as_onnxruntimes_blocked_model(blocked, capsys) -> None:
    d = Path(str(blocked["dir"]))
    onnx.save(blocked["qdq"], d / "ort.onnx")  # type: ignore[arg-type]
    (d / "aimet.onnx").write_bytes((d / "fp32.onnx").read_bytes())
    (d / "aimet.encodings").write_text(json.dumps(producers.aimet_encodings(blocked["qdq"], "1.0.0")))  # type: ignore[arg-type]
    docs = {}
    for name in ("aimet", "ort"):
        args = ["compare", d / "fp32.onnx", d / f"{name}.onnx", "--inputs", d / "feeds.npz", "--no-local"]
        code, _, _ = run_cli([*args, "--out", d / f"cmp-{name}", "--quiet"], capsys)
        assert code == 0
        docs[name] = json.loads((d / f"cmp-{name}" / "diag.json").read_text())
    ours, theirs = docs["aimet"], docs["ort"]
    assert "built by diag from AIMET encodings 'aimet.encodings'" in ours["models"]["int8"]["built"]
    weights = {w["fp_name"]: w["sqnr_db"] for w in ours["weights"]["findings"]}
    assert len(weights) == 13 and weights == pytest.approx(
        {w["fp_name"]: w["sqnr_db"] for w in theirs["weights"]["findings"]}, abs=1e-4
    )
    for mine, other in zip(ours["verdict"]["outputs"], theirs["verdict"]["outputs"], strict=True):
        assert mine["cosine_min"] == pytest.approx(other["cosine_min"], abs=1e-6)


def test_block_scales_that_do_not_fit_the_weight_are_one_line_errors(blocked, capsys) -> None:
    d = Path(str(blocked["dir"]))
    doc = producers.aimet_encodings(blocked["qdq"], "1.0.0")  # type: ignore[arg-type]
    first = doc["param_encodings"][0]
    first["scale"], first["offset"] = first["scale"][:-1], first["offset"][:-1]
    (d / "short.onnx").write_bytes((d / "fp32.onnx").read_bytes())
    (d / "short.encodings").write_text(json.dumps(doc))
    args = ["compare", d / "fp32.onnx", d / "short.onnx", "--inputs", d / "feeds.npz", "--out", d / "short"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and f"error[bad-encodings]: encoding of '{first['name']}' in short.encodings" in err
    assert "block scales; the weight has 32 channels x 2 blocks" in err
    assert len(err.strip().splitlines()) == 1 and not (d / "short").exists()
