"""`algorithm` in weight_only recipes: real MatMulNBitsQuantizer runs with k_quant vs RTN, the Python
diag writes reproduces the same bytes, and recipe mistakes are one-line errors.

HQQ and GPTQ run only where torch is installed (onnxruntime's code for them imports it); without it
they are refused up front with ``missing-extra``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from diag.core.recipe import Recipe
from diag.fix.quantize import quantize_model
from diag.fix.weightonly import quantizer_calls, weight_only_snippet
from diag.fixtures.nbits_models import BLOCK, stray_block_mlp
from diag.foundations.errors import DiagError

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture
def fp32(tmp_path: Path) -> Path:
    path = tmp_path / "fp32.onnx"
    onnx.save(stray_block_mlp().model, path)
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {sess.get_inputs()[0].name: x})[0])


def test_k_quant_differs_from_rtn_and_snippet_reproduces_bytes(fp32: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    out = {}
    for algo in ("RTN", "k_quant"):
        recipe = Recipe.from_dict({"mode": "weight_only", "block_size": BLOCK, "algorithm": algo})
        dst = tmp_path / f"{algo}.onnx"
        report = quantize_model(fp32, recipe, dst)
        assert [n.op_type for n in onnx.load(dst).graph.node].count("MatMulNBits") == 3
        out[algo] = (dst.read_bytes(), _run(dst, x))
        if algo == "k_quant":
            assert any("algorithm k_quant" in a for a in report.actions)
        script = tmp_path / f"{algo}.py"
        script.write_text(weight_only_snippet(recipe.to_dict(), str(fp32), str(tmp_path / f"{algo}.re.onnx"), "# t"))
        subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=120)
        assert (tmp_path / f"{algo}.re.onnx").read_bytes() == dst.read_bytes()
    assert out["RTN"][0] != out["k_quant"][0]
    assert not np.array_equal(out["RTN"][1], out["k_quant"][1])
    assert Recipe.from_dict({"mode": "weight_only", "algorithm": "k_quant"}).to_dict()["algorithm"] == "k_quant"
    assert "algorithm" not in Recipe.from_dict({"mode": "weight_only"}).to_dict()


def _bits(path: Path) -> dict[str, int]:
    """FP32 node name (MatMulNBits names end ``_Q4`` / ``_Q8``) -> its bits attribute."""
    return {
        n.name.rsplit("_Q", 1)[0]: next(a.i for a in n.attribute if a.name == "bits")
        for n in onnx.load(path).graph.node
        if n.op_type == "MatMulNBits"
    }


def test_k_quant_quantizes_node_bits_nodes_at_their_width(fp32: Path, tmp_path: Path) -> None:
    """k_quant reads per-node widths only from customized_weight_config: a second quantizer call at
    bits=8 (what RTN needs) left fc2 at 4 bits, so --tiers' int8 tier did nothing under k_quant."""
    data = {"mode": "weight_only", "block_size": BLOCK, "algorithm": "k_quant", "node_bits": {"fc2": 8}}
    recipe = Recipe.from_dict(data)
    dst = tmp_path / "mixed.onnx"
    quantize_model(fp32, recipe, dst)
    assert _bits(dst) == {"fc0": 4, "fc1": 4, "fc2": 8}
    script = tmp_path / "mixed.py"
    script.write_text(weight_only_snippet(recipe.to_dict(), str(fp32), str(tmp_path / "mixed.re.onnx"), "# t"))
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=120)
    assert (tmp_path / "mixed.re.onnx").read_bytes() == dst.read_bytes()


