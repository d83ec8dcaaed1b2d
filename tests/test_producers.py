"""The producers table (``diag.foundations.producers``): who made a model, and the fix in its words.

Detection runs on models built here: an onnxruntime QDQ fixture, its ModelOpt / NNCF / SmoothQuant
rewrites (``fixtures/producers.py``), and protos carrying Quark's, AIMET's and torch's marks.
"""

from __future__ import annotations

import ast
import json
import re
import shlex

import onnx
import pytest

from diag.fixtures import models, producers, quantize
from diag.foundations.producers import (
    DECISIVE,
    PLACEHOLDERS,
    PRODUCERS,
    STRUCTURES,
    detect_producer,
    fix_call,
)

#: Node names that would break a snippet pasted raw: quotes, a newline, a backslash, regex and
#: shell characters, a placeholder's own spelling.
NAMES = ["layer1/ffn/fc1/MatMul", 'it\'s "quoted"', "a\nb\\c", "conv1.weight[0]*$", "$regexes $nodes"]


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory):
    """The convnet fixture: (FP32 model, its onnxruntime static QDQ model, the QDQ model's path)."""
    folder = tmp_path_factory.mktemp("producers")
    fx = models.build("convnet")
    onnx.save(fx.model, folder / "convnet.onnx")
    path = quantize.quantize(folder / "convnet.onnx", folder / "convnet.qdq.onnx", "qdq", fx.make_inputs(4, 3))
    return fx.model, onnx.load(path), path


