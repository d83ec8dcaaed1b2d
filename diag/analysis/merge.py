"""Shard files and ``diag merge``: a run's mergeable state as JSON, and shards added back into one run.

``diag compare --shard k/n`` runs batches k, k + n, k + 2n, ... and writes, next to its own
(partial) report, the accumulators themselves into ``diag.json["shard"]["state"]``: running sums,
maxima, per-channel arrays and histogram bins. ``diag merge part*/diag.json --out all/`` reads
them back, merges them and runs the same analysis as one run over every batch.

The state is written and read by the accumulators themselves (:class:`diag.core.state.Accumulator`:
``CompareState.to_state`` / ``from_state``); this module only checks that the shards belong to one
run and hands the merged state to the analysis. Layout version 2 (dynamic scales as a bounded
summary, FP16 range counts); version-1 shard files are still read.

NOTE: the state is plain JSON, never pickles (shard files travel between machines and users).
Floats are written with Python's shortest round-trip repr, so a number read back is bit for bit
the number written; only the order of the sums differs from one run (equal to float tolerance),
and histograms are exactly equal (their bins do not depend on batch order).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import onnx

from diag.analysis.compare import CompareOptions, CompareResult, CompareState, exclusion_target, finish, load_pair
from diag.analysis.headline import ExcludeCommand, NextSearch
from diag.core.match import match_models
from diag.foundations.errors import DiagError
from diag.foundations.untrusted import fields_of


def state_to_json(state: CompareState) -> dict[str, Any]:
    """The accumulators of ``state`` as a JSON-ready dict (no tensors: sums, maxima, bins).

    The state is written through the accumulators' own ``to_state`` (:mod:`diag.core.state`); a
    ``--metric`` plugin's spec travels with its state (:class:`diag.core.taskmetrics.PluginMetric`).

    Example:
        >>> s = state_to_json(CompareState())
        >>> s["version"], s["samples"]
        (2, 0)
    """
    return state.to_state()


def state_from_json(d: dict[str, Any]) -> CompareState:
    """Rebuild a :class:`CompareState` written by :func:`state_to_json` (or by a version-1 diag).

    Example:
        >>> state_from_json(state_to_json(CompareState())).samples
        0
    """
    return CompareState.from_state(d)


def graph_fingerprint(model: onnx.ModelProto) -> str:
    """A hash of a model's structure (node names, op types, wiring, weight names and shapes), not its weights.

    Shards record it so that ``diag merge`` can refuse to add up statistics of one model and
    analyse them against another (``--fp32``/``--int8`` pointing at a different model); weights
    are left out so that hashing stays cheap for multi-GB models.
    """

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
        "state": state_to_json(result.state),
    }
    doc["run"]["shard"] = f"{k}/{n}"
    doc["run"]["inputs"] = f"{result.input_description}, shard {k}/{n} (batches {k}, {k + n}, ...)"
    return doc


def merge_shards(
    docs: list[tuple[str, dict[str, Any]]],
    fp32: str | os.PathLike[str] | None = None,
    int8: str | os.PathLike[str] | None = None,
) -> CompareResult:
    """Merge the states of shard files into the result one run over every batch would give.

    Every shard 0/n ... (n-1)/n must be given exactly once, all from the same models, inputs and
    settings. The models are read again (by the paths the shards recorded, or ``fp32`` /
    ``int8`` when they moved) for the analysis; no model is run. ``seconds`` is the sum of the
    shards' times (compute spent, not wall time).

    Example:
        >>> paths = ["part0/diag.json", "part1/diag.json"]
        >>> r = merge_shards([(p, diag.report.documents.read_document(p)) for p in paths])  # doctest: +SKIP
        >>> r.samples  # doctest: +SKIP
        32
    """
    start = time.perf_counter()
    if not docs:
        raise DiagError("bad-option", "diag merge", "needs at least one shard diag.json", "diag merge part*/diag.json")
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
    _check_shards(docs)
    first_path, first = docs[0]
    fp, q = load_pair(
        os.fspath(fp32 or first["models"]["fp32"]["path"]), os.fspath(int8 or first["models"]["int8"]["path"])
    )
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
        metric=_plugin_spec(first),
    )
    seconds = sum(float(doc["run"]["seconds"]) for _, doc in docs) + (time.perf_counter() - start)
    result = finish(fp, q, matching, state, unmatched, first["shard"]["inputs"], options, seconds)
    # The shards recorded the recipe the fix re-quantizes with; the models may have moved since.
    result.fix_recipe = first.get("recommendation", {}).get("recipe")
    # The shards' command carries their paths and inputs; its target is the merged run's (each
    # shard chose one from its own samples' worst cosine).
    result.headline.search = NextSearch(_shard_command(first, exclusion_target(result.verdicts)))
    return result


def _shard_command(doc: dict[str, Any], target: str) -> ExcludeCommand | None:
    """The exclude command a shard recorded, aimed at ``target``; None when the shard has none or
    it is not the three strings diag writes (a shard file is read as untrusted input)."""
    search = (((doc.get("verdict") or {}).get("headline") or {}).get("search") or {}).get("command")
    parts = [search.get(k) for k in ("fp32", "int8", "feeds")] if isinstance(search, dict) else []
    fp32, int8, feeds = parts if len(parts) == 3 else [None] * 3
    if not (isinstance(fp32, str) and isinstance(int8, str) and isinstance(feeds, str)):
        return None
    return ExcludeCommand(fp32, int8, feeds, target)


def _plugin_spec(doc: dict[str, Any]) -> Any:
    """The ``--metric`` spec a shard's state records (None without a plugin)."""
    return ((doc["shard"]["state"].get("task") or {}).get("plugin") or {}).get("spec")


