"""diag: find which operator broke an INT8 ONNX model, and what to do about it.

The public API (everything else is internal and may change)::

    from diag import diagnose, compare_models, FeedSpec, CompareOptions, DiagError

``diagnose`` is what ``diag compare`` computes (the diagnosis, plus the fix recipe,
``--sensitivity`` and ``--scheduler``); ``compare_models`` is the diagnosis alone. Each verb's
options are a frozen dataclass (``CompareOptions``, ``ExcludeOptions``, ``SweepOptions``, ...)
and its ``*_to_dir`` function writes what the verb writes and returns a ``Summary``: the lines the
verb prints, its result (``.result``) and the files written (``.files``).

NOTE: attributes are imported lazily so that ``diag --help`` does not pay for numpy, onnx and
onnxruntime imports.
"""

from __future__ import annotations

from typing import Any

from diag.environment import __version__ as __version__

_LAZY = {
    "CompareOptions": "diag.compare",
    "CompareResult": "diag.compare",
    "compare_models": "diag.compare",
    "load_pair": "diag.compare",
    "DiagError": "diag.errors",
    "feed_source": "diag.feeds",
    "Gates": "diag.gate",
    "GateResult": "diag.gate",
    "check_document": "diag.gate",
    "DocumentDiff": "diag.diff",
    "diff_documents": "diag.diff",
    "Recipe": "diag.recipe",
    "load_recipe": "diag.recipe",
    "save_recipe": "diag.recipe",
    "QuantizeReport": "diag.modelprep",
    "QuantizeOptions": "diag.quantize",
    "quantize_model": "diag.quantize",
    "compare_to_dir": "diag.verbs",
    "diagnose": "diag.verbs",
    "merge_shards": "diag.merge",
    "merge_to_dir": "diag.verbs",
    "FeedSpec": "diag.feeds",
    "ExcludeOptions": "diag.exclude",
    "derive_exclusions": "diag.exclude",
    "exclude_to_dir": "diag.verbs",
    "bench_models": "diag.bench",
    "BenchOptions": "diag.bench",
    "SweepOptions": "diag.sweep",
    "sweep_model": "diag.sweep",
    "sweep_to_dir": "diag.verbs",
    "Summary": "diag.summary",
    "TierOptions": "diag.tiers",
    "derive_tier_plan": "diag.tiers",
    "tier_plan_to_dir": "diag.verbs",
    "SensitivityOptions": "diag.sensitivity",
    "weight_report": "diag.weights",
    "find_patterns": "diag.patterns",
    "skip_one_sensitivity": "diag.sensitivity",
    "TaskMetric": "diag.taskmetrics",
    "F1Metric": "diag.taskmetrics",
    "infer_recipe": "diag.infer",
}

__all__ = sorted([*_LAZY, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diag' has no attribute {name!r}")
