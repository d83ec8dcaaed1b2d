"""Unmatched tensors are explained truly (issue 43 item 7): renamed is not fused.

torch's exporters name tensors differently from one export to the next (PT2E's ``getitem`` became
``conv2d``): a Conv output the INT8 model still computes under another name must not be reported
as "fused away by the quantizer". Ground truth: onnxruntime's QDQ convnet with its activations kept
as their own nodes, then one Conv output renamed, as a second export would name it.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

from diag.core.match import match_models
from diag.fixtures import models


class _Reader(CalibrationDataReader):
    def __init__(self, feeds: dict) -> None:
        self.rows = iter([{k: v[i : i + 1] for k, v in feeds.items()} for i in range(len(next(iter(feeds.values()))))])

    def get_next(self) -> dict | None:
        return next(self.rows, None)


def test_a_renamed_conv_output_is_not_called_fused(tmp_path: Path) -> None:
    fx = models.convnet()
    onnx.save(fx.model, tmp_path / "fp32.onnx")
    keep = {"QDQKeepRemovableActivations": True}
    quantize_static(str(tmp_path / "fp32.onnx"), str(tmp_path / "q.onnx"), _Reader(fx.make_inputs(8, 1)),
                    quant_format=QuantFormat.QDQ, extra_options=keep)  # fmt: skip
    q = onnx.load(str(tmp_path / "q.onnx"))
    fused = match_models(fx.model, q).unmatched_tensors
    assert "conv2_out" not in fused  # kept activations: every Conv output is paired by name
    old = "conv2_out"
    for node in q.graph.node:  # a second export names it otherwise
        node.input[:] = [x.replace(old, "conv2d_1") for x in node.input]
        node.output[:] = [x.replace(old, "conv2d_1") for x in node.output]
    reasons = match_models(fx.model, q).unmatched_tensors
    assert reasons["conv2_out"].startswith("renamed, not fused: INT8 Conv 'conv2' still computes it, as 'conv2d_1'")
    # A real fusion is still called one: onnxruntime's default QDQ removes the Relu after conv2.
    quantize_static(str(tmp_path / "fp32.onnx"), str(tmp_path / "d.onnx"), _Reader(fx.make_inputs(8, 1)),
                    quant_format=QuantFormat.QDQ)  # fmt: skip
    default = match_models(fx.model, onnx.load(str(tmp_path / "d.onnx"))).unmatched_tensors
    assert default["conv2_out"].startswith(
        "fused away by the quantizer: Conv 'conv2' + Relu 'relu2' became one INT8 node"
    )
