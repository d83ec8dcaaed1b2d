"""Benchmark: diag on Llama-architecture decoders quantized to 4 bits, at sizes up to > 2 GB.

Not collected by pytest (no ``test_`` prefix). Needs the ``bench`` extra (torch, transformers,
onnxscript; never in the base install)::

    pip install torch==2.13.0 && pip install ".[bench]"
    python tests/perf/bench_llm.py --sizes 20M,120M,500M --samples 4 --seq 128
    python tests/perf/bench_llm.py --sizes 20M --samples 4 --kv-cache --modes floor,diag

Per size it builds a ``LlamaForCausalLM`` with seeded random weights from a ``LlamaConfig``,
exports it with ``torch.onnx.export(dynamo=True, external_data=True)``, quantizes it with
onnxruntime's ``MatMulNBitsQuantizer`` (4 bits, block 32, symmetric RTN), caches both under
``--cache`` (one folder per size, variant and shape) and prints wall time and peak RSS
(``VmHWM``, each run in a fresh process) of the modes below. ``--variant`` picks the export:

* plain (``<size>-s<seq>``): no KV cache; input ``input_ids [batch, seq]``, output ``logits``;
  inputs in ``ids.npz`` (``--seq`` tokens per sample, 128 by default);
* kv (``<size>-s<seq>-p<past>-kv``; ``--kv-cache`` is ``--variant kv``): a decode step with a
  cache, named as onnxruntime-genai and optimum name it: inputs ``input_ids [batch, seq]``,
  ``attention_mask [batch, total]`` (total = past + seq), ``position_ids [batch, seq]`` and per
  layer ``past_key_values.{i}.key`` / ``.value [batch, kv_heads, past, head_dim]``; outputs
  ``logits`` and ``present.{i}.key`` / ``.value [batch, kv_heads, past + seq, head_dim]``. The
  model is a ``LlamaForCausalLM`` subclass whose ``forward`` takes the past tensors flat, builds a
  ``DynamicCache`` from them and returns the cache's tensors flat (so module paths, hence
  diag's per-layer view, are those of the plain export). ``inputs.npz`` holds every input, one
  row per sample (``--seq`` 16 new tokens after a ``--past`` 64 prefix by default); each
  sample's past is the FP32 torch model's own cache over a random prefix, so it is realistic.

The modes (``--modes``; floor and ort feed every array of the inputs file):

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
import tempfile
import time
from pathlib import Path
from typing import Any

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
fp, q = folder / "fp32.onnx", folder / "int4.onnx"
inputs = folder / "inputs.npz" if (folder / "inputs.npz").exists() else folder / "ids.npz"
start = time.perf_counter()
extra = {}
if mode in ("diag", "acc4"):
    from diag.cli.commands import main
    more = ["--accuracy-level-check", "4"] if mode == "acc4" else []
    code = main(["compare", str(fp), str(q), "--inputs", str(inputs), "--samples", str(samples),
                 "--out", str(folder / "out"), "--quiet", *more])
    assert code == 0, code
elif mode == "floor":
    import onnx
    from diag.core.instrument import exposed_model
    from diag.core.run import session_from_model
    with np.load(inputs) as z:
        arrays = {k: z[k][:samples] for k in z.files}
    feeds = [{k: v[i:i + 1] for k, v in arrays.items()} for i in range(len(next(iter(arrays.values()))))]
    for path in (fp, q):
        m = onnx.load(str(path), load_external_data=False)
        names = [o for n in m.graph.node for o in n.output if o]
        s = session_from_model(exposed_model(m, names), "floor", "disabled", None, folder, takes_turns=True)
        for feed in feeds:
            for v in s.run(None, feed):
                float(np.asarray(v).ravel()[:1].sum()) if v.size else 0.0
        del s, m
elif mode == "ort":
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations, create_activation_matching, modify_model_output_intermediate_tensors)
    with np.load(inputs) as z:
        arrays = {k: z[k][:samples] for k in z.files}
    feeds = [{k: v[i:i + 1] for k, v in arrays.items()} for i in range(len(next(iter(arrays.values()))))]
    class R(CalibrationDataReader):
        def __init__(self):
            self.i = 0
        def get_next(self):
            if self.i >= len(feeds):
                return None
            self.i += 1
            return feeds[self.i - 1]
    for src, dst in ((fp, "fp_aug.onnx"), (q, "q_aug.onnx")):
        modify_model_output_intermediate_tensors(str(src), str(folder / dst), save_as_external_data=True)
    a = collect_activations(str(folder / "fp_aug.onnx"), R())
    b = collect_activations(str(folder / "q_aug.onnx"), R())
    extra = {"pairs": len(create_activation_matching(b, a))}
elif mode == "tiers":
    from diag.cli.commands import main
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

    if not (folder / "int4.onnx").exists():
        _export(size, folder, seq)
    ids = folder / "ids.npz"
    if ids.exists():
        with np.load(ids) as z:
            if len(z["input_ids"]) >= samples:
                return
    # Seeded: a longer file starts with the rows of a shorter one (a cache built for 4 samples
    # once served a 64-sample run its 4 rows).
    rng = np.random.default_rng(1)
    np.savez(ids, input_ids=rng.integers(0, VOCAB, (samples, seq)).astype(np.int64))


def _export(size: str, folder: Path, seq: int) -> None:
    """Export one size to ``folder/fp32.onnx`` (external data) and quantize it to ``int4.onnx``."""
    import torch
    from transformers import LlamaForCausalLM

    from diag.fixtures.llm_models import quantize_int4

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(size, seq, use_cache=False)).eval()
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


def _check_rows(folder: Path, samples: int) -> None:
    """Refuse a cached inputs file with fewer rows than asked for (the run would measure fewer)."""
    import numpy as np

    path = folder / "inputs.npz" if (folder / "inputs.npz").exists() else folder / "ids.npz"
    with np.load(path) as z:
        rows = min(len(z[k]) for k in z.files)
    if rows < samples:
        raise SystemExit(f"{path} holds {rows} samples, fewer than {samples}: delete {folder} to build it again")


def _config(size: str, positions: int, use_cache: bool) -> Any:
    """The ``LlamaConfig`` of one size (``num_key_value_heads`` = heads, as in the plain variant)."""
    from transformers import LlamaConfig

    hidden, inter, layers, heads = SIZES[size]
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        max_position_embeddings=max(positions, 256),
        use_cache=use_cache,
    )


def _kv_names(layers: int) -> tuple[list[str], list[str]]:
    """``past_key_values.{i}.key/value`` inputs and ``present.{i}.key/value`` outputs, layer by layer."""
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return past, [n.replace("past_key_values.", "present.", 1) for n in past]


def build_kv(size: str, folder: Path, samples: int, seq: int, past: int) -> None:
    """Export (with a KV cache) and quantize one size into ``folder`` (skipped when the files are there)."""
    import numpy as np

    if (folder / "int4.onnx").exists() and (folder / "inputs.npz").exists():
        return
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    from diag.fixtures.llm_models import quantize_int4

    layers = SIZES[size][2]

    class KvLlama(LlamaForCausalLM):
        """Flat tensors in and out: ``torch.export`` sees no ``Cache`` object, module paths stay."""

        def forward(  # type: ignore[override]
            self, input_ids: Any, attention_mask: Any, position_ids: Any, *past_kv: Any
        ) -> tuple[Any, ...]:
            cache = DynamicCache(ddp_cache_data=list(zip(past_kv[0::2], past_kv[1::2], strict=True)))
            out = super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            return (out.logits, *(t for layer in out.cache.layers for t in (layer.keys, layer.values)))

    torch.manual_seed(0)  # the same weights as the plain variant of this size
    model = KvLlama(_config(size, past + seq, use_cache=True)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    past_names, present_names = _kv_names(layers)
    rng = np.random.default_rng(1)
    rows: dict[str, list[np.ndarray]] = {n: [] for n in ["input_ids", "attention_mask", "position_ids", *past_names]}
    with torch.no_grad():
        for _ in range(samples):  # each sample's past: the FP32 model's cache over a random prefix
            prefix = torch.from_numpy(rng.integers(0, VOCAB, (1, past)).astype(np.int64))
            cache = LlamaForCausalLM.forward(model, input_ids=prefix, use_cache=True).cache
            rows["input_ids"].append(rng.integers(0, VOCAB, (1, seq)).astype(np.int64))
            rows["attention_mask"].append(np.ones((1, past + seq), np.int64))
            rows["position_ids"].append(np.arange(past, past + seq, dtype=np.int64)[None])
            for layer, (k, v) in enumerate((c.keys, c.values) for c in cache.layers):
                rows[f"past_key_values.{layer}.key"].append(k.numpy())
                rows[f"past_key_values.{layer}.value"].append(v.numpy())
    arrays = {n: np.concatenate(r) for n, r in rows.items()}  # leading axis = sample (= batch of 1)
    example = tuple(torch.from_numpy(a[:1]) for a in arrays.values())
    batch, new, total, cached = (torch.export.Dim(n) for n in ("batch", "seq", "total", "past"))
    t = time.perf_counter()
    torch.onnx.export(
        model,
        example,
        str(folder / "fp32.onnx"),
        input_names=list(arrays),
        output_names=["logits", *present_names],
        dynamic_shapes=(
            {0: batch, 1: new},
            {0: batch, 1: total},
            {0: batch, 1: new},
            tuple({0: batch, 2: cached} for _ in past_names),  # the *past_kv of forward
        ),
        opset_version=18,
        dynamo=True,
        external_data=True,
    )
    print(f"  exported {size} with a KV cache in {time.perf_counter() - t:.0f} s", flush=True)
    with torch.no_grad():
        want = model(*example)[0].numpy()
    del model
    import onnxruntime as ort

    got = ort.InferenceSession(str(folder / "fp32.onnx"), providers=["CPUExecutionProvider"]).run(
        ["logits"], {n: a[:1] for n, a in arrays.items()}
    )[0]
    print(f"  onnxruntime vs torch logits, sample 0: max |diff| {float(np.abs(got - want).max()):.2e}", flush=True)
    t = time.perf_counter()
    quantize_int4(folder / "fp32.onnx", folder / "int4.onnx")
    print(f"  quantized {size} to int4 in {time.perf_counter() - t:.0f} s", flush=True)
    np.savez(folder / "inputs.npz", **arrays)  # type: ignore[arg-type]


def measure(mode: str, folder: Path, samples: int, *extra: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # NOTE: not in the model's folder: a session built from memory that finds its external data
    # only relative to the current folder would pass here and fail for a user (it did).
    with tempfile.TemporaryDirectory(prefix="diag-bench-") as cwd:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(folder), str(samples), *extra],
            capture_output=True,
            text=True,
            cwd=cwd,
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
    ap.add_argument("--seq", type=int, help="tokens per sample (new tokens with a KV cache); 128, kv: 16")
    ap.add_argument("--past", type=int, default=64, help="kv variant: cached tokens per sample")
    ap.add_argument("--variant", default="plain", help="comma-separated, of plain, kv (with a KV cache)")
    ap.add_argument("--kv-cache", action="store_true", help="the kv variant only (same as --variant kv)")
    ap.add_argument("--modes", default="floor,diag,ort", help="floor, diag, acc4, ort, tiers")
    ap.add_argument("--target", default="cosine>=0.99", help="the tiers run's target")
    ap.add_argument("--time-budget", default="1200", help="the tiers run's --time-budget, seconds")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "diag-bench" / "llm")
    args = ap.parse_args()
    counts = [int(s) for s in args.samples.split(",")]
    variants = ["kv"] if args.kv_cache else args.variant.split(",")
    if unknown := [v for v in variants if v not in ("plain", "kv")]:
        ap.error(f"unknown variant {unknown[0]!r} (plain, kv)")
    rows = []
    for size in args.sizes.split(","):
        for variant in variants:
            if variant == "kv":
                seq = args.seq or 16
                label, folder = f"{size} kv", args.cache / f"{size}-s{seq}-p{args.past}-kv"
                print(f"{label}: building in {folder}", flush=True)
                build_kv(size, folder, max(counts), seq, args.past)
            else:
                seq = args.seq or 128
                label, folder = size, args.cache / f"{size}-s{seq}"
                print(f"{label}: building in {folder}", flush=True)
                build(size, folder, max(counts), seq)
            _check_rows(folder, max(counts))
            weights = _bytes(folder / "fp32.onnx") + _bytes(folder / "int4.onnx")
            for n in counts:
                for mode in args.modes.split(","):
                    extra = (args.target, args.time_budget) if mode == "tiers" else ()
                    r = measure(mode, folder, n, *extra)
                    rows.append((label, n, mode, r, weights))
                    print(f"  {label} {n} samples {mode}: {json.dumps(r)}", flush=True)
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
