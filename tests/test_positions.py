"""Padding positions are left out of per-tensor statistics (issue 42 item 5).

Ground truth: ``padded_encoder`` is calibrated on full-length samples and diagnosed on padded ones,
so every padding position is clipped while the real tokens, and the mean-pooled output that reads
them only, are quantized well. Every figure diag prints is recomputed here with plain onnxruntime
on the very files diag was given.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli

from diag.fixtures import models, quantize

TENSOR = "relu0_out"  # fc0's output: the first tensor the clipped padding reaches
INT8_TENSOR = "relu0_out_DequantizeLinear_Output"  # its value in the QDQ model


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("padded")
    fx = models.padded_encoder()
    fp32, qdq = d / "fp32.onnx", d / "qdq.onnx"
    onnx.save(fx.model, fp32)
    quantize.quantize(fp32, qdq, "qdq", fx.make_inputs(32, 7, padded=False))
    feeds = fx.make_inputs(16, 1)
    np.savez(d / "feeds.npz", **feeds)
    return {"dir": d, "fp32": fp32, "qdq": qdq, "feeds": feeds, "npz": d / "feeds.npz"}


def _exposed(path: Path, tensor: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """``tensor`` of the model at ``path``, computed by plain onnxruntime (optimizations off)."""
    model = onnx.load(str(path))
    model.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run([tensor], feeds)[0]


def _sqnr(x: np.ndarray, y: np.ndarray) -> float:
    x64, e = x.astype(np.float64), y.astype(np.float64) - x.astype(np.float64)
    return float(10 * np.log10(np.sum(x64 * x64) / np.sum(e * e)))


def test_padding_is_left_out_of_per_tensor_errors_by_default(
    padded: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    d, feeds = Path(str(padded["dir"])), padded["feeds"]
    assert isinstance(feeds, dict)
    code, out, _ = run_cli(
        ["compare", padded["fp32"], padded["qdq"], "--inputs", padded["npz"], "--out", d / "m", "--quiet"], capsys
    )
    assert code == 0
    doc = json.loads((d / "m" / "diag.json").read_text())
    mask = feeds["attention_mask"]
    assert doc["run"]["positions"] == {
        "mask_input": "attention_mask",
        "positions": mask.size,
        "padding": int((mask == 0).sum()),
    }
    fp = _exposed(Path(str(padded["fp32"])), TENSOR, feeds)
    q = _exposed(Path(str(padded["qdq"])), INT8_TENSOR, feeds)
    real = mask.astype(bool)
    figures = doc["tensors"][TENSOR]
    assert figures["int8_name"] == INT8_TENSOR
    assert figures["accumulated"]["sqnr_db"] == pytest.approx(_sqnr(fp[real], q[real]), abs=1e-3)
    assert figures["all_positions"]["sqnr_db"] == pytest.approx(_sqnr(fp, q), abs=1e-3)
    # The padding the pooled output never reads is what made this tensor look broken.
    assert figures["accumulated"]["sqnr_db"] > 25 > 10 > figures["all_positions"]["sqnr_db"]
    assert figures["all_positions_local"]["sqnr_db"] < 10
    # A tensor computed from the mask alone is a constant over the real positions: never masked.
    assert "all_positions" not in doc["tensors"]["mask/Unsqueeze_out"]
    assert doc["verdict"]["headline"]["kind"] == "rounding"
    sentence = f"per-tensor errors count the {int(real.sum())} real positions of {mask.size}"
    assert sentence in out
    assert sentence in (d / "m" / "summary.md").read_text()
    assert sentence in (d / "m" / "report.html").read_text()


def test_no_mask_counts_every_position_and_blames_the_padding(
    padded: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    d, feeds = Path(str(padded["dir"])), padded["feeds"]
    assert isinstance(feeds, dict)
    args = ["compare", padded["fp32"], padded["qdq"], "--inputs", padded["npz"], "--quiet", "--no-mask"]
    code, _, _ = run_cli([*args, "--out", d / "all"], capsys)
    assert code == 0
    doc = json.loads((d / "all" / "diag.json").read_text())
    assert doc["run"]["positions"] is None
    fp = _exposed(Path(str(padded["fp32"])), TENSOR, feeds)
    q = _exposed(Path(str(padded["qdq"])), INT8_TENSOR, feeds)
    assert doc["tensors"][TENSOR]["accumulated"]["sqnr_db"] == pytest.approx(_sqnr(fp, q), abs=1e-3)
    assert "all_positions" not in doc["tensors"][TENSOR]
    # Counting the padding names a cause that is not one, and outlier channels the padding makes.
    assert doc["verdict"]["headline"]["kind"] != "rounding"
    assert doc["distributions"]["tensors"][TENSOR]["outliers"]


def test_masked_distributions_see_no_padding_outliers(
    padded: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    d = Path(str(padded["dir"]))
    code, _, _ = run_cli(
        ["compare", padded["fp32"], padded["qdq"], "--inputs", padded["npz"], "--out", d / "d", "--quiet"], capsys
    )
    assert code == 0
    doc = json.loads((d / "d" / "diag.json").read_text())
    health = doc["distributions"]["tensors"][TENSOR]
    assert not health["outliers"]
    fp = _exposed(Path(str(padded["fp32"])), TENSOR, padded["feeds"])  # type: ignore[arg-type]
    real = padded["feeds"]["attention_mask"].astype(bool)  # type: ignore[index]
    assert health["max"] == pytest.approx(float(fp[real].max()), rel=1e-5)


def test_shards_merge_to_the_masked_figures_of_one_run(
    padded: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    d = Path(str(padded["dir"]))
    base = ["compare", padded["fp32"], padded["qdq"], "--inputs", padded["npz"], "--quiet", "--batch", 4]
    assert run_cli([*base, "--out", d / "one"], capsys)[0] == 0
    for k in range(2):
        assert run_cli([*base, "--shard", f"{k}/2", "--out", d / f"part{k}"], capsys)[0] == 0
    assert (
        run_cli(["merge", d / "part0" / "diag.json", d / "part1" / "diag.json", "--out", d / "merged"], capsys)[0] == 0
    )
    one = json.loads((d / "one" / "diag.json").read_text())
    merged = json.loads((d / "merged" / "diag.json").read_text())
    assert merged["run"]["positions"] == one["run"]["positions"]
    for key in ("accumulated", "all_positions", "local", "all_positions_local"):
        assert merged["tensors"][TENSOR][key]["sqnr_db"] == pytest.approx(
            one["tensors"][TENSOR][key]["sqnr_db"], abs=1e-4
        )


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--mask-input", "nope"], "error[bad-option]: --mask-input nope | is not an input of the FP32 model"),
        (["--mask-input", "tokens"], "error[bad-option]: --mask-input tokens | has rank 3, a mask is [batch, seq]"),
        (["--mask-input", "attention_mask", "--no-mask"], "error[bad-option]: --mask-input | is given with --no-mask"),
        (
            ["--reductions", "graph"],
            "error[bad-option]: --reductions graph | counts every position, but the input 'attention_mask'",
        ),
    ],
)
def test_a_mask_that_cannot_apply_is_one_line_error(
    padded: dict[str, object], capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    d = Path(str(padded["dir"]))
    out_dir = d / f"bad{len(flags)}{flags[-1]}"
    code, _, err = run_cli(
        ["compare", padded["fp32"], padded["qdq"], "--inputs", padded["npz"], "--out", out_dir, *flags], capsys
    )
    assert code == 2
    assert says in err
    assert len(err.strip().splitlines()) == 1
    assert not out_dir.exists()


def test_sequence_axis_follows_the_mask_shape() -> None:
    from diag.core.positions import kept_values, sequence_axis

    keep = np.array([[True, True, False], [True, False, False]])
    assert sequence_axis((2, 3, 8), keep) == 1  # [batch, seq, hidden]
    assert sequence_axis((2, 4, 3, 5), keep) == 2  # [batch, heads, seq, head_dim]: the query positions
    assert sequence_axis((2, 8), keep) is None  # pooled
    assert sequence_axis((1, 3, 8), keep) is None  # a batch that is not the mask's
    x = np.arange(2 * 4 * 3 * 5, dtype=np.float32).reshape(2, 4, 3, 5)
    real = kept_values(x, keep, 2)
    assert real.shape == (1, 4, 3, 5)  # heads stay on axis 1
    assert real[0, 1, 2].tolist() == x[1, 1, 0].tolist()


@pytest.mark.parametrize("named_seq", [True, False], ids=["named", "fixed"])
def test_named_dimensions_decide_the_sequence_axis_where_the_shape_rule_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], named_seq: bool
) -> None:
    """Width equal to the sequence's length (16): the pooled ``[batch, width]`` sum has an axis of
    the sequence's length that is no sequence. With the export's named dims the inferred shapes
    say so and it counts every value; with fixed dims the shape rule masks it (the documented
    ambiguity, kept where the names say nothing). The token tensors are masked either way."""
    fx = models.padded_encoder(width=16, seq=16, named_seq=named_seq)
    fp32, qdq = tmp_path / "fp32.onnx", tmp_path / "qdq.onnx"
    onnx.save(fx.model, fp32)
    quantize.quantize(fp32, qdq, "qdq", fx.make_inputs(16, 7, padded=False))
    np.savez(tmp_path / "feeds.npz", **fx.make_inputs(8, 1))
    args = ["compare", fp32, qdq, "--inputs", tmp_path / "feeds.npz", "--effects", 0, "--settings", "off"]
    code, _, err = run_cli([*args, "--out", tmp_path / "o", "--quiet"], capsys)
    assert code == 0, err
    tensors = json.loads((tmp_path / "o" / "diag.json").read_text())["tensors"]
    assert "all_positions" in tensors[TENSOR]  # [batch, sequence, width]: masked on the sequence
    pooled = "pool/ReduceSum_out"
    assert ("all_positions" in tensors[pooled]) is not named_seq
