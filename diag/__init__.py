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

from diag.foundations.environment import __version__ as __version__

_LAZY = {
    "CompareOptions": "diag.analysis.compare",
    "CompareResult": "diag.analysis.compare",
    "compare_models": "diag.analysis.compare",
    "load_pair": "diag.analysis.compare",
    "DiagError": "diag.foundations.errors",
    "feed_source": "diag.core.feeds",
    "Gates": "diag.report.gate",
    "GateResult": "diag.report.gate",
    "check_document": "diag.report.gate",
    "DocumentDiff": "diag.report.diff",
    "diff_documents": "diag.report.diff",
    "Recipe": "diag.core.recipe",
    "load_recipe": "diag.core.recipe",
    "save_recipe": "diag.core.recipe",
    "QuantizeReport": "diag.fix.modelprep",
    "QuantizeOptions": "diag.fix.quantize",
    "quantize_model": "diag.fix.quantize",
    "compare_to_dir": "diag.cli.verbs",
    "diagnose": "diag.cli.verbs",
    "merge_shards": "diag.analysis.merge",
    "merge_to_dir": "diag.cli.verbs",
    "FeedSpec": "diag.core.feeds",
    "ExcludeOptions": "diag.fix.exclude",
    "derive_exclusions": "diag.fix.exclude",
    "exclude_to_dir": "diag.cli.verbs",
    "bench_models": "diag.fix.bench",
    "BenchOptions": "diag.fix.bench",
    "SweepOptions": "diag.fix.sweep",
    "sweep_model": "diag.fix.sweep",
    "sweep_to_dir": "diag.cli.verbs",
    "Summary": "diag.foundations.summary",
    "TierOptions": "diag.fix.tiers",
    "derive_tier_plan": "diag.fix.tiers",
    "tier_plan_to_dir": "diag.cli.verbs",
    "SensitivityOptions": "diag.fix.sensitivity",
    "weight_report": "diag.analysis.weights",
    "find_patterns": "diag.analysis.patterns",
    "skip_one_sensitivity": "diag.fix.sensitivity",
    "TaskMetric": "diag.core.taskmetrics",
    "F1Metric": "diag.core.taskmetrics",
    "infer_recipe": "diag.fix.infer",
    "splice_to_file": "diag.fix.exclude",
}

__all__ = sorted([*_LAZY, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diag' has no attribute {name!r}")
