"""Shard files and ``diag merge``: a run's mergeable state as JSON, and shards added back into one run.

``diag compare --shard k/n`` runs batches k, k + n, k + 2n, ... and writes, next to its own
(partial) report, the accumulators themselves into ``diag.json["shard"]["state"]``: running sums,
maxima, per-channel arrays and histogram bins. ``diag merge part*/diag.json --out all/`` reads
them back, merges them and runs the same analysis as one run over every batch.

NOTE: the state is plain JSON, never pickles (shard files travel between machines and users).
Floats are written with Python's shortest round-trip repr, so a number read back is bit for bit
the number written; only the order of the sums differs from one run (equal to float tolerance),
and histograms are exactly equal (their bins do not depend on batch order).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from diag.compare import CompareOptions, CompareResult, CompareState, finish, load_pair
from diag.distributions import DistributionAccumulator, GridInfo, Pow2Histogram
from diag.documents import fields_of
from diag.errors import DiagError
from diag.instrument import FusedKernel
from diag.jsonnum import json_number, number_from_json
from diag.match import match_models
from diag.metrics import ErrorAccumulator, OutputAccumulator, OutputSpec
from diag.taskmetrics import attach_task_metrics, task_state_from_json, task_state_to_json

#: Version of the ``shard.state`` layout; ``diag merge`` refuses others.
STATE_VERSION = 1


def _f(x: float) -> float | str:
    """A float for JSON: finite values exact (bit-for-bit round trip), others as "inf" / "-inf" / "nan"."""
    return json_number(float(x), digits=None)  # type: ignore[return-value]  # a float is never None


def _u(v: float | str | int) -> float:
    return number_from_json(v, strict=True)  # a malformed value is ValueError, which fields_of reports


def _error_state(acc: ErrorAccumulator) -> dict[str, Any]:
    return {k: (getattr(acc, k) if isinstance(getattr(acc, k), int) else _f(getattr(acc, k))) for k in acc.__slots__}


def _error_from(d: dict[str, Any]) -> ErrorAccumulator:
    acc = ErrorAccumulator()
    for k in acc.__slots__:
        setattr(acc, k, int(d[k]) if isinstance(getattr(acc, k), int) else _u(d[k]))
    return acc


_OUTPUT_INTS = ("samples", "nonfinite", "nonfinite_fp", "total", "rows", "agree", "mask_inter", "mask_union")
_OUTPUT_FLOATS = ("cos_min", "cos_sum", "max_abs", "fp_absmax")


def _output_state(acc: OutputAccumulator) -> dict[str, Any]:
    d: dict[str, Any] = {k: getattr(acc, k) for k in _OUTPUT_INTS}
    d.update({k: _f(getattr(acc, k)) for k in _OUTPUT_FLOATS})
    d["classlike"] = acc.classlike
    d["spec"] = acc.spec.to_dict()
    d["parts"] = {k: _output_state(a) for k, a in acc.parts.items()}
    d["part_errors"] = {k: _error_state(a) for k, a in acc.part_errors.items()}
    d["part_local"] = {k: _error_state(a) for k, a in acc.part_local.items()}
    return d


def _output_from(d: dict[str, Any]) -> OutputAccumulator:
    acc = OutputAccumulator(OutputSpec.from_dict(d["spec"]) if d.get("spec") else None)
    for k in _OUTPUT_INTS:
        setattr(acc, k, int(d.get(k, 0)))
    for k in _OUTPUT_FLOATS:
        if k in d:
            setattr(acc, k, _u(d[k]))
    acc.classlike = bool(d["classlike"])
    acc.parts = {k: _output_from(v) for k, v in (d.get("parts") or {}).items()}
    acc.part_errors = {k: _error_from(v) for k, v in (d.get("part_errors") or {}).items()}
    acc.part_local = {k: _error_from(v) for k, v in (d.get("part_local") or {}).items()}
    return acc


def _array(a: np.ndarray | None) -> list[float | str] | None:
    return None if a is None else [_f(x) for x in a.tolist()]


def _unarray(v: list[float | str] | None) -> np.ndarray | None:
    return None if v is None else np.array([_u(x) for x in v], dtype=np.float64)


def _distribution_state(acc: DistributionAccumulator) -> dict[str, Any]:
    g = acc.grid
    return {
        "grid": None if g is None else {"scale": g.scale, "zero_point": g.zero_point, "qmin": g.qmin, "qmax": g.qmax},
        "channel_hint": acc.channel_hint,
        "fp": acc.fp.state(),
        "int8": acc.int8.state(),
        "count": acc.count,
        "clipped_low": acc.clipped_low,
        "clipped_high": acc.clipped_high,
        "fp_min": _f(acc.fp_min),
        "fp_max": _f(acc.fp_max),
        "axis": acc.axis,
        "rank": acc.rank,
        "ch_min": _array(acc.ch_min),
        "ch_max": _array(acc.ch_max),
        "ch_sum": _array(acc.ch_sum),
        "ch_count": acc.ch_count,
        "channel_consistent": acc.channel_consistent,
        "dyn_scales": [_f(x) for x in acc.dyn_scales],
    }


def _distribution_from(d: dict[str, Any]) -> DistributionAccumulator:
    grid = None if d["grid"] is None else GridInfo(**d["grid"])
    acc = DistributionAccumulator(grid, d["channel_hint"])
    acc.fp = Pow2Histogram.from_state(d["fp"])
    acc.int8 = Pow2Histogram.from_state(d["int8"])
    for k in ("count", "clipped_low", "clipped_high", "ch_count"):
        setattr(acc, k, int(d[k]))
    acc.fp_min, acc.fp_max = _u(d["fp_min"]), _u(d["fp_max"])
    acc.axis, acc.rank = d["axis"], d["rank"]
    acc.ch_min, acc.ch_max, acc.ch_sum = _unarray(d["ch_min"]), _unarray(d["ch_max"]), _unarray(d["ch_sum"])
    acc.channel_consistent = bool(d["channel_consistent"])
    acc.dyn_scales = [_u(x) for x in d["dyn_scales"]]
    return acc


def state_to_json(state: CompareState, metric: str | None = None) -> dict[str, Any]:
    """The accumulators of ``state`` as a JSON-ready dict (no tensors: sums, maxima, bins).

    Example:
        >>> s = state_to_json(CompareState())
        >>> s["version"], s["samples"]
        (1, 0)
    """
    return {
        "version": STATE_VERSION,
        "samples": state.samples,
        "batches": state.batches,
        "passes": state.passes,
        "labelled": dict(state.labelled),
        "accumulated": {k: _error_state(a) for k, a in state.accumulated.items()},
        "local": {k: _error_state(a) for k, a in state.local.items()},
        "outputs": {k: _output_state(a) for k, a in state.outputs.items()},
        "distributions": {k: _distribution_state(a) for k, a in state.distributions.items()},
        "deployed": {k: _output_state(a) for k, a in state.deployed.items()},
        "fused": [asdict(k) for k in state.fused],
        # Task metrics (F1 counts, a --metric plugin's state() with its module:function).
        "task": task_state_to_json(state.task, metric),
    }


def state_from_json(d: dict[str, Any]) -> CompareState:
    """Rebuild a :class:`CompareState` written by :func:`state_to_json`.

    Example:
        >>> state_from_json(state_to_json(CompareState())).samples
        0
    """
    return CompareState(
        accumulated={k: _error_from(v) for k, v in d["accumulated"].items()},
        local={k: _error_from(v) for k, v in d["local"].items()},
        outputs={k: _output_from(v) for k, v in d["outputs"].items()},
        distributions={k: _distribution_from(v) for k, v in d["distributions"].items()},
        labelled={k: int(v) for k, v in d["labelled"].items()},
        samples=int(d["samples"]),
        batches=int(d["batches"]),
        passes=int(d["passes"]),
        deployed={k: _output_from(v) for k, v in d["deployed"].items()},
        fused=[FusedKernel(**k) for k in d["fused"]],
        task=task_state_from_json(d.get("task"))[0],
    )


def graph_fingerprint(model: Any) -> str:
    """A hash of a model's structure (node names, op types, wiring, weight names and shapes), not its weights.

    Shards record it so that ``diag merge`` can refuse to add up statistics of one model and
    analyse them against another (``--fp32``/``--int8`` pointing at a different model); weights
    are left out so that hashing stays cheap for multi-GB models.
    """
    import hashlib

    h = hashlib.sha256()
    for n in model.graph.node:
        h.update(f"{n.name}|{n.op_type}|{','.join(n.input)}|{','.join(n.output)}\n".encode())
    for t in model.graph.initializer:
        h.update(f"{t.name}:{list(t.dims)}\n".encode())
    return h.hexdigest()[:32]


def add_shard_state(doc: dict[str, Any], result: CompareResult) -> dict[str, Any]:
    """Put the shard's mergeable state into its ``diag.json`` document (in place; returns it).

    The rest of the document stays the shard's own partial view; ``run.inputs`` says which
    shard it is so nobody mistakes it for the whole run.

    Example:
        >>> doc = add_shard_state(document_from_result(result), result)  # doctest: +SKIP
        >>> doc["shard"]["index"], doc["shard"]["count"]  # doctest: +SKIP
        (3, 8)
    """
    assert result.options.shard is not None and result.state is not None
    k, n = result.options.shard
    doc["shard"] = {
        "index": k,
        "count": n,
        "inputs": result.input_description,
        "outlier_factor": result.options.outlier_factor,
        "runtime_unmatched": dict(result.runtime_unmatched),
        "graphs": {"fp32": graph_fingerprint(result.fp32.proto), "int8": graph_fingerprint(result.int8.proto)},
        "state": state_to_json(result.state, result.options.metric),
    }
    doc["run"]["shard"] = f"{k}/{n}"
    doc["run"]["inputs"] = f"{result.input_description}, shard {k}/{n} (batches {k}, {k + n}, ...)"
    return doc


def merge_shards(
    paths: list[str | os.PathLike[str]],
    fp32: str | os.PathLike[str] | None = None,
    int8: str | os.PathLike[str] | None = None,
) -> CompareResult:
    """Merge the states of shard files into the result one run over every batch would give.

    Every shard 0/n ... (n-1)/n must be given exactly once, all from the same models, inputs and
    settings. The models are read again (by the paths the shards recorded, or ``fp32`` /
    ``int8`` when they moved) for the analysis; no model is run. ``seconds`` is the sum of the
    shards' times (compute spent, not wall time).

    Example:
        >>> r = merge_shards(["part0/diag.json", "part1/diag.json"])  # doctest: +SKIP
        >>> r.samples  # doctest: +SKIP
        32
    """
    from diag.report import load_document

    start = time.perf_counter()
    if not paths:
        raise DiagError("bad-option", "diag merge", "needs at least one shard diag.json", "diag merge part*/diag.json")
    docs = [(str(p), load_document(p)) for p in paths]
    # NOTE: the documents passed the schema; a field it does not pin down that the merge cannot use
    # is the shard file's fault (bad-report naming the files), not an internal error.
    with fields_of("' / '".join(p for p, _ in docs)):
        return _merge_documents(docs, fp32, int8, start)


def _merge_documents(
    docs: list[tuple[str, dict[str, Any]]],
    fp32: str | os.PathLike[str] | None,
    int8: str | os.PathLike[str] | None,
    start: float,
) -> CompareResult:
    for p, doc in docs:
        shard = doc.get("shard")
        if not isinstance(shard, dict) or not isinstance(shard.get("state"), dict):
            raise DiagError(
                "bad-report",
                f"'{p}'",
                "has no shard state (it was not written by diag compare --shard k/n)",
                "merge the diag.json files of diag compare --shard runs",
            )
        if shard["state"].get("version") != STATE_VERSION:
            raise DiagError(
                "bad-report",
                f"'{p}'",
                f"has shard state version {shard['state'].get('version')}, this diag reads {STATE_VERSION}",
                "merge shards written by the same diag version",
            )
    first_path, first = docs[0]
    n = first["shard"]["count"]

    def same(key: str, get: Any) -> None:
        for p, doc in docs[1:]:
            if get(doc) != get(first):
                raise DiagError(
                    "bad-report",
                    f"'{p}'",
                    f"has {key} {get(doc)!r}, '{first_path}' has {get(first)!r}",
                    "merge shards of one run only (same models, inputs and options)",
                )

    same("shard count", lambda d: d["shard"]["count"])
    same("models (graph fingerprints)", lambda d: d["shard"].get("graphs"))
    same("FP32 model", lambda d: d["models"]["fp32"]["path"])
    same("INT8 model", lambda d: d["models"]["int8"]["path"])
    same("inputs", lambda d: d["shard"]["inputs"])
    same("opt_level", lambda d: d["run"]["opt_level"])
    same("local_error", lambda d: d["run"]["local_error"])
    same("task metrics", lambda d: sorted(d["shard"]["state"].get("task") or {}))
    same("--metric", lambda d: ((d["shard"]["state"].get("task") or {}).get("plugin") or {}).get("spec"))
    seen: dict[int, str] = {}
    for p, doc in docs:
        k = doc["shard"]["index"]
        if k in seen:
            raise DiagError(
                "bad-report", f"'{p}'", f"is shard {k}/{n} again (also '{seen[k]}')", "give each shard once"
            )
        seen[k] = p
    missing = [f"{k}/{n}" for k in range(n) if k not in seen]
    if missing:
        raise DiagError(
            "bad-report",
            "shards",
            f"{', '.join(missing)} missing ({len(seen)} of {n} given)",
            "merge every shard of the run, or the result is not the whole run",
        )
    fp, q = load_pair(fp32 or first["models"]["fp32"]["path"], int8 or first["models"]["int8"]["path"])
    _check_same_models(first_path, first, fp, q)
    matching = match_models(fp.proto, q.proto)
    state = CompareState()
    unmatched: dict[str, str] = {}
    for p, doc in sorted(docs, key=lambda pd: pd[1]["shard"]["index"]):
        with fields_of(p):
            state.merge(state_from_json(doc["shard"]["state"]))
        unmatched.update(doc["shard"]["runtime_unmatched"])
    known = {t for t in matching.fp_float_tensors} | set(
        fp.proto.graph.output[i].name for i in range(len(fp.proto.graph.output))
    )
    foreign = sorted(set(state.accumulated) - known)
    if foreign:
        raise DiagError(
            "model-mismatch",
            f"shards '{first_path}' ...",
            f"hold statistics of tensor '{foreign[0]}', which the FP32 model '{fp.path}' does not have",
            "merge shards with the models they were run on (--fp32/--int8)",
        )
    options = CompareOptions(
        opt_level=first["run"]["opt_level"],
        local=bool(first["run"]["local_error"]),
        progress=False,
        outlier_factor=float(first["shard"]["outlier_factor"]),
        metric=((first["shard"]["state"].get("task") or {}).get("plugin") or {}).get("spec"),
    )
    seconds = sum(float(doc["run"]["seconds"]) for _, doc in docs) + (time.perf_counter() - start)
    result = finish(fp, q, matching, state, unmatched, first["shard"]["inputs"], options, seconds)
    # The shards recorded the recipe the fix re-quantizes with; the models may have moved since.
    result.fix_recipe = first.get("recommendation", {}).get("recipe")
    attach_task_metrics(result, state, options.metric)
    return result


def _check_same_models(path: str, doc: dict[str, Any], fp: Any, q: Any) -> None:
    """The models read now must be the ones the shards ran on (their recorded graph fingerprints)."""
    graphs = doc["shard"].get("graphs")
    if not isinstance(graphs, dict):
        return  # a shard written before fingerprints: the tensor-name check below still applies
    for role, model in (("fp32", fp), ("int8", q)):
        if graphs.get(role) != graph_fingerprint(model.proto):
            raise DiagError(
                "model-mismatch",
                f"{role.upper()} model '{model.path}'",
                f"is not the model the shards ran on (shard '{path}' records another graph)",
                f"pass the {role.upper()} model the shards were computed with, or re-run the shards",
            )