@pytest.fixture(scope="module")
def transformer_qdq(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("producers_tf")
    fx = models.build("transformer")
    onnx.save(fx.model, folder / "t.onnx")
    return fx, onnx.load(quantize.quantize(folder / "t.onnx", folder / "t.qdq.onnx", "qdq", fx.make_inputs(4, 3)))


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def test_an_onnxruntime_quantized_model_is_onnxruntime_by_its_producer_name(convnet):
    _, q, _ = convnet
    d = detect_producer(q)
    assert d.key == "onnxruntime"
    assert d.decided_by is not None and d.decided_by.found == "producer name 'onnx.quantize'"
    assert d.note is not None and "Optimum" in d.note and "ModelOpt" not in d.note  # Optimum needs the path


def test_optimum_is_seen_only_through_the_ort_config_json_beside_the_model(convnet, tmp_path):
    _, q, _ = convnet
    path = tmp_path / "model_quantized.onnx"
    onnx.save(q, path)
    assert detect_producer(q, path).key == "onnxruntime"  # its file name alone is a weak hint
    (tmp_path / "ort_config.json").write_text(json.dumps({"opset": None, "quantization": {"is_static": True}}))
    d = detect_producer(q, path)
    assert d.key == "optimum" and d.note is None
    assert d.decided_by is not None and d.decided_by.mark.strength == DECISIVE
    assert "ort_config.json" in d.decided_by.found
    assert [e.producer for e in d.outranked][:1] == ["onnxruntime"]


@pytest.mark.parametrize("text", ["{", "[" * 500 + "]" * 500, '{"quantization": null}', "[1, 2]"])
def test_an_ort_config_json_without_a_quantization_section_says_nothing(convnet, tmp_path, text):
    _, q, _ = convnet
    (tmp_path / "ort_config.json").write_text(text)
    assert detect_producer(q, tmp_path / "m.onnx").key == "onnxruntime"


def test_the_modelopt_fixture_is_modelopt_by_its_float_weights_quantized_in_the_graph(convnet):
    _, q, _ = convnet
    m = producers.modelopt_style(q)
    d = detect_producer(m)
    assert d.key == "modelopt"
    assert d.decided_by is not None and d.decided_by.mark.pattern == "ort-float-weight-qdq"
    assert "quantizes the float initializer 'conv1.weight'" in d.decided_by.found
    assert "onnxruntime" in {e.producer for e in d.outranked}


def test_detection_reads_no_weight_values(convnet):
    _, q, _ = convnet
    m = producers.modelopt_style(q)
    for t in m.graph.initializer:  # what load_external_data=False leaves: types and shapes, no values
        t.ClearField("raw_data")
        t.ClearField("float_data")
        t.ClearField("int32_data")
    assert detect_producer(m).key == "modelopt"


def test_the_nncf_fixture_is_nncf_although_it_keeps_the_exporters_producer_name(convnet):
    _, q, _ = convnet
    d = detect_producer(producers.nncf_style(q))
    assert d.key == "nncf"
    assert d.decided_by is not None and d.decided_by.found.startswith("tensor name 'dq_output_")
    assert "torch" in {e.producer for e in d.outranked}  # producer_name 'pytorch', outranked


def test_the_smoothquant_fixture_is_nncf_with_its_smooth_quant_muls_as_evidence(transformer_qdq):
    fx, q = transformer_qdq
    _, m = producers.smoothquant_style(fx.model, q)
    d = detect_producer(m)
    assert d.key == "nncf"
    assert any(e.found.endswith("/nncf_smooth_quant'") for e in d.evidence)


def test_quark_is_recognised_by_its_producer_name_or_its_opset_domain(convnet):
    _, q, _ = convnet
    by_name = _copy(q)
    by_name.producer_name = "quark.onnx"
    by_domain = _copy(q)
    by_domain.opset_import.append(onnx.helper.make_opsetid("com.amd.quark", 1))
    assert detect_producer(by_name).key == "quark"
    d = detect_producer(by_domain)
    assert d.key == "quark" and d.decided_by is not None and d.decided_by.found == "domain 'com.amd.quark'"


def test_aimet_is_recognised_by_the_producer_metadata_its_qdq_export_writes(convnet):
    _, q, _ = convnet
    m = _copy(q)
    onnx.helper.set_model_props(m, {"producer": "aimet-onnx 2.42.0"})
    d = detect_producer(m)
    assert d.key == "aimet" and d.decided_by is not None
    assert d.decided_by.found == "metadata 'producer=aimet-onnx 2.42.0'"


def test_a_plain_fp32_model_is_unknown_and_a_torch_export_is_the_exporter(convnet):
    fp32, _, _ = convnet
    d = detect_producer(fp32)  # producer_name 'diag-fixtures'
    assert (d.key, d.evidence, d.note) == ("unknown", (), "no producer's mark was found")
    exported = _copy(fp32)
    exported.producer_name = "pytorch"
    assert detect_producer(exported).key == "torch"
    dynamo = _copy(fp32)
    onnx.helper.set_model_props(dynamo, {"pkg.torch.export.ExportedProgram.graph_signature": "..."})
    assert detect_producer(dynamo).key == "torch"


def test_two_unrelated_producers_marks_that_tie_are_unknown_with_both_listed(convnet):
    fp32, _, _ = convnet
    m = _copy(fp32)
    m.producer_name = "quark.onnx"
    onnx.helper.set_model_props(m, {"producer": "aimet-onnx 2.42.0"})
    d = detect_producer(m)
    assert d.key == "unknown" and d.note == "two unrelated producers' marks tie"
    assert {e.producer for e in d.outranked} == {"quark", "aimet"}


@pytest.mark.parametrize("key", list(PRODUCERS))
def test_every_fix_call_holds_the_exact_names_and_python_fixes_compile(key):
    text = fix_call(key, NAMES)
    row = PRODUCERS[key]
    fix = (row.fix or PRODUCERS[str(row.fix_with)].fix).language  # type: ignore[union-attr]
    if fix == "python":
        tree = ast.parse(compile(text, f"<{key}>", "exec", ast.PyCF_ONLY_AST))
        lists = [
            [e.value for e in n.elts]
            for n in ast.walk(tree)
            if isinstance(n, ast.List) and n.elts and all(isinstance(e, ast.Constant) for e in n.elts)
        ]
        assert lists == [NAMES], text
    else:  # shell: each name becomes one argument, a pattern that re.match-es it and no longer name
        patterns = shlex.split(text.split("--nodes_to_exclude ", 1)[1])  # the command's last line
        assert len(patterns) == len(NAMES)
        for name, pattern in zip(NAMES, patterns, strict=True):
            assert re.match(pattern, name) and not re.match(pattern, name + "0")
    if row.fix_note:
        assert text.startswith(f"# {row.fix_note}\n")


def test_fix_call_output_for_each_producer_names_the_tool_s_own_argument():
    own = {
        "onnxruntime": "nodes_to_exclude=[",
        "optimum": "AutoQuantizationConfig",
        "nncf": "nncf.IgnoredScope(names=[",
        "modelopt": "--nodes_to_exclude 'conv3$'",
        "quark": "exclude=[",
        "aimet": "quantizer.enabled = False",
        "torch": "quantize_static(",
        "unknown": "quantize_static(",
    }
    assert set(own) == set(PRODUCERS)
    for key, word in own.items():
        assert word in fix_call(key, ["conv3"]), key


def test_fix_call_refuses_an_empty_list():
    with pytest.raises(ValueError, match="at least one node"):
        fix_call("onnxruntime", [])


def test_the_table_is_consistent():
    for key, row in PRODUCERS.items():
        assert row.key == key and row.name and row.source
        assert row.refines is None or row.refines in PRODUCERS
        assert (row.fix is None) != (row.fix_with is None), key
        assert row.fix_with is None or PRODUCERS[row.fix_with].fix is not None
        for mark in row.marks:
            if mark.kind == "structure":
                assert mark.pattern in STRUCTURES
            else:
                re.compile(mark.pattern)
            assert (mark.json_key is not None) <= (mark.kind == "file_beside")
        if row.fix is not None:
            used = set(re.findall(r"\$(\w+)", row.fix.text))
            assert used and used <= set(PLACEHOLDERS), key
    assert list(PRODUCERS)[-1] == "unknown" and not PRODUCERS["unknown"].marks
