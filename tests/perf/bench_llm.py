"""Benchmark: diag on Llama-architecture decoders quantized to 4 bits, at sizes up to > 2 GB.

Not collected by pytest (no ``test_`` prefix). Needs the ``bench`` extra (torch, transformers,
onnxscript; never in the base install)::

    pip install torch==2.13.0 && pip install ".[bench]"
    python tests/perf/bench_llm.py --sizes 20M,120M,500M --samples 4 --seq 128

Per size it builds a ``LlamaForCausalLM`` with seeded random weights from a ``LlamaConfig``,
exports it with ``torch.onnx.export(dynamo=True, external_data=True)`` (no KV cache), quantizes it
with onnxruntime's ``MatMulNBitsQuantizer`` (4 bits, block 32, symmetric RTN), caches both under
``--cache`` and prints wall time and peak RSS (``VmHWM``, each run in a fresh process) of:

* floor: the FP32 and the int4 model run once over the inputs with every float tensor exposed,
  outputs touched and dropped (the unavoidable cost of looking at every tensor);
* diag: ``diag compare`` as a user runs it (effect check, report written); acc4: the same with
  ``--accuracy-level-check 4`` (the int4 model re-run at accuracy_level 4, node by node);
* ort: onnxruntime's ``qdq_loss_debug`` (``modify_model_output_intermediate_tensors``,
  ``collect_activations``, ``create_activation_matching``): it pairs QDQ tensors only, so on a
  MatMulNBits model it matches nothing; its cost is printed with the number of pairs it found;
* tiers (``--tiers``): ``diag exclude --tiers int4,int8,fp32`` with ``--time-budget``.

Then the ratios issue 27 sets targets for: diag wall / floor wall (<= 2.0 at 500 M parameters)
and diag peak RSS against 1.5 x (FP32 + int4 file bytes) + 1 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: name -> (hidden, intermediate, layers, heads); vocabulary 32000 as Llama 2.
SIZES = {
    "20M": (256, 688, 4, 4),
    "120M": (768, 2048, 10, 12),
    "500M": (1280, 3456, 22, 20),
}
VOCAB = 32000

CHILD = r"""
import json, sys, time
def _peak_mb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
from pathlib import Path
import numpy as np
mode, folder, samples = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
fp, q, inputs = folder / "fp32.onnx", folder / "int4.onnx", folder / "ids.npz"
start = time.perf_counter()
extra = {}
if mode in ("diag", "acc4"):
    from diag.cli import main
    more = ["--accuracy-level-check", "4"] if mode == "acc4" else []
    code = main(["compare", str(fp), str(q), "--inputs", str(inputs), "--samples", str(samples),
                 "--out", str(folder / "out"), "--quiet", *more])
    assert code == 0, code
elif mode == "floor":
    import onnx
    from diag.instrument import exposed_model
    from diag.run import session_from_model
    ids = np.load(inputs)["input_ids"][:samples]
    for path in (fp, q):
        m = onnx.load(str(path), load_external_data=False)
        names = [o for n in m.graph.node for o in n.output if o]
        s = session_from_model(exposed_model(m, names), "floor", "disabled", None, folder, takes_turns=True)
        for i in range(len(ids)):
            for v in s.run(None, {"input_ids": ids[i:i + 1]}):
                float(np.asarray(v).ravel()[:1].sum()) if v.size else 0.0
        del s, m
elif mode == "ort":
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations, create_activation_matching, modify_model_output_intermediate_tensors)
    ids = np.load(inputs)["input_ids"][:samples]
    class R(CalibrationDataReader):
        def __init__(self):
            self.i = 0
        def get_next(self):
            if self.i >= len(ids):
                return None
            self.i += 1
            return {"input_ids": ids[self.i - 1:self.i]}
    for src, dst in ((fp, "fp_aug.onnx"), (q, "q_aug.onnx")):
        modify_model_output_intermediate_tensors(str(src), str(folder / dst), save_as_external_data=True)
    a = collect_activations(str(folder / "fp_aug.onnx"), R())
    b = collect_activations(str(folder / "q_aug.onnx"), R())
    extra = {"pairs": len(create_activation_matching(b, a))}
