"""Every input source: stacked .npz, folder of feed files, seeded random, reader factories."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from diag.analysis.compare import CompareOptions, compare_models
from diag.core.feeds import FeedSpec, feed_source
from diag.foundations.errors import DiagError


def _run(b, spec: FeedSpec):
    return compare_models(b.fp32, b.int8["dynamic"], spec, CompareOptions(progress=False, local=False))


def test_folder_of_npz_feed_dicts_is_passed_as_is(built, tmp_path):
    b = built("transformer")
    folder = tmp_path / "feeds"
    folder.mkdir()
    for i in range(3):
        np.savez(folder / f"{i:03d}.npz", input_ids=b.inputs["input_ids"][i * 2 : i * 2 + 2])
    r = _run(b, FeedSpec(inputs=str(folder)))
    assert (r.samples, r.batches) == (6, 3)


def test_random_inputs_respect_int_range_and_are_reproducible(built):
    b = built("transformer")
    import onnx

    fp = onnx.load(str(b.fp32))
    a = [
        x.feeds["input_ids"]
        for x in feed_source(fp, FeedSpec(random=True, samples=4, batch=2, seed=3, int_range=(5, 9)))
    ]
    again = [
        x.feeds["input_ids"]
        for x in feed_source(fp, FeedSpec(random=True, samples=4, batch=2, seed=3, int_range=(5, 9)))
    ]
    assert len(a) == 2 and a[0].shape == (2, 16) and a[0].dtype == np.int64
    assert all(((x >= 5) & (x < 9)).all() for x in a)
    assert all((x == y).all() for x, y in zip(a, again, strict=True))


def test_random_inputs_ask_for_shape_of_symbolic_non_batch_dims(tmp_path):
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
    )
    m = helper.make_model(g)
    with pytest.raises(DiagError, match=r"symbolic dim 'seq'.*--shape x=1,N"):
        feed_source(m, FeedSpec(random=True, samples=2))
    src = feed_source(m, FeedSpec(random=True, samples=2, shapes={"x": (1, 7)}))
    assert next(iter(src)).feeds["x"].shape == (1, 7)


def test_reader_factory_may_return_a_calibration_data_reader_and_is_reiterable(built, tmp_path, monkeypatch):
    b = built("transformer")
    np.save(tmp_path / "ids.npy", b.inputs["input_ids"][:4])
    (tmp_path / "my_reader.py").write_text(
        textwrap.dedent(f"""
        import numpy as np
        from onnxruntime.quantization import CalibrationDataReader

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.rows = iter(np.load({str(tmp_path / "ids.npy")!r}))
            def get_next(self):
                row = next(self.rows, None)
                return None if row is None else {{"input_ids": row[None]}}

        def make():
            return Reader()
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    r = _run(b, FeedSpec(reader="my_reader:make"))
    assert r.samples == 4
    sys.modules.pop("my_reader", None)


def test_reader_yielding_wrong_types_is_a_bad_reader_error(built, tmp_path, monkeypatch):
    b = built("transformer")
    (tmp_path / "bad_reader.py").write_text("def make():\n    return [[1, 2, 3]]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DiagError) as e:
        _run(b, FeedSpec(reader="bad_reader:make"))
    assert e.value.slug == "bad-reader" and "yielded a list, not a dict" in str(e.value)
