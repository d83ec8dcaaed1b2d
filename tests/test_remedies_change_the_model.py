"""Every remedy diag prints changes something (issue 25, item 1): re-quantized as printed, with plain
onnxruntime, from the recipe diag inferred, each gives a model whose bytes differ from the baseline's
and that onnxruntime runs. (It found the calibration-range remedy printing ``"rmin": -0.38``, which
quantize_static rejects with AttributeError: onnxruntime wants ``np.float32`` there.)

The baseline is the inferred recipe re-quantized here with the same calibration data, so the only
difference between the two models is the remedy. A remedy already in effect (``per_channel=True``
on a per-channel model) would give byte-identical models and fail.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static
from plain_ort import Rows

from diag.analysis.compare import CompareOptions
from diag.cli.verbs import diagnose
from diag.core.feeds import FeedSpec
from diag.fixtures.quantize import quantize

#: Remedies that need a package the test machine does not have (stated, not skipped silently).
NEEDS_PACKAGE = {"smoothquant": "neural-compressor"}


def _baseline_kwargs(settings: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The inferred recipe as onnxruntime's own keyword arguments (what the fix snippet prints)."""
    kw: dict[str, Any] = {
        "per_channel": bool(settings.get("per_channel")),
        "reduce_range": bool(settings.get("reduce_range")),
        "nodes_to_exclude": list(settings.get("nodes_to_exclude") or []),
        "weight_type": QuantType[settings.get("weight_type", "QInt8")],
    }
    if settings["mode"] == "dynamic":
        return "quantize_dynamic", kw
    kw["activation_type"] = QuantType[settings.get("activation_type", "QUInt8")]
    kw["quant_format"] = QuantFormat[settings.get("quant_format", "QDQ")]
    return "quantize_static", kw


def _printed(python: str) -> dict[str, Any]:
    """A remedy's printed Python (``per_channel=True``, ``extra_options={...}``) as keyword arguments."""
    names = {"QuantType": QuantType, "QuantFormat": QuantFormat, "CalibrationMethod": CalibrationMethod, "np": np}
    return eval(f"dict({python})", names)  # the printed text, pasted as the user would


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if k == "extra_options":
            out[k] = {**out.get(k, {}), **v}
        elif k == "nodes_to_exclude":
            out[k] = list(dict.fromkeys([*out.get(k, []), *v]))
        else:
            out[k] = v
    return out


def _requantize(fp32: Path, out: Path, function: str, kwargs: dict[str, Any], calib: dict) -> bytes:
    logging.getLogger().setLevel(logging.ERROR)
    if function == "quantize_dynamic":
        kwargs = {k: v for k, v in kwargs.items() if k not in ("activation_type", "quant_format")}
        quantize_dynamic(fp32, out, **kwargs)
    else:
        quantize_static(fp32, out, Rows(calib, 16), **kwargs)
    return out.read_bytes()


CASES = [
    ("convnet", "dynamic", False),
    ("convnet", "qdq", False),
    ("transformer", "dynamic", False),
    ("transformer", "qdq", False),
    ("transformer", "qoperator", False),
    ("ctc", "qdq", False),
    ("spread_mlp", "dynamic", False),
    ("spread_mlp", "dynamic", True),
    ("spread_mlp", "qdq", True),
    ("two_outputs", "qdq", False),
]


@pytest.mark.parametrize(("name", "fmt", "per_channel"), CASES)
def test_every_printed_remedy_changes_the_model(built, tmp_path, name, fmt, per_channel):
    b = built(name)
    int8 = quantize(b.fp32, tmp_path / "int8.onnx", fmt, b.calib, per_channel=per_channel) if per_channel else None
    spec = FeedSpec(inputs=str(b.inputs_path), batch=8)
    r = diagnose(b.fp32, int8 or b.int8[fmt], spec, CompareOptions(progress=False))
    assert r.fix_recipe is not None
    settings = r.fix_recipe["settings"]
    assert bool(settings.get("per_channel")) is per_channel  # the recipe was read back right
    function, base = _baseline_kwargs(settings)
    baseline = _requantize(b.fp32, tmp_path / "base.onnx", function, base, b.calib)
    assert _requantize(b.fp32, tmp_path / "again.onnx", function, base, b.calib) == baseline  # deterministic
    checked = []
    for i, s in enumerate(r.suggestions):
        if s.remedy in NEEDS_PACKAGE:
            continue
        kwargs = _merge(base, _printed(s.python))
        got = _requantize(b.fp32, tmp_path / f"remedy{i}.onnx", s.applies_to, kwargs, b.calib)
        assert got != baseline, f"remedy {s.python} for {s.tensor} re-quantizes to the same model"
        # ... and to a model onnxruntime runs (a remedy that breaks the model is no remedy).
        ort.InferenceSession(got, providers=["CPUExecutionProvider"]).run(None, b.fixture.make_inputs(2, 3))
        checked.append(s.python)
    # The spread sentence's model-wide settings: per_channel=True is the one that is a setting.
    if "per_channel=True" in r.cause_sentence:
        got = _requantize(b.fp32, tmp_path / "pc.onnx", function, {**base, "per_channel": True}, b.calib)
        assert got != baseline, "per_channel=True was printed for a model that already has it"
        checked.append("per_channel=True (spread)")
    if per_channel:
        assert "per_channel=True" not in r.cause_sentence
        assert not [s for s in r.suggestions if "per_channel=True" in s.python]
    assert checked or not r.suggestions, (name, fmt)