def _check_shards(docs: list[tuple[str, dict[str, Any]]]) -> None:
    """Every file is a shard with a state this diag reads, all of one run, each shard exactly once."""
    for p, doc in docs:
        shard = doc.get("shard")
        if not isinstance(shard, dict) or not isinstance(shard.get("state"), dict):
            raise DiagError(
                "bad-report",
                f"'{p}'",
                "has no shard state (it was not written by diag compare --shard k/n)",
                "merge the diag.json files of diag compare --shard runs",
            )
        version = shard["state"].get("version")
        if version not in CompareState.READS_VERSIONS:
            raise DiagError(
                "bad-report",
                f"'{p}'",
                f"has shard state version {version}, this diag reads "
                + " and ".join(str(v) for v in CompareState.READS_VERSIONS),
                "merge shards written by the same diag version",
            )
    _check_same_run(docs)
    n = docs[0][1]["shard"]["count"]
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


def _check_same_run(docs: list[tuple[str, dict[str, Any]]]) -> None:
    """The shards agree on count, models, inputs and options (else ``bad-report`` naming both files)."""
    first_path, first = docs[0]
    checks: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("shard count", lambda d: d["shard"]["count"]),
        ("models (graph fingerprints)", lambda d: d["shard"].get("graphs")),
        ("FP32 model", lambda d: d["models"]["fp32"]["path"]),
        ("INT8 model", lambda d: d["models"]["int8"]["path"]),
        ("inputs", lambda d: d["shard"]["inputs"]),
        ("opt_level", lambda d: d["run"]["opt_level"]),
        ("local_error", lambda d: d["run"]["local_error"]),
        ("task metrics", lambda d: sorted(d["shard"]["state"].get("task") or {})),
        ("--metric", _plugin_spec),
    ]
    for key, get in checks:
        for p, doc in docs[1:]:
            if get(doc) != get(first):
                raise DiagError(
                    "bad-report",
                    f"'{p}'",
                    f"has {key} {get(doc)!r}, '{first_path}' has {get(first)!r}",
                    "merge shards of one run only (same models, inputs and options)",
                )


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