def test_tiers_under_k_quant_reach_the_target_with_int8_nodes(fp32: Path, tmp_path: Path) -> None:
    """The stray 4-bit block of fc2 is fixed at 8 bits whatever the algorithm (README's fixture table)."""
    import json

    from diag.cli.commands import main

    x = stray_block_mlp().make_inputs(32, 1)
    np.savez(tmp_path / "x.npz", **x)
    recipe = '{"mode": "weight_only", "algorithm": "k_quant", "block_size": 32}'
    args = ["exclude", str(fp32), "--inputs", str(tmp_path / "x.npz"), "--recipe", recipe, "--tiers", "int4,int8,fp32"]
    assert main([*args, "--target", "cosine>=0.99", "--bench-runs", "0", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    plan = json.loads((tmp_path / "t" / "tiers.json").read_text())
    assert plan["reachable"] is True and plan["plan"]["fc2"] == "int8", plan["plan"]
    bits = _bits(next((tmp_path / "t").glob("*.plan.onnx")))
    assert bits == {n: 8 if plan["plan"].get(n) == "int8" else 4 for n in ("fc0", "fc1", "fc2")}


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"algorithm": "hqq"}, "did you mean 'HQQ'"),
        ({"algorithm": "GPTQ"}, "GPTQ needs calibration"),
        ({"algorithm": "k_quant", "quant_format": "QDQ"}, "QOperator"),
        ({"calibration": "c.npz"}, "read by GPTQ only"),
        ({"algorithm": "GPTQ", "calibration": "c.npz", "bits": 8}, "4-bit only"),
        ({"algorithm": "HQQ", "bits": 8}, "HQQ's 8-bit MatMulNBits does not load on CPU"),
        ({"algorithm": "GPTQ", "calibration": "c.npz", "nodes_to_exclude": ["fc2"]}, "whatever nodes_to_exclude"),
        ({"algorithm": "GPTQ", "calibration": "c.npz", "node_bits": {"fc2": 8}}, "whatever nodes_to_exclude"),
    ],
)
def test_bad_algorithm_recipes_are_one_line_errors(data: dict[str, object], words: str) -> None:
    with pytest.raises(DiagError) as e:
        Recipe.from_dict({"mode": "weight_only", **data})
    assert e.value.slug == "bad-recipe" and words in str(e.value) and "\n" not in str(e.value)


def test_dynamic_recipe_refuses_algorithm() -> None:
    with pytest.raises(DiagError, match="only applies to MatMulNBitsQuantizer"):
        Recipe.from_dict({"mode": "dynamic", "algorithm": "HQQ"})


def test_gptq_and_hqq_python_names_their_config_classes(tmp_path: Path) -> None:
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.zeros((2, 64), np.float32))
    gptq = Recipe.from_dict({"mode": "weight_only", "algorithm": "GPTQ", "calibration": str(calib)})
    src = "\n".join(quantizer_calls(gptq))
    assert "GPTQWeightOnlyQuantConfig(calibration_data_reader=NpzReader(" in src and str(calib) in src
    compile(src, "gptq", "exec")
    hqq = "\n".join(quantizer_calls(Recipe.from_dict({"mode": "weight_only", "algorithm": "HQQ", "block_size": 32})))
    assert "HQQWeightOnlyQuantConfig(block_size=32, bits=4" in hqq


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed: HQQ/GPTQ run")
@pytest.mark.parametrize("algo", ["HQQ", "GPTQ"])
def test_hqq_gptq_without_torch_are_refused(algo: str, fp32: Path, tmp_path: Path) -> None:
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.zeros((2, 64), np.float32))
    data = {"mode": "weight_only", "algorithm": algo, **({"calibration": str(calib)} if algo == "GPTQ" else {})}
    with pytest.raises(DiagError) as e:
        quantize_model(fp32, Recipe.from_dict(data), tmp_path / "q.onnx")
    assert e.value.slug == "missing-extra" and "torch" in str(e.value)
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.skipif(not HAS_TORCH, reason="HQQ/GPTQ need torch")
@pytest.mark.parametrize("algo", ["HQQ", "GPTQ"])
def test_hqq_gptq_differ_from_rtn(algo: str, fp32: Path, tmp_path: Path) -> None:
    calib = tmp_path / "c.npz"
    inp = onnx.load(fp32).graph.input[0].name
    np.savez(calib, **{inp: np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)})
    extra = {"calibration": str(calib)} if algo == "GPTQ" else {}
    rtn = quantize_model(fp32, Recipe.from_dict({"mode": "weight_only", "block_size": BLOCK}), tmp_path / "r.onnx")
    del rtn
    quantize_model(fp32, Recipe.from_dict({"mode": "weight_only", "block_size": BLOCK, "algorithm": algo, **extra}),
                   tmp_path / "a.onnx")  # fmt: skip
    assert (tmp_path / "a.onnx").read_bytes() != (tmp_path / "r.onnx").read_bytes()


def test_under_hqq_nodes_at_8_bits_are_quantized_by_rtn(tmp_path: Path) -> None:
    """HQQ's 8-bit MatMulNBits has float zero points (onnxruntime's CPU kernel refuses to load it).
    A plan's 8-bit nodes get a second, RTN call, printed as diag runs it."""
    for algo, extra in (("HQQ", {}),):
        recipe = Recipe.from_dict({"mode": "weight_only", "algorithm": algo, "node_bits": {"fc2": 8}, **extra})
        src = quantizer_calls(recipe)
        calls = [line for line in src if line.startswith("quantizer = MatMulNBitsQuantizer(")]
        assert len(calls) == 2 and "algo_config=algo_config" in calls[0] and "algo_config" not in calls[1]
        assert "bits=8" in calls[1] and "nodes_to_exclude=['fc2']" in calls[0]