elif mode == "tiers":
    from diag.cli import main
    code = main(["exclude", str(fp), "--int8", str(q), "--inputs", str(inputs), "--samples", str(samples),
                 "--tiers", "int4,int8,fp32", "--target", sys.argv[4], "--time-budget", sys.argv[5],
                 "--bench-runs", "0", "--out", str(folder / "tiers"), "--quiet"])
    extra = {"exit": code}
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": _peak_mb(), **extra}))
"""


def build(size: str, folder: Path, samples: int, seq: int) -> None:
    """Export and quantize one size into ``folder`` (skipped when the files are there)."""
    import numpy as np

    if (folder / "int4.onnx").exists() and (folder / "ids.npz").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from diag.fixtures.llm_models import quantize_int4

    hidden, inter, layers, heads = SIZES[size]
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        max_position_embeddings=max(seq, 256),
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(0, VOCAB, (1, seq))
    t = time.perf_counter()
    torch.onnx.export(
        model,
        (ids,),
        str(folder / "fp32.onnx"),
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}},
        opset_version=18,
        dynamo=True,
        external_data=True,
    )
    print(f"  exported {size} in {time.perf_counter() - t:.0f} s", flush=True)
    del model
    t = time.perf_counter()
    quantize_int4(folder / "fp32.onnx", folder / "int4.onnx")
    print(f"  quantized {size} to int4 in {time.perf_counter() - t:.0f} s", flush=True)
    rng = np.random.default_rng(1)
    np.savez(folder / "ids.npz", input_ids=rng.integers(0, VOCAB, (samples, seq)).astype(np.int64))


def measure(mode: str, folder: Path, samples: int, *extra: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(folder), str(samples), *extra],
        capture_output=True,
        text=True,
        cwd=folder,
        env=env,
    )
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"seconds": float("nan"), "peak_mb": float("nan"), "error": tail[:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bytes(path: Path) -> int:
    return path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + ".data"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="20M,120M,500M", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--samples", default="4", help="samples per run; a list (4,64) measures each")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sample")
    ap.add_argument("--modes", default="floor,diag,ort", help="floor, diag, acc4, ort, tiers")
    ap.add_argument("--target", default="cosine>=0.99", help="the tiers run's target")
    ap.add_argument("--time-budget", default="1200", help="the tiers run's --time-budget, seconds")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "diag-bench" / "llm")
    args = ap.parse_args()
    counts = [int(s) for s in args.samples.split(",")]
    rows = []
    for size in args.sizes.split(","):
        folder = args.cache / f"{size}-s{args.seq}"
        print(f"{size}: building in {folder}", flush=True)
        build(size, folder, max(counts), args.seq)
        weights = _bytes(folder / "fp32.onnx") + _bytes(folder / "int4.onnx")
        for n in counts:
            for mode in args.modes.split(","):
                extra = (args.target, args.time_budget) if mode == "tiers" else ()
                r = measure(mode, folder, n, *extra)
                rows.append((size, n, mode, r, weights))
                print(f"  {size} {n} samples {mode}: {json.dumps(r)}", flush=True)
    print()
    print("| size | samples | mode | wall s | peak RSS MB | RSS / model bytes | 1.5 x model + 1 GB | wall / floor |")
    print("|---|---|---|---|---|---|---|---|")
    floors = {(s, n): r["seconds"] for s, n, m, r, _ in rows if m == "floor"}
    for size, n, mode, r, weights in rows:
        mb = weights / 2**20
        bound = 1.5 * mb + 1024
        ratio = r["seconds"] / floors[(size, n)] if (size, n) in floors else float("nan")
        note = f" ({r['pairs']} pairs)" if "pairs" in r else (f" (exit {r['exit']})" if "exit" in r else "")
        note += f" error: {r['error']}" if "error" in r else ""
        print(
            f"| {size} | {n} | {mode}{note} | {r['seconds']:.1f} | {r['peak_mb']:.0f} | "
            f"{r['peak_mb'] / mb:.2f} | {'within' if r['peak_mb'] <= bound else 'OVER'} ({bound:.0f}) | x{ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
