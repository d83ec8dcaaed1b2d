"""Real third-party models from a PyPI wheel (RapidOCR's PaddleOCR exports), dynamic and QDQ.

The wheel is fetched once into ``$DIAG_CACHE`` (default ``~/.cache/diag``) with
``pip download`` from the package registry; nothing is committed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from diag.analysis.compare import CompareOptions, CompareResult, compare_models
from diag.core.feeds import FeedSpec
from diag.fixtures import quantize, thirdparty

pytestmark = pytest.mark.slow

# (model, format) -> input image (H, W)
CASES = {
    ("cls", "dynamic"): (48, 192),
    ("cls", "qdq"): (48, 192),
    ("det", "dynamic"): (160, 160),
    ("det", "qdq"): (160, 160),
}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real")
    made: dict[tuple[str, str], tuple[Path, Path, Path]] = {}
    for (which, fmt), (h, w) in CASES.items():
        src = onnx.load(str(thirdparty.rapidocr_model(which)))
        fp = folder / f"{which}.fp32.onnx"
        if not fp.exists():
            # paddle2onnx keeps weights in Constant nodes: quantize_dynamic needs initializers.
            onnx.save(quantize.lift_constants(src), fp)
        name = src.graph.input[0].name
        images = thirdparty.text_images(10, h, w, seed=3)
        inputs = folder / f"{which}.inputs.npz"
        np.savez(inputs, **{name: images[4:]})
        q = folder / f"{which}.{fmt}.onnx"
        quantize.quantize(fp, q, fmt, {name: images[:4]})
        made[(which, fmt)] = (fp, q, inputs)
    return made


@pytest.fixture(scope="module")
def real_compared(real) -> Callable[[str, str], CompareResult]:
    """``real_compared("det", "qdq")``: compare_models of that pair on 4 samples, run once for the
    module; every caller gets its own deep copy."""
    cache: dict[tuple[str, str], CompareResult] = {}

    def get(which: str, fmt: str) -> CompareResult:
        if (which, fmt) not in cache:
            fp, q, inputs = real[(which, fmt)]
            cache[which, fmt] = compare_models(
                fp, q, FeedSpec(inputs=str(inputs), samples=4), CompareOptions(progress=False)
            )
        return copy.deepcopy(cache[which, fmt])

    return get


@pytest.mark.parametrize(("which", "fmt"), list(CASES))
def test_compare_runs_on_real_ocr_models_with_concrete_matching_counts(real_compared, which, fmt):
    r = real_compared(which, fmt)
    m = r.matching
    counts = (len(m.fp_float_tensors), len(r.accumulated))
    expected = {
        ("cls", "dynamic"): (EXPECTED_CLS_FLOAT, EXPECTED_CLS_FLOAT),
        ("cls", "qdq"): (EXPECTED_CLS_FLOAT, EXPECTED_CLS_QDQ),
        ("det", "dynamic"): (EXPECTED_DET_FLOAT, EXPECTED_DET_FLOAT),
        ("det", "qdq"): (EXPECTED_DET_FLOAT, EXPECTED_DET_QDQ),
    }[(which, fmt)]
    assert counts == expected
    # Every tensor not compared is explained, and the explanation is structural (fusion/fold).
    assert sorted(m.fused_away) == sorted(m.unmatched_tensors), m.unmatched_tensors
    assert r.findings and r.samples == 4
    assert all(f.local is not None for f in r.findings if f.group.quantized)


# Measured with onnx 1.23 / onnxruntime 1.32. Dynamic keeps every name; QDQ fuses Conv+Relu and
# BatchNormalization+Relu pairs, whose pre-activation tensors then no longer exist.
EXPECTED_CLS_FLOAT = 253
EXPECTED_CLS_QDQ = 220
EXPECTED_DET_FLOAT = 331
EXPECTED_DET_QDQ = 295


@pytest.mark.parametrize(("which", "fmt"), [("det", "qdq"), ("cls", "dynamic")])
def test_real_outputs_are_graded_by_their_kind(real_compared, which, fmt):
    """The DBNet map is a probability map (mask IoU, no argmax over image width); cls is a softmax."""
    r = real_compared(which, fmt)
    (v,) = r.verdicts
    if which == "det":
        assert v.per_sample.kind == "probability-map"
        assert v.per_sample.top1_agreement is None and not any("top-1" in x for x in v.reasons)
        assert any(x.startswith("mask IoU") for x in v.reasons) or v.per_sample.mask_iou is None
    else:
        assert v.per_sample.kind == "probabilities" and v.per_sample.top1_agreement is not None
    # The headline agrees with the roles it shows: one root cause under "single root cause".
    roots = [f for f in r.findings if f.role == "root-cause"]
    if r.single_cause:
        assert len(roots) == 1
    assert r.effects is not None and r.effects.effects, r.effects