def test_a_sweep_grid_over_algorithms_gives_calibration_to_gptq_only(tmp_path: Path) -> None:
    from diag.fix.sweep import expand_grid

    grid = {"mode": "weight_only", "algorithm": ["RTN", "k_quant", "HQQ", "GPTQ"], "calibration": "c.npz"}
    recipes = expand_grid(grid, str(tmp_path))
    assert [(r.algorithm or "RTN", r.calibration) for r in recipes] == [
        ("RTN", None),
        ("k_quant", None),
        ("HQQ", None),
        ("GPTQ", "c.npz"),
    ]


@pytest.mark.skipif(
    not HAS_TORCH, reason="HQQ/GPTQ need torch (.ci/run installs the CPU wheel when the machine has it)"
)
def test_hqq_tiers_and_an_algorithm_sweep_run_with_real_quantization(fp32: Path, tmp_path: Path) -> None:
    """The issue's "done means": HQQ through diag exclude --tiers (its int8 nodes by RTN, the plan
    rebuilt byte for byte by reproduce.py) and RTN / k_quant / HQQ / GPTQ side by side in diag sweep."""
    import json

    from diag.cli.commands import main

    x = stray_block_mlp().make_inputs(32, 1)
    np.savez(tmp_path / "x.npz", **x)
    np.savez(tmp_path / "calib.npz", **{k: v[:8] for k, v in x.items()})
    inputs = ["--inputs", str(tmp_path / "x.npz")]
    recipe = '{"mode": "weight_only", "algorithm": "HQQ", "block_size": 32}'
    args = ["exclude", str(fp32), *inputs, "--recipe", recipe, "--tiers", "int4,int8,fp32", "--target", "cosine>=0.99"]
    assert main([*args, "--bench-runs", "0", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    plan = json.loads((tmp_path / "t" / "tiers.json").read_text())
    assert plan["reachable"] is True and plan["plan"].get("fc2") == "int8", plan["plan"]
    model = next((tmp_path / "t").glob("*.plan.onnx"))
    _run(model, x["x"][:2])  # loads and runs: no 8-bit HQQ node
    script = tmp_path / "t" / "reproduce.py"
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rebuilt = list((tmp_path / "t").glob("*.reproduced.onnx"))
    assert len(rebuilt) == 1 and rebuilt[0].read_bytes() == model.read_bytes()

    # GPTQ through --tiers: refused up front, with why (its onnxruntime branch ignores nodes_to_exclude).
    gptq = json.dumps(
        {"mode": "weight_only", "algorithm": "GPTQ", "block_size": 32, "calibration": str(tmp_path / "calib.npz")}
    )
    args[args.index(recipe)] = gptq
    assert main([*args, "--bench-runs", "0", "--out", str(tmp_path / "g"), "--quiet"]) == 2
    assert not (tmp_path / "g").exists()

    # GPTQ at its default block (128) on 64-wide weights: onnxruntime's packing raises; one clean line.
    calib = str(tmp_path / "calib.npz")
    with pytest.raises(DiagError) as e:
        quantize_model(fp32, Recipe.from_dict({"mode": "weight_only", "algorithm": "GPTQ", "calibration": calib}),
                       tmp_path / "g.onnx")  # fmt: skip
    assert e.value.slug == "quantize-failed" and "GPTQ" in str(e.value) and not (tmp_path / "g.onnx").exists()

    algorithms = ["RTN", "k_quant", "HQQ", "GPTQ"]
    grid = json.dumps({"mode": "weight_only", "algorithm": algorithms, "calibration": "calib.npz", "block_size": 32})
    (tmp_path / "grid.json").write_text(grid)
    assert (
        main(
            [
                "sweep",
                str(fp32),
                *inputs,
                "--grid",
                str(tmp_path / "grid.json"),
                "--out",
                str(tmp_path / "s"),
                "--quiet",
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "s" / "sweep.json").read_text())["entries"]
    measured = {(r["recipe"].get("algorithm") or "RTN"): r["metrics"]["cosine"] for r in rows if r.get("metrics")}
    assert set(measured) == {"RTN", "k_quant", "HQQ", "GPTQ"}, rows
    assert len(set(measured.values())) == 4  # four algorithms, four different models
