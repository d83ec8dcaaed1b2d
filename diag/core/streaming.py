"""The streaming engine of a comparison: sessions run batch by batch, tensors reduced, then dropped.

:func:`run_comparison` streams every batch through the FP32, INT8 and cut models and reduces each
tensor into the accumulators of a :class:`CompareState` (the composite accumulator a shard file
holds), in numpy (:func:`_run_pass`, the reference) or inside onnxruntime (``--reductions graph``:
:func:`_run_graph_pass` over :mod:`diag.core.diagraph`). The passes a memory budget needs, the cut
model for local error, the deployed sessions at ``--ort-opt-level``, the labels and the task
metrics are planned and fed here. Core layer: it knows models, inputs, sessions and accumulators,
not findings; :mod:`diag.analysis.compare` plans the diagnosis around it and analyses the state it fills.

Memory is O(one batch): each batch's FP32, INT8 and cut-model outputs are reduced into
accumulators and dropped; the next batch's FP32 run starts once the reductions still pending hold
no more than the last batch's values less its FP32 values (what the run will take again), and its
INT8 run once they are all done.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import numpy as np
import onnx

from diag.core import diagraph
from diag.core.distributions import OUTLIER_FACTOR, DistributionAccumulator, GridInfo, TensorHealth, layout_hints
from diag.core.feeds import FeedSource, load_labels
from diag.core.fp16 import Fp16Range
from diag.core.instrument import (
    CutModel,
    FusedKernel,
    cut_model,
    exact_locally,
    exposed_model,
    fused_kernels,
    merged_with_cut,
    pruned_cut,
)
from diag.core.load import LoadedModel
from diag.core.match import Matching, TensorPair
from diag.core.metrics import ErrorAccumulator, ErrorStats, OutputAccumulator, OutputStats, sum_of_squares
from diag.core.outputs import channel_axes, output_specs
from diag.core.positions import BatchPadding, PositionMask, kept_positions, kept_values, mask_for_model, symbolic_axes
from diag.core.protos import value_dtypes
from diag.core.run import (
    batch_tensor_bytes,
    default_threads,
    drop_mapped_pages,
    file_resident_bytes,
    plan_passes,
    reuse_freed_memory,
    run_batch,
    session_from_model,
)
from diag.core.spill import SpilledBatches
from diag.core.state import State, from_states, states_of
from diag.core.taskmetrics import (
    TaskAccumulator,
    call_update,
    merge_task_metrics,
    start_task_metrics,
    task_from_state,
    task_to_state,
)
from diag.foundations.errors import DiagError
from diag.foundations.progress import Progress

if TYPE_CHECKING:
    import onnxruntime as ort


class StreamOptions(Protocol):
    """What the engine reads of a comparison's options (:class:`diag.analysis.compare.CompareOptions`).

    NOTE: a protocol, not the dataclass: the options also carry the analysis and fix sides'
    knobs (effect checks, sensitivity, the recipe, a scheduler), which this layer does not know.
    Read-only properties, so the frozen dataclass satisfies it.
    """

    @property
    def opt_level(self) -> str: ...
    @property
    def threads(self) -> int | None: ...
    @property
    def local(self) -> bool: ...
    @property
    def progress(self) -> bool: ...
    @property
    def labels(self) -> str | None: ...
    @property
    def distributions(self) -> bool: ...
    @property
    def max_memory(self) -> int | None: ...
    @property
    def shard(self) -> tuple[int, int] | None: ...
    @property
    def output_kinds(self) -> dict[str, str]: ...
    @property
    def metric(self) -> str | None: ...
    @property
    def reductions(self) -> str: ...
    @property
    def reference_samples(self) -> int | str: ...
    @property
    def local_samples(self) -> int | str: ...
    @property
    def mask_input(self) -> str | None: ...
    @property
    def no_mask(self) -> bool: ...


@dataclass
class CompareState:
    """The mergeable part of a comparison: accumulators only, no tensors.

    The composite :class:`diag.core.state.Accumulator`: ``merge`` merges every accumulator it holds,
    ``to_state`` / ``from_state`` are the shard file's ``state`` (:mod:`diag.analysis.merge`), and
    ``finalize`` finalizes each of them (:func:`diag.analysis.compare.finish` then analyses the figures with the
    models).
    """

    @dataclass
    class Figures:
        """What :meth:`CompareState.finalize` returns: every accumulator's figures, by tensor / output."""

        accumulated: dict[str, ErrorStats]
        local: dict[str, ErrorStats]
        outputs: dict[str, OutputStats]
        deployed: dict[str, OutputStats]
        health: dict[str, TensorHealth]
        task: dict[str, dict[str, float]]
        fp16_ranges: dict[str, dict[str, Any]]
        #: Errors over every position of the tensors whose padding was masked out (the figures
        #: above count real positions only): :mod:`diag.core.positions`.
        all_positions: dict[str, ErrorStats] = field(default_factory=dict)
        all_positions_local: dict[str, ErrorStats] = field(default_factory=dict)

    #: Version of the ``to_state`` layout. 2: a tensor's dynamic scales are a summary (count,
    #: sum, min, max) instead of one float per batch, FP16 range counts are saved; 1 is still read.
    STATE_VERSION: ClassVar[int] = 2
    READS_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)

    accumulated: dict[str, ErrorAccumulator] = field(default_factory=dict)
    local: dict[str, ErrorAccumulator] = field(default_factory=dict)
    outputs: dict[str, OutputAccumulator] = field(default_factory=dict)
    distributions: dict[str, DistributionAccumulator] = field(default_factory=dict)
    #: Correct top-1 predictions: FP32, the INT8 model as graded (deployed when a deploy level is set)
    #: and in exact mode (``int8_exact``, optimizations off).
    labelled: dict[str, int] = field(default_factory=lambda: {"n": 0, "fp32": 0, "int8": 0, "int8_exact": 0})
    samples: int = 0
    batches: int = 0
    #: Samples whose local error was measured (the first ones: :func:`local_sample_limit`).
    local_samples: int = 0
    #: Passes over the inputs the memory budget needed (1 = every tensor exposed at once).
    passes: int = 1
    #: Model outputs as onnxruntime really runs the models at ``--ort-opt-level`` (not disabled).
    deployed: dict[str, OutputAccumulator] = field(default_factory=dict)
    #: Kernels of the optimized INT8 graph that hide nodes of the model as written.
    fused: list[FusedKernel] = field(default_factory=list)
    #: Task metrics (:mod:`diag.core.taskmetrics`): ``f1`` with --labels, ``plugin`` with --metric.
    task: dict[str, TaskAccumulator] = field(default_factory=dict)
    #: FP16 models: how each FP32 tensor fits FP16's range (:class:`diag.core.fp16.Fp16Range`).
    fp16_ranges: dict[str, Fp16Range] = field(default_factory=dict)
    #: With ``reductions="graph"``: what was reduced by the numpy reference instead, and why
    #: (a tensor name, or ``"pass N"`` for a whole pass). Not part of the shard state.
    numpy_reduced: dict[str, str] = field(default_factory=dict)
    #: The FP32 model's outputs of the first ``options.reference_samples`` samples, kept on disk
    #: by the first pass for the effect check (:mod:`diag.core.spill`). A handle, not a figure:
    #: not part of the shard state, not merged.
    kept_outputs: SpilledBatches | None = None
    #: The input whose zeros mark padding (:mod:`diag.core.positions`), None when every position counts.
    mask_input: str | None = None
    #: ``[batch, seq]`` positions the mask input covered, and how many of them it marked as padding.
    positions: int = 0
    padding: int = 0
    #: Errors over every position of the tensors ``accumulated`` / ``local`` count real positions of.
    all_positions: dict[str, ErrorAccumulator] = field(default_factory=dict)
    all_positions_local: dict[str, ErrorAccumulator] = field(default_factory=dict)

    def merge(self, other: CompareState) -> CompareState:
        errors = (
            (self.accumulated, other.accumulated),
            (self.local, other.local),
            (self.all_positions, other.all_positions),
            (self.all_positions_local, other.all_positions_local),
        )
        for mine, theirs in errors:
            for k, acc in theirs.items():
                mine.setdefault(k, ErrorAccumulator()).merge(acc)
        for k, oacc in other.outputs.items():
            self.outputs.setdefault(k, OutputAccumulator(oacc.spec)).merge(oacc)
        for k, dacc in other.distributions.items():
            if k in self.distributions:
                self.distributions[k].merge(dacc)
            else:
                self.distributions[k] = dacc
        for k in self.labelled:
            self.labelled[k] += other.labelled.get(k, 0)
        self.samples += other.samples
        self.positions += other.positions
        self.padding += other.padding
        self.mask_input = self.mask_input or other.mask_input
        self.local_samples += other.local_samples
        self.batches += other.batches
        self.passes = max(self.passes, other.passes)
        for k, dep in other.deployed.items():
            self.deployed.setdefault(k, OutputAccumulator(dep.spec)).merge(dep)
        self.fused = self.fused or list(other.fused)
        merge_task_metrics(self.task, other.task)
        for k, why in other.numpy_reduced.items():
            self.numpy_reduced.setdefault(k, why)
        for k, rng in other.fp16_ranges.items():
            if k in self.fp16_ranges:
                self.fp16_ranges[k].merge(rng)
            else:
                self.fp16_ranges[k] = rng
        return self

    def finalize(self, outlier_factor: float = OUTLIER_FACTOR) -> CompareState.Figures:
        """Every accumulator finalized (``outlier_factor``: see :class:`diag.analysis.compare.CompareOptions`)."""
        return CompareState.Figures(
            accumulated={k: a.finalize() for k, a in self.accumulated.items()},
            local={k: a.finalize() for k, a in self.local.items()},
            outputs={k: a.finalize() for k, a in self.outputs.items()},
            deployed={k: a.finalize() for k, a in self.deployed.items()},
            health={k: d.finalize(outlier_factor) for k, d in self.distributions.items()},
            task={k: m.finalize() for k, m in self.task.items()},
            fp16_ranges={k: r.finalize() for k, r in self.fp16_ranges.items()},
            # Without padding in any batch the all-positions figures are the figures: none kept.
            all_positions={k: a.finalize() for k, a in self.all_positions.items()} if self.padding else {},
            all_positions_local={k: a.finalize() for k, a in self.all_positions_local.items()} if self.padding else {},
        )

    def to_state(self) -> State:
        """Every accumulator's state, as plain JSON (no tensors: sums, maxima, bins)."""
        return {
            "version": self.STATE_VERSION,
            "samples": self.samples,
            "local_samples": self.local_samples,
            "batches": self.batches,
            "passes": self.passes,
            "labelled": dict(self.labelled),
            "accumulated": states_of(self.accumulated),
            "local": states_of(self.local),
            "outputs": states_of(self.outputs),
            "distributions": states_of(self.distributions),
            "deployed": states_of(self.deployed),
            "fused": [asdict(k) for k in self.fused],
            # Task metrics (F1 counts, a --metric plugin's state() with its module:function).
            "task": task_to_state(self.task),
            "fp16_ranges": states_of(self.fp16_ranges),
            "mask_input": self.mask_input,
            "positions": self.positions,
            "padding": self.padding,
            "all_positions": states_of(self.all_positions),
            "all_positions_local": states_of(self.all_positions_local),
        }

    @classmethod
    def from_state(cls, state: State) -> CompareState:
        """The inverse of :meth:`to_state` (any version of :data:`READS_VERSIONS`)."""
        return cls(
            accumulated=from_states(ErrorAccumulator, state["accumulated"]),
            local=from_states(ErrorAccumulator, state["local"]),
            outputs=from_states(OutputAccumulator, state["outputs"]),
            distributions=from_states(DistributionAccumulator, state["distributions"]),
            labelled={"int8_exact": 0, **{str(k): int(v) for k, v in state["labelled"].items()}},
            samples=int(state["samples"]),
            # a state written before local samples were counted measured local error on every sample
            local_samples=int(state["local_samples" if "local_samples" in state else "samples"]),
            batches=int(state["batches"]),
            passes=int(state["passes"]),
            deployed=from_states(OutputAccumulator, state["deployed"]),
            fused=[FusedKernel(**k) for k in state["fused"]],
            task=task_from_state(state.get("task")),
            fp16_ranges=from_states(Fp16Range, state.get("fp16_ranges") or {}),
            mask_input=state.get("mask_input"),
            positions=int(state.get("positions") or 0),
            padding=int(state.get("padding") or 0),
            all_positions=from_states(ErrorAccumulator, state.get("all_positions") or {}),
            all_positions_local=from_states(ErrorAccumulator, state.get("all_positions_local") or {}),
        )


def run_comparison(
    fp: LoadedModel, q: LoadedModel, matching: Matching, feeds: FeedSource, options: StreamOptions
) -> tuple[CompareState, dict[str, str]]:
    """Stream every batch through FP32, INT8 and cut models; reduce into a CompareState.

    Memory is O(one batch of exposed tensors). With ``options.max_memory`` the matched tensors
    are split, in graph order, into groups whose values for one batch fit the budget; each group
    gets its own pass over the inputs with sessions that expose only its tensors (and a cut model
    pruned to its nodes), so every accumulator sees exactly the values of a single pass. With
    ``options.shard = (k, n)`` only batches k, k + n, k + 2n, ... are run (``diag merge`` adds
    the shards up).

    Example:
        >>> state, _ = run_comparison(fp, q, match_models(fp.proto, q.proto), feeds, CompareOptions())  # doctest: +SKIP
        >>> state.samples, state.passes  # doctest: +SKIP
        (32, 1)
    """
    if fp.weight_bytes < REUSE_FREED_BELOW:
        reuse_freed_memory()
    labels = _checked_labels(options, feeds)
    if options.shard is not None:
        k, n = options.shard
        if not 0 <= k < n:
            raise DiagError("bad-option", f"--shard {k}/{n}", "needs 0 <= k < n", "shards of 8 are 0/8 ... 7/8")
    pairs = dict(matching.pairs)
    cut: CutModel | None = None
    unchanged: set[str] = set()
    if options.local:
        cut, unchanged = _local_model(fp, q, pairs)
    groups = _plan_passes(fp, pairs, feeds, options)
    state = _start_state(fp, q, pairs, labels, options, len(groups))
    mask = _position_mask(fp, options)
    state.mask_input = mask.input_name if mask is not None else None
    runtime_unmatched: dict[str, str] = {}
    deployed = _deployed_session(q, matching, options, state) if options.opt_level != "disabled" else None
    total = feeds.total_samples * len(groups) if feeds.total_samples is not None else None
    progress = Progress(total, "compare", enabled=options.progress)
    run_pass = _run_graph_pass if options.reductions == "graph" else _run_pass
    try:
        for i, group in enumerate(groups):
            part = cut if cut is None or len(groups) == 1 else pruned_cut(cut, group)
            if part is not None and not part.outputs:
                part = None  # e.g. a pass of model inputs only: nothing to recompute locally
            run_pass(
                _Pass(
                    fp=fp,
                    q=q,
                    pairs=pairs,
                    group=group,
                    first=i == 0,
                    cut=part,
                    feeds=feeds,
                    options=options,
                    state=state,
                    runtime_unmatched=runtime_unmatched,
                    labels=labels,
                    progress=progress,
                    deployed=deployed if i == 0 else None,
                    mask=mask,
                )
            )
    finally:
        progress.close()
    if state.batches == 0:
        raise DiagError("bad-inputs", "inputs", "yielded zero samples", "provide at least one sample")
    for name in unchanged:
        if name in state.accumulated and name not in state.local:
            state.local[name] = ErrorAccumulator.of_unchanged(state.accumulated[name])
            if name in state.all_positions:
                state.all_positions_local[name] = ErrorAccumulator.of_unchanged(state.all_positions[name])
    return state, runtime_unmatched


#: FP32 weights below which :func:`run_comparison` makes glibc keep freed memory for reuse.
#: NOTE: measured on the 500M int4 decoder (2 GB of FP32 weights, 16 samples, two rounds each):
#: with the tuning, peak RSS 4823 MB and 66-73 s; without, 4572 MB and 62-66 s. Its tensors are
#: 1-2 MB each, spread over several malloc arenas that each keep their freed memory; the
#: page-fault savings the tuning was made for (PP-OCRv4 det: -25 % wall) do not show there.
REUSE_FREED_BELOW = 512 << 20


#: Growth of the file-backed resident size past its level after the first batch (the pages
#: every batch reads) at which a pass drops its models' mapped pages.
#: NOTE: on the 500M decoder a batch maps ~75 MB of int4 weights, dropped and mapped again every
#: batch when the drop ran after each (a read of ``/proc/self/smaps``, ~70 ms, and the faults);
#: the growth that costs memory is what the Gather adds beyond that, ~6 MB a sample.
DROP_MAPPED_AFTER = 32 << 20


#: FP32 weights from which ``--local-samples auto`` measures local error on the first
#: :data:`LARGE_MODEL_LOCAL_SAMPLES` samples only.
#: NOTE: on a weight-only decoder the cut model is every quantized MatMul again, fed FP32 inputs:
#: a whole model run per sample (500M int4 decoder: 0.7 s of the 2.2 s of model runs a sample
#: costs). Local error is a property of each node's quantization, and 16 samples of a decoder are
#: 2048 positions per MatMul: its SQNR moves by hundredths of a dB with more. The accumulated
#: error, the outputs and the distributions still see every sample.
LARGE_MODEL_BYTES = 1 << 30
LARGE_MODEL_LOCAL_SAMPLES = 16


def local_sample_limit(options: StreamOptions, fp: LoadedModel) -> int | None:
    """Samples the local error is measured on, the first ones (None: every sample).

    ``options.local_samples``: a count, ``"all"``, or ``"auto"`` (every sample, but the first
    :data:`LARGE_MODEL_LOCAL_SAMPLES` for FP32 weights of :data:`LARGE_MODEL_BYTES` and more). A
    batch is measured whole when it starts before the limit.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> local_sample_limit(NS(local_samples="auto"), NS(weight_bytes=2 << 30))
        16
        >>> local_sample_limit(NS(local_samples="auto"), NS(weight_bytes=1 << 20)) is None
        True
        >>> local_sample_limit(NS(local_samples=8), NS(weight_bytes=1 << 20))
        8
    """
    n = options.local_samples
    if n == "all":
        return None
    if n == "auto":
        return LARGE_MODEL_LOCAL_SAMPLES if fp.weight_bytes >= LARGE_MODEL_BYTES else None
    return int(n)


#: Samples an effect check runs on by default (``--effect-samples auto``), and from
#: :data:`LARGE_MODEL_BYTES` of FP32 weights.
#: NOTE: the check re-runs the INT8 model on its samples to capture each candidate's boundary,
#: then every candidate's downstream part on each: on the 500M int4 decoder, 8 samples cost 26.7 s
#: of a 155 s run (64 samples), 4 samples 17.6 s. 4 samples of a decoder are 512 positions of
#: logits; the candidates' recovered fractions moved by at most 0.002 (0.032, 0.007 -> 0.005, ...).
EFFECT_SAMPLES = 8
LARGE_MODEL_EFFECT_SAMPLES = 4


def effect_sample_count(samples: int | str, fp: LoadedModel) -> int:
    """``--effect-samples``: a count, or ``"auto"`` (:data:`EFFECT_SAMPLES`, but
    :data:`LARGE_MODEL_EFFECT_SAMPLES` for FP32 weights of :data:`LARGE_MODEL_BYTES` and more).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> effect_sample_count("auto", NS(weight_bytes=2 << 30)), effect_sample_count("auto", NS(weight_bytes=1 << 20))
        (4, 8)
        >>> effect_sample_count(6, NS(weight_bytes=2 << 30))
        6
    """
    if str(samples).strip().lower() == "auto":
        return LARGE_MODEL_EFFECT_SAMPLES if fp.weight_bytes >= LARGE_MODEL_BYTES else EFFECT_SAMPLES
    return int(samples)


def _mapped_files(fp: LoadedModel, q: LoadedModel) -> list[Path]:
    """The external-data files whose mapped pages a large model's pass drops after each batch
    (:func:`diag.core.run.drop_mapped_pages`); none below :data:`REUSE_FREED_BELOW` of FP32 weights,
    where the growth is small and reading ``/proc/self/smaps`` per batch would cost more."""
    return sorted({*fp.external_files, *q.external_files}) if fp.weight_bytes >= REUSE_FREED_BELOW else []


def _local_model(fp: LoadedModel, q: LoadedModel, pairs: dict[str, TensorPair]) -> tuple[CutModel | None, set[str]]:
    """The cut model for local error, and the tensors it does not recompute (their local value is
    the FP32 value bit for bit: :func:`exact_locally`; their local error is zero by construction).

    The model is cut at every matched tensor, then pruned to the nodes the other tensors need:
    on a weight-only decoder that keeps the quantized MatMuls alone (1 in 10 tensors), where
    recomputing every node cost a third of a pass and held every activation a third time.
    """
    outputs = {o.name for o in fp.graph.output}
    unchanged = exact_locally(fp.proto, q.proto, pairs.values()) - outputs
    cut = cut_model(q.proto, [p for p in pairs.values() if p.producer is not None])
    if unchanged:
        cut = pruned_cut(cut, [lo.fp_name for lo in cut.outputs if lo.fp_name not in unchanged])
    return (cut if cut.outputs else None), unchanged


def _checked_labels(options: StreamOptions, feeds: FeedSource) -> np.ndarray | None:
    """``--labels``, read and checked against the number of samples when the inputs know it."""
    labels = load_labels(options.labels) if options.labels else None
    if labels is not None and feeds.total_samples is not None and len(labels) < feeds.total_samples:
        raise DiagError(
            "bad-inputs",
            "--labels",
            f"has {len(labels)} labels but the inputs have {feeds.total_samples} samples",
            "give one label per sample",
        )
    return labels


def _start_state(
    fp: LoadedModel,
    q: LoadedModel,
    pairs: dict[str, TensorPair],
    labels: np.ndarray | None,
    options: StreamOptions,
    passes: int,
) -> CompareState:
    """Empty accumulators for every model output, matched tensor and task metric the options ask for."""
    specs = output_specs(fp.proto, options.output_kinds)
    axes = channel_axes(specs)
    state = CompareState(passes=passes)
    state.outputs = {name: OutputAccumulator(spec) for name, spec in specs.items()}
    if options.opt_level != "disabled":
        state.deployed = {name: OutputAccumulator(spec, whole=True) for name, spec in specs.items()}
    state.task = start_task_metrics(
        fp.graph.output[0].name, labels, options.metric, options.shard is not None, options.opt_level != "disabled"
    )
    if options.distributions:
        hints = layout_hints(fp.graph)  # which axis is a channel: NCHW only where a Conv made it
        for name, pair in pairs.items():
            grid = GridInfo.from_params(pair.grid) if pair.grid is not None else None
            state.distributions[name] = DistributionAccumulator(grid, hints.get(name), axes.get(name))
    if q.format.family == "fp16":
        state.fp16_ranges = {name: Fp16Range() for name, p in pairs.items() if p.how == "fp16"}
    return state


@dataclass
class _Pass:
    """One pass over the inputs: the models, the tensors whose values it reduces, and where to."""

    fp: LoadedModel
    q: LoadedModel
    #: Every matched tensor, shared by the passes (a pair whose shapes differ at run time is dropped).
    pairs: dict[str, TensorPair]
    #: The FP32 tensors this pass exposes and reduces.
    group: list[str]
    #: The first pass also reduces the model outputs, the labels and the task metrics, and counts samples.
    first: bool
    cut: CutModel | None
    feeds: FeedSource
    options: StreamOptions
    state: CompareState
    runtime_unmatched: dict[str, str]
    labels: np.ndarray | None
    progress: Progress
    #: The INT8 session at the deploy level (first pass only, and only when not disabled).
    deployed: ort.InferenceSession | None = None
    #: The input whose zeros mark the padding the errors leave out (:mod:`diag.core.positions`).
    mask: PositionMask | None = None

    def mine(self) -> dict[str, TensorPair]:
        """This pass's matched tensors (a new dict: a pass drops the pairs whose shapes differ from it)."""
        return {name: self.pairs[name] for name in self.group if name in self.pairs}

    def output_names(self) -> list[str]:
        return [o.name for o in self.fp.graph.output] if self.first else []

    def skips(self, index: int) -> bool:
        """Whether batch ``index`` belongs to another shard (``--shard k/n``)."""
        return self.options.shard is not None and index % self.options.shard[1] != self.options.shard[0]

    def done(self, size: int, local: bool, feeds: dict[str, np.ndarray]) -> None:
        """A batch of ``size`` samples is reduced (counted once, by the first pass); ``local``: its
        local error too (when the run measures local error at all)."""
        if self.first:
            if self.mask is not None and self.mask.input_name in feeds:
                m = np.asarray(feeds[self.mask.input_name])
                self.state.positions += int(m.size)
                self.state.padding += int(m.size - np.count_nonzero(m))
            self.state.samples += size
            self.state.batches += 1
            self.state.local_samples += size if local and self.options.local else 0
        self.progress.advance(size)


def _position_mask(fp: LoadedModel, options: StreamOptions) -> PositionMask | None:
    """The padding mask of the run (:mod:`diag.core.positions`), its sequence axes read from the
    dims the export names; ``bad-option`` with ``--reductions graph``, which cannot mask."""
    mask = mask_for_model(fp.graph, options.mask_input, options.no_mask)
    if mask is None:
        return None
    if options.reductions == "graph":
        # NOTE: the diagnostic graph sums over every position; masking there would need the mask
        # broadcast into each reduction. Refused rather than silently counting the padding.
        raise DiagError(
            "bad-option",
            "--reductions graph",
            f"counts every position, but the input '{mask.input_name}' marks padding to leave out",
            "add --no-mask to count the padding too, or use --reductions numpy",
        )
    return dataclasses.replace(mask, axes=symbolic_axes(fp.proto, mask.input_name))


def _run_pass(p: _Pass) -> None:
    """One pass over the inputs for the tensors of ``p.group`` (model outputs and counts on the first)."""
    mine = p.mine()
    output_names = p.output_names()
    threads = p.options.threads or default_threads()
    fp_sess, q_sess, cut_sess, cut = _exposed_sessions(p.fp, p.q, mine, p.cut, output_names, threads, share=True)
    reductions = _Reductions(threads)
    mapped = _mapped_files(p.fp, p.q)
    kept: SpilledBatches | None = None
    if output_names and p.options.reference_samples and p.options.shard is None:
        kept = p.state.kept_outputs = SpilledBatches(effect_sample_count(p.options.reference_samples, p.fp))
    working: int | None = None  # file-backed resident bytes after the first batch
    limit = local_sample_limit(p.options, p.fp) if cut is not None else None
    overlap = 0  # bytes the previous batch's reductions may still hold when the next batch starts
    try:
        offset = 0
        for index, batch in enumerate(p.feeds):
            if p.skips(index):
                offset += batch.size
                p.progress.advance(batch.size)
                continue
            # The next batch's FP32 run starts once the previous batch's pending reductions hold
            # no more than that batch's values less its FP32 values: the FP32 run refills what
            # was freed, so about one batch of values is alive at a time (the peak of a
            # sequential loop), while the reductions fill the cores onnxruntime leaves idle.
            reductions.wait_below(overlap)  # each accumulator sees its batches in order (:class:`_Reductions`)
            if mapped and index > 0:
                resident = file_resident_bytes()
                if working is None:
                    working = resident
                elif resident - working >= DROP_MAPPED_AFTER:
                    drop_mapped_pages(mapped)
            local = limit is None or offset < limit
            if not local and cut is not None:
                # The samples local error is measured on are done: the cut model stops running
                # (merged into the INT8 session, that session is replaced by the plain one).
                if cut_sess is q_sess:
                    q_sess = cut_sess = None
                    q_sess = _exposed_int8_session(p.q, mine, output_names, threads)
                cut = cut_sess = None
            fp_out = run_batch(fp_sess, batch.feeds, f"FP32 model '{p.fp.path.name}'")
            fp_bytes = sum(int(v.nbytes) for v in fp_out.values())
            if kept is not None and not kept.full:
                kept.add({name: fp_out[name] for name in output_names}, batch.size)
            keep = kept_positions(batch.feeds, p.mask)
            fp_sides = reductions.submit(_fp_jobs(mine, fp_out, p.state, keep))  # while the INT8 model runs
            # The last batch's tasks end before this batch's INT8 values arrive (its FP32 sides hold
            # nothing): one batch of values at most, as in a sequential loop.
            reductions.wait_below(0)
            local_out: dict[str, np.ndarray] | None = None
            if cut is not None and cut_sess is q_sess:
                # One run of the INT8 model merged with its cut model (weights held once).
                feeds = {**batch.feeds, **_cut_feeds(cut, batch.feeds, fp_out)}
                q_out = run_batch(q_sess, feeds, f"INT8 model '{p.q.path.name}'")
                del feeds
                local_out = {name: q_out.pop(name) for name in dict.fromkeys(lo.name for lo in cut.outputs)}
            else:
                q_out = run_batch(q_sess, batch.feeds, f"INT8 model '{p.q.path.name}'")
            _update_fp16_ranges(p.state, mine, fp_out)
            # Each INT8 value is freed as soon as its reduction is done (the task holds the last reference).
            reductions.submit(
                _accumulated_jobs(mine, p.pairs, fp_out, q_out, p.state, p.runtime_unmatched, fp_sides, keep)
            )
            _update_outputs(p, output_names, batch.feeds, fp_out, q_out, offset, batch.size)
            del q_out
            if local_out is None and cut is not None and cut_sess is not None:
                # The cut model runs while the pool reduces this batch's accumulated error.
                local_out = _run_cut(cut, cut_sess, p.q, batch.feeds, fp_out)
            if local_out is not None and cut is not None:
                # Local and accumulated reductions touch different accumulators: no wait between them.
                _local_parts(cut, fp_out, local_out, p.state)
                reductions.submit(_local_jobs(cut, mine, fp_out, local_out, p.state, fp_sides, keep))
                del local_out
            del fp_out, fp_sides
            overlap = max(0, reductions.held - fp_bytes)
            offset += batch.size
            p.done(batch.size, local, batch.feeds)
        reductions.wait()
    finally:
        reductions.close()


def _update_fp16_ranges(state: CompareState, mine: dict[str, TensorPair], fp_out: dict[str, np.ndarray]) -> None:
    """FP16 models: how this batch's FP32 tensors fit FP16's range."""
    for name in mine:
        if name in state.fp16_ranges and name in fp_out:
            state.fp16_ranges[name].update(fp_out[name])


def _exposed_sessions(
    fp: LoadedModel,
    q: LoadedModel,
    mine: dict[str, TensorPair],
    cut: CutModel | None,
    output_names: list[str],
    threads: int,
    share: bool = False,
) -> tuple[ort.InferenceSession, ort.InferenceSession, ort.InferenceSession | None, CutModel | None]:
    """FP32 and INT8 sessions exposing ``mine`` (and ``output_names``), the cut model's session,
    and the cut model as that session names it.

    With ``share=True`` and INT8 weights of at least :data:`SHARED_CUT_BYTES`, the cut model is
    merged into the exposed INT8 model (:func:`diag.core.instrument.merged_with_cut`): the cut
    session *is* the INT8 session, one run gives both, and the weights are held once.
    """
    fp_names = list(dict.fromkeys(list(mine) + [ci.fp_name for ci in (cut.inputs if cut else [])] + output_names))
    ext_q = q.external_dir

    def session(model: onnx.ModelProto, role: str, ext: Path | None) -> ort.InferenceSession:
        # Exposed tensors are compared in exact mode whatever --ort-opt-level says: exposing a
        # tensor blocks the fusions that would hide it, so an optimized exposed session is neither
        # exact nor what really runs. What really runs is measured by the deployed sessions.
        return session_from_model(model, role, "disabled", threads, ext, takes_turns=True)

    fp_sess = session(exposed_model(fp.proto, fp_names), f"FP32 model '{fp.path}'", fp.external_dir)
    if not (share and cut is not None and _shares_weights(q)):
        q_sess = _exposed_int8_session(q, mine, output_names, threads)
        cut_sess = session(cut.model, f"cut INT8 model of '{q.path}'", ext_q) if cut is not None else None
        return fp_sess, q_sess, cut_sess, cut
    both = merged_with_cut(exposed_model(q.proto, _int8_names(mine, output_names)), cut)
    if both is None:
        q_sess = _exposed_int8_session(q, mine, output_names, threads)
        return fp_sess, q_sess, session(cut.model, f"cut INT8 model of '{q.path}'", ext_q), cut
    q_sess = session(both[0], f"INT8 model '{q.path}'", ext_q)
    return fp_sess, q_sess, q_sess, both[1]


def _int8_names(mine: dict[str, TensorPair], output_names: list[str]) -> list[str]:
    """The INT8 values a pass exposes: each pair's value and dynamic scale, and the model outputs."""
    names = list(
        dict.fromkeys(
            [t.int8_name for t in mine.values()] + [t.dynamic_scale for t in mine.values() if t.dynamic_scale]
        )
    )
    return names + [n for n in output_names if n not in names]


def _exposed_int8_session(
    q: LoadedModel, mine: dict[str, TensorPair], output_names: list[str], threads: int
) -> ort.InferenceSession:
    """The INT8 model exposing a pass's values, in exact mode (see :func:`_exposed_sessions`)."""
    model = exposed_model(q.proto, _int8_names(mine, output_names))
    return session_from_model(model, f"INT8 model '{q.path}'", "disabled", threads, q.external_dir, takes_turns=True)


#: INT8 weights from which the cut model runs inside the INT8 session (:func:`_exposed_sessions`).
#: NOTE: below it, two sessions cost little memory and are faster: the cut model then runs while
#: the pool reduces the batch's accumulated error (merged, the reductions wait for the one run).
SHARED_CUT_BYTES = 64 << 20


def _shares_weights(q: LoadedModel) -> bool:
    return q.weight_bytes >= SHARED_CUT_BYTES


def _cut_feeds(cut: CutModel, feeds: dict[str, np.ndarray], fp_out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The cut model's inputs for a batch: FP32 values, quantized as the INT8 model would see them."""
    if cut.passthrough:
        cut_feeds = {name: feeds[src] for name, src in cut.passthrough.items() if src in feeds}
    else:
        cut_inputs = {i.name for i in cut.model.graph.input}
        cut_feeds = {k: v for k, v in feeds.items() if k in cut_inputs}
    for ci in cut.inputs:
        v = fp_out[ci.fp_name]
        if ci.quant is not None:
            v = ci.quant.quantize(v, onnx.helper.tensor_dtype_to_np_dtype(ci.dtype))
        cut_feeds[ci.name] = v
    return cut_feeds


def _update_outputs(
    p: _Pass,
    output_names: list[str],
    feeds: dict[str, np.ndarray],
    fp_out: dict[str, np.ndarray],
    q_out: dict[str, np.ndarray],
    offset: int,
    size: int,
) -> None:
    """The first pass's share of a batch: model outputs, deployed outputs, labels, task metrics."""
    state = p.state
    for name in output_names:
        state.outputs.setdefault(name, OutputAccumulator()).update(fp_out[name], q_out[name], name, feeds)
    graded = q_out
    if p.deployed is not None:
        graded = _update_deployed(state, p.deployed, feeds, fp_out, p.q, p.options.opt_level, output_names)
    if p.labels is not None and p.first:
        first = output_names[0]
        _count_correct(state, p.labels, fp_out[first], graded[first], q_out[first], size, offset)
    if state.task and p.first:
        _update_task(state, p.options, output_names, fp_out, (graded, q_out), p.labels, offset, size)


def _run_cut(
    cut: CutModel,
    cut_sess: ort.InferenceSession,
    q: LoadedModel,
    feeds: dict[str, np.ndarray],
    fp_out: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Run the cut model on FP32 values (quantized as the INT8 model would): each node's local value."""
    return run_batch(cut_sess, _cut_feeds(cut, feeds, fp_out), f"cut INT8 model of '{q.path.name}'")


def _run_graph_pass(p: _Pass) -> None:
    """One pass with every statistic computed inside onnxruntime (:mod:`diag.core.diagraph`).

    One session runs the FP32, INT8 and cut models and the statistics together; a batch returns
    only sums, per-channel arrays, histogram subsamples and the model outputs. Falls back to
    :func:`_run_pass` (the numpy reference) for the whole pass when the graph cannot be built or
    fails on its first batch (then the reference reports the model's own error), and per tensor
    and batch when a sum is not finite (NaN / Inf handled exactly as the reference does).
    """
    mine = p.mine()
    output_names = p.output_names()
    threads = p.options.threads or default_threads()
    sample = next(iter(p.feeds), None)
    if sample is None:
        return
    pass_key = f"pass from '{p.group[0]}'" if p.group else "pass"
    try:
        dg, sess = _diagnostic_session(p, mine, output_names, sample.feeds, threads)
    except (diagraph.Unsupported, DiagError) as e:
        p.state.numpy_reduced[pass_key] = f"whole pass reduced in numpy: {e}"
        _run_pass(p)
        return
    p.state.numpy_reduced.update(dg.exposed)
    names = [o.name for o in sess.get_outputs()]
    reducer = _GraphReducer(p, dg, mine, threads)
    # NOTE: a batch's statistics (a few KB, histograms binned in numpy) are fed to the
    # accumulators on a worker while onnxruntime runs the next batch; the worker finishes batch k
    # before batch k + 1 is handed over, so each accumulator sees its batches in order.
    worker = ThreadPoolExecutor(1, thread_name_prefix="diag-stats") if threads > 1 else None
    pending: Future[None] | None = None
    processed = 0
    offset = 0
    try:
        for index, batch in enumerate(p.feeds):
            if p.skips(index):
                offset += batch.size
                p.progress.advance(batch.size)
                continue
            try:
                out = dict(zip(names, sess.run(names, batch.feeds), strict=True))
            except Exception as e:
                if processed == 0:
                    p.state.numpy_reduced[pass_key] = f"whole pass reduced in numpy: {str(e).splitlines()[0][:200]}"
                    del sess
                    _run_pass(p)
                    return
                raise _graph_failure(e, p.fp, p.q) from e
            processed += 1
            if pending is not None:
                pending.result()
            if worker is None:
                reducer.reduce(out, batch.feeds)
            else:
                pending = worker.submit(reducer.reduce, out, batch.feeds)
            _update_graph_outputs(p, dg, output_names, out, batch.feeds, offset, batch.size)
            del out
            offset += batch.size
            p.done(batch.size, True, batch.feeds)  # the diagnostic graph measures every sample
        if pending is not None:
            pending.result()
    finally:
        if worker is not None:
            worker.shutdown(cancel_futures=True)


def _diagnostic_session(
    p: _Pass, mine: dict[str, TensorPair], output_names: list[str], sample: dict[str, np.ndarray], threads: int
) -> tuple[diagraph.DiagGraph, ort.InferenceSession]:
    """The pass's diagnostic graph and its session; ``diagraph.Unsupported`` when it cannot be built."""
    ext_fp, ext_q = p.fp.external_dir, p.q.external_dir
    if ext_fp is not None and ext_q is not None and ext_fp != ext_q:
        raise diagraph.Unsupported("the two models keep external data in different folders")
    if p.state.fp16_ranges:
        raise diagraph.Unsupported("an FP16 model: its range counts (diag.core.fp16.Fp16Range) are reduced in numpy")
    shapes, dtypes = diagraph.shapes_and_types(p.fp.proto, sample)
    parted = frozenset(n for n, acc in p.state.outputs.items() if acc.spec.parts)
    dg = diagraph.diagnostic_graph(
        p.fp.proto,
        p.q.proto,
        p.cut,
        mine,
        p.state.distributions,
        output_names,
        diagraph.ValueTypes(shapes, dtypes, value_dtypes(p.q.proto)),
        parted,
    )
    sess = diagraph.session_from_graph(dg, f"diagnostic graph of '{p.q.path}'", threads, ext_fp or ext_q)
    return dg, sess


class _GraphReducer:
    """Feeds a batch's graph statistics to the accumulators, and the few tensors the graph could
    not reduce (flagged, or exposed by design) to the numpy reference (built on first need)."""

    def __init__(self, p: _Pass, dg: diagraph.DiagGraph, mine: dict[str, TensorPair], threads: int) -> None:
        self.p, self.dg, self.mine, self.threads = p, dg, mine, threads
        self.references: dict[frozenset[str], _ReferenceSessions] = {}
        self.exposed = [s.fp_name for s in dg.pairs if s.fp_name in dg.exposed]

    def reduce(self, out: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> None:
        p, mine = self.p, self.mine
        flagged = diagraph.stats_to_accumulators(
            self.dg, out, mine, p.state.accumulated, p.state.local, p.state.distributions, p.runtime_unmatched
        )
        for name in list(p.pairs):
            if name in p.runtime_unmatched and name not in mine:
                p.pairs.pop(name, None)
        acc_ref = [n for n in flagged.accumulated + self.exposed if n in mine]
        loc_ref = [n for n in flagged.local + self.exposed if n in mine]
        if acc_ref or loc_ref:
            key = frozenset(acc_ref + loc_ref)
            if key not in self.references:
                self.references[key] = _ReferenceSessions(p.fp, p.q, {n: mine[n] for n in key}, p.cut, self.threads)
            self.references[key].reduce(feeds, acc_ref, loc_ref, p.state)


def _update_graph_outputs(
    p: _Pass,
    dg: diagraph.DiagGraph,
    output_names: list[str],
    out: dict[str, np.ndarray],
    feeds: dict[str, np.ndarray],
    offset: int,
    size: int,
) -> None:
    """The first graph pass's share of a batch: model outputs, task metrics, deployed outputs, labels."""
    state = p.state
    for name in output_names:
        f_out, q_out = (out[n] for n in dg.outputs[name])
        state.outputs.setdefault(name, OutputAccumulator()).update(f_out, q_out, name, feeds)
        if name in dg.local_outputs:
            state.outputs[name].update_local(f_out, out[dg.local_outputs[name]])
    fp_vals = {n: out[dg.outputs[n][0]] for n in output_names}
    q_vals = {n: out[dg.outputs[n][1]] for n in output_names}
    graded = q_vals
    if p.deployed is not None:
        graded = _update_deployed(state, p.deployed, feeds, fp_vals, p.q, p.options.opt_level, output_names)
    if state.task and p.first:
        _update_task(state, p.options, output_names, fp_vals, (graded, q_vals), p.labels, offset, size)
    if p.labels is not None and p.first:
        first = output_names[0]
        _count_correct(state, p.labels, fp_vals[first], graded[first], q_vals[first], size, offset)


def _deployed_session(
    q: LoadedModel, matching: Matching, options: StreamOptions, state: CompareState
) -> ort.InferenceSession:
    """The INT8 session at the deploy level (``options.opt_level``) with only the model outputs: what
    the user runs, and what the outputs are graded on. Its reference is the FP32 model's exact
    outputs from the pass itself: one extra INT8 run per batch, no second FP32 session.

    The INT8 graph onnxruntime optimizes is saved to a temp file to see which fused kernels hide
    which nodes (``state.fused``). Skipped for models with external data, whose saved graph
    would carry a copy of the weights.
    """

    threads = options.threads or default_threads()
    role = f"INT8 model '{q.path}' ({options.opt_level})"
    if q.external_dir is not None:
        return session_from_model(q.proto, role, options.opt_level, threads, q.external_dir, takes_turns=True)
    with tempfile.TemporaryDirectory(prefix="diag-opt-") as tmp:
        saved = Path(tmp) / "int8.optimized.onnx"
        q_sess = session_from_model(q.proto, role, options.opt_level, threads, None, saved, takes_turns=True)
        if saved.exists():
            fp_nodes_of = {n: g.fp_nodes for g in matching.groups for n in g.int8_nodes}
            state.fused = fused_kernels(q.proto, onnx.load(str(saved), load_external_data=False), fp_nodes_of)
    return q_sess


def _plan_passes(
    fp: LoadedModel, pairs: dict[str, TensorPair], feeds: FeedSource, options: StreamOptions
) -> list[list[str]]:
    """Groups of matched FP32 tensors, one per pass; a single group unless a budget needs more."""
    position = {i.name: -1 for i in fp.graph.input}
    for i, node in enumerate(fp.graph.node):
        for o in node.output:
            position.setdefault(o, i)
    names = sorted(pairs, key=lambda n: position.get(n, len(position)))
    if options.max_memory is None:
        return [names]
    first = next(iter(feeds), None)
    if first is None:
        return [names]
    sizes = batch_tensor_bytes(fp.proto, first.feeds)
    # NOTE: a matched tensor is held three times per batch: its FP32 value, its INT8 value and
    # its locally recomputed value (the INT8 one may be smaller; counting it as float is safe).
    copies = 3 if options.local else 2
    return plan_passes(names, {n: copies * sizes.get(n, 0) for n in names}, options.max_memory)


def _graph_failure(e: Exception, fp: LoadedModel, q: LoadedModel) -> DiagError:
    """A one-line DiagError naming the model and node (prefix stripped) where the diagnostic graph failed."""
    text = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
    node = re.search(r"Name:\s*'([^']*)'", str(e)) or re.search(r"[Nn]ode(?: \(|:\s*)?'([^'\s)]+)", str(e))
    role, where = "diagnostic graph", ""
    if node:
        model, name = diagraph.stat_to_model(node.group(1))
        role = {"FP32": f"FP32 model '{fp.path.name}'", "INT8": f"INT8 model '{q.path.name}'"}.get(
            model, f"cut INT8 model of '{q.path.name}'" if model == "cut" else "diagnostic graph"
        )
        where = f" at node '{name}'"
    return DiagError(
        "runtime-failure",
        role,
        f"onnxruntime failed{where}: {text}",
        "check the inputs' shapes and values; run with --debug for the full error",
    )


class _ReferenceSessions:
    """The numpy reference for the few tensors a diagnostic graph cannot reduce (built on first need)."""

    def __init__(
        self, fp: LoadedModel, q: LoadedModel, mine: dict[str, TensorPair], cut: CutModel | None, threads: int
    ) -> None:
        self.fp, self.q, self.mine = fp, q, mine
        cut = pruned_cut(cut, list(mine)) if cut is not None else None
        self.cut = cut if cut is not None and cut.outputs else None
        self.fp_sess, self.q_sess, self.cut_sess, _ = _exposed_sessions(fp, q, mine, self.cut, [], threads)

    def reduce(
        self, feeds: dict[str, np.ndarray], accumulated: list[str], local: list[str], state: CompareState
    ) -> None:
        """Reduce this batch's ``accumulated`` / ``local`` tensors exactly as :func:`_run_pass` does."""
        fp_out = run_batch(self.fp_sess, feeds, f"FP32 model '{self.fp.path.name}'")
        q_out = run_batch(self.q_sess, feeds, f"INT8 model '{self.q.path.name}'")
        subset = {n: self.mine[n] for n in accumulated if n in self.mine}
        for job in _accumulated_jobs(subset, dict(subset), fp_out, q_out, state, {}):
            job.fn(*job.args)
        del q_out
        if local and self.cut is not None and self.cut_sess is not None:
            cut_feeds = _cut_feeds(self.cut, feeds, fp_out)
            local_out = run_batch(self.cut_sess, cut_feeds, f"cut INT8 model of '{self.q.path.name}'")
            wanted = {n: self.mine[n] for n in local if n in self.mine}
            for job in _local_jobs(self.cut, wanted, fp_out, local_out, state):
                job.fn(*job.args)


class Job(NamedTuple):
    """One reduction task of :class:`_Reductions`."""

    #: The accumulators it touches (tasks of one key run in submission order).
    key: str
    fn: Any
    args: tuple[Any, ...]
    #: Bytes of values only this task reads (an INT8 or local value): freed when it ends.
    holds: int = 0
    #: Values other tasks may read too (a tensor's FP32 value: its accumulated and local error):
    #: counted once, freed when the last task reading them ends.
    shared: tuple[np.ndarray, ...] = ()


def _fp_jobs(
    mine: dict[str, TensorPair], fp_out: dict[str, np.ndarray], state: CompareState, keep: BatchPadding | None = None
) -> list[Job]:
    """One :func:`_reduce_fp` task per matched tensor of a batch: its FP32 side, ready before the INT8 run."""
    return [
        Job(name, _reduce_fp, (state.distributions.get(name), fp_out[name], _padding_axis(name, fp_out[name], keep)))
        for name in mine
        if name in fp_out
    ]


def _accumulated_jobs(
    mine: dict[str, TensorPair],
    pairs: dict[str, TensorPair],
    fp_out: dict[str, np.ndarray],
    q_out: dict[str, np.ndarray],
    state: CompareState,
    runtime_unmatched: dict[str, str],
    fp_sides: dict[str, Future[tuple[float, bool]]] | None = None,
    keep: BatchPadding | None = None,
) -> list[Job]:
    """One :func:`_reduce` task per matched tensor of a batch; drops pairs whose shapes differ.

    ``fp_sides``: the batch's :func:`_reduce_fp` tasks, when the FP32 sides were reduced apart.
    ``keep``: the batch's real positions (:func:`diag.core.positions.kept_positions`), None: all.
    """
    jobs: list[Job] = []
    for name, pair in list(mine.items()):
        value = q_out[pair.int8_name]
        ref = fp_out[name]
        if value.shape != ref.shape:  # dequantizing keeps the shape
            runtime_unmatched[name] = (
                f"shape differs at run time: FP32 {ref.shape}, INT8 '{pair.int8_name}' {value.shape}"
            )
            del mine[name]
            pairs.pop(name, None)
            state.accumulated.pop(name, None)
            state.distributions.pop(name, None)
            continue
        scale = _scale_for(pair, q_out)
        acc = state.accumulated.setdefault(name, ErrorAccumulator())
        dist = state.distributions.get(name)
        fp_side = fp_sides.get(name) if fp_sides is not None else None
        whole = _padding_masked(state.all_positions, name, ref, keep)
        args = (acc, dist, ref, value, pair.dequant, scale, scale if pair.dynamic_scale else None, fp_side, whole)
        jobs.append(Job(name, _reduce, args, holds=int(value.nbytes), shared=(ref,)))
    return jobs


def _local_jobs(
    cut: CutModel,
    mine: dict[str, TensorPair],
    fp_out: dict[str, np.ndarray],
    local_out: dict[str, np.ndarray],
    state: CompareState,
    fp_sides: dict[str, Future[tuple[float, bool]]] | None = None,
    keep: BatchPadding | None = None,
) -> list[Job]:
    """One :func:`_reduce` task per locally recomputed tensor of a batch (error only, no distribution)."""
    jobs: list[Job] = []
    for lo in cut.outputs:
        if lo.fp_name not in mine:
            continue
        value = local_out[lo.name]
        ref = fp_out[lo.fp_name]
        if value.shape == ref.shape:
            acc = state.local.setdefault(lo.fp_name, ErrorAccumulator())
            fp_side = fp_sides.get(lo.fp_name) if fp_sides is not None else None
            whole = _padding_masked(state.all_positions_local, lo.fp_name, ref, keep)
            args = (acc, None, ref, value, lo.dequant, _scale_for(mine[lo.fp_name], None), None, fp_side, whole)
            jobs.append(Job(f"local {lo.fp_name}", _reduce, args, holds=int(value.nbytes), shared=(ref,)))
    return jobs


def _local_parts(
    cut: CutModel, fp_out: dict[str, np.ndarray], local_out: dict[str, np.ndarray], state: CompareState
) -> None:
    """Local error of each Concat part of a model output (its writer fed FP32 inputs)."""
    for lo in cut.outputs:
        acc = state.outputs.get(lo.fp_name)
        if acc is None or not acc.spec.parts or lo.fp_name not in fp_out:
            continue
        value = local_out[lo.name]
        if lo.dequant is not None:
            value = lo.dequant.dequantize(value)
        acc.update_local(fp_out[lo.fp_name], value)


class _Reductions:
    """The numpy reductions of a pass, run on a thread pool while onnxruntime computes.

    numpy and onnxruntime both release the GIL, and onnxruntime leaves much of two cores idle on a
    decoder's small kernels: a batch's FP32 sides are reduced while the INT8 model runs, its
    errors while the cut model runs. Tasks with the same key (one tensor's accumulators) run in
    the order they were submitted: each first waits for the one before it, which the FIFO pool
    has already started, so no wait can deadlock and every sum is the same as a sequential loop's,
    bit for bit. Tasks hold the only references to the arrays they reduce: each value is freed as
    soon as its task is done. With one thread the tasks run inline, in order.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="diag-reduce") if threads > 1 else None
        self._pending: list[Future[Any]] = []
        self._last: dict[str, Future[Any]] = {}
        #: Bytes of the values the pending tasks hold (:attr:`Job.holds` and :attr:`Job.shared`).
        self._held = 0
        #: id of a shared value -> [its bytes, pending tasks reading it] (alive while they hold it).
        self._shared: dict[int, list[int]] = {}
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        """Bytes of values the pending tasks still hold."""
        return self._held

    def submit(self, jobs: list[Job]) -> dict[str, Future[Any]]:
        """Start ``jobs`` (emptying the list); returns each key's task. Their values count as held
        until they end (:meth:`wait_below`)."""
        started: dict[str, Future[Any]] = {}
        while jobs:
            key, fn, args, nbytes, shared = jobs.pop(0)
            if self._pool is None:
                done: Future[Any] = Future()
                done.set_result(fn(*args))
                started[key] = done
            else:
                with self._changed:
                    self._held += nbytes
                    ids = []
                    for value in shared:
                        entry = self._shared.setdefault(id(value), [int(value.nbytes), 0])
                        self._held += entry[0] if entry[1] == 0 else 0
                        entry[1] += 1
                        ids.append(id(value))
                task = self._pool.submit(_after, self._last.get(key), fn, *args)
                task.add_done_callback(functools.partial(self._release, nbytes, ids))
                self._pending.append(task)
                self._last[key] = started[key] = task
            del args, shared
        return started

    def _release(self, nbytes: int, ids: list[int], _task: Future[Any]) -> None:
        with self._changed:
            self._held -= nbytes
            for i in ids:
                entry = self._shared[i]
                entry[1] -= 1
                if entry[1] == 0:
                    self._held -= entry[0]
                    del self._shared[i]
            self._changed.notify_all()

    def wait_below(self, limit: int) -> None:
        """Block until the pending tasks hold at most ``limit`` bytes; re-raises a failure."""
        with self._changed:
            self._changed.wait_for(lambda: self._held <= limit)
        still: list[Future[Any]] = []
        for task in self._pending:
            if task.done():
                task.result()
            else:
                still.append(task)
        self._pending = still

    def wait(self) -> None:
        """Block until every submitted task is done; re-raises the first failure."""
        pending, self._pending = self._pending, []
        self._last.clear()
        for done in pending:
            done.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


class _EarlierFailure(Exception):
    """An earlier task of the same accumulators failed: this one did not run (the wait raises that
    failure first; raising it again here would keep this task's arrays in its traceback)."""


def _after(before: Future[Any] | None, fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` once ``before`` (the previous task of the same accumulators) is done."""
    if before is not None and before.exception() is not None:
        raise _EarlierFailure
    return fn(*args)


def _reduce_fp(
    dist: DistributionAccumulator | None, ref: np.ndarray, padding: tuple[np.ndarray, int] | None = None
) -> tuple[float, bool]:
    """The FP32 side of one tensor of one batch: Σx² for its errors, its distribution's FP32 half.

    ``padding``: the batch's real positions and the tensor's sequence axis; the distribution
    then counts the real positions only (Σx² stays every position's: the all-positions error).
    Returns Σx² and whether the distribution counted the batch (its INT8 half follows only then).
    """
    if dist is not None and padding is not None:
        counted = dist.update_fp(kept_values(ref, *padding))
    else:
        counted = dist.update_fp(ref) if dist is not None else False
    return sum_of_squares(ref), counted


class _Masked(NamedTuple):
    """A tensor's padding for one batch: its all-positions accumulator, the real positions and their axis."""

    whole: ErrorAccumulator
    keep: np.ndarray
    axis: int
    #: No padding in this batch: both accumulators get every value (no copy).
    all_kept: bool


def _padding_axis(name: str, value: np.ndarray, keep: BatchPadding | None) -> tuple[np.ndarray, int] | None:
    """The batch's real positions and the tensor's sequence axis, or None when it counts every value."""
    axis = keep.axis(name, value.shape) if keep is not None else None
    return (keep.keep, axis) if keep is not None and axis is not None else None


def _padding_masked(
    whole: dict[str, ErrorAccumulator], name: str, value: np.ndarray, keep: BatchPadding | None
) -> _Masked | None:
    """How one tensor of a batch leaves its padding out, or None when it counts every value."""
    padding = _padding_axis(name, value, keep)
    if padding is None or keep is None:
        return None
    return _Masked(whole.setdefault(name, ErrorAccumulator()), *padding, keep.all_kept)


def _reduce(  # NOTE: nine parameters, because a pool task is a function and one tuple of arguments (Job)
    acc: ErrorAccumulator,
    dist: DistributionAccumulator | None,
    ref: np.ndarray,
    value: np.ndarray,
    dequant: Any,
    scale: float | None,
    dynamic_scale: float | None,
    fp_side: Future[tuple[float, bool]] | None = None,
    masked: _Masked | None = None,
) -> None:
    """Reduce one tensor of one batch into its accumulators (one task of the reduction pool).

    ``fp_side``: the batch's :func:`_reduce_fp` task of this tensor, when its FP32 side was
    reduced apart (its Σx² is reused, its distribution gets only the INT8 half here).
    ``masked``: the batch has padding on this tensor's sequence axis: ``acc`` counts the real
    positions, ``masked.whole`` every position; the distribution counts the real positions.
    """
    s_xx, counted = fp_side.result() if fp_side is not None else (None, False)
    if dequant is not None:
        value = dequant.dequantize(value)
    if masked is not None:
        masked.whole.update(ref, value, scale, s_xx=s_xx)
    if masked is None or masked.all_kept:
        acc.update(ref, value, scale, s_xx=s_xx)
    else:
        ref, value = kept_values(ref, masked.keep, masked.axis), kept_values(value, masked.keep, masked.axis)
        acc.update(ref, value, scale)
    if dist is None:
        return
    if fp_side is None:
        dist.update(ref, value, dynamic_scale)
    elif counted:
        dist.update_int8(value, dynamic_scale)


def _update_deployed(
    state: CompareState,
    deployed: ort.InferenceSession,
    feeds: dict[str, np.ndarray],
    fp_out: dict[str, np.ndarray],
    q: LoadedModel,
    opt_level: str,
    output_names: list[str],
) -> dict[str, np.ndarray]:
    """Output figures of what onnxruntime really runs at ``opt_level`` against the exact FP32 outputs
    (both reduction paths); returns the deployed outputs (labels and task metrics are graded on them)."""
    dep_q = run_batch(deployed, feeds, f"INT8 model '{q.path.name}' ({opt_level})")
    for name in output_names:
        state.deployed.setdefault(name, OutputAccumulator(whole=True)).update(fp_out[name], dep_q[name], name, feeds)
    return dep_q


def _count_correct(
    state: CompareState, labels: np.ndarray, fp: np.ndarray, q: np.ndarray, q_exact: np.ndarray, size: int, start: int
) -> None:
    """Correct top-1 predictions of the batch: FP32, the graded INT8 outputs ``q`` (deployed when a
    deploy level is set) and the exact-mode ones."""
    if fp.ndim != 2 or fp.shape[0] != size:
        raise DiagError(
            "bad-inputs",
            "--labels",
            f"needs the first model output to be [batch, classes], it is {fp.shape}",
            "drop --labels for this model",
        )
    if start + size > len(labels):
        raise DiagError(
            "bad-inputs",
            "--labels",
            f"has {len(labels)} labels but the inputs have more samples",
            "give one label per sample",
        )
    truth = labels[start : start + size]
    state.labelled["n"] += size
    state.labelled["fp32"] += int((fp.argmax(axis=1) == truth).sum())
    state.labelled["int8"] += int((q.argmax(axis=1) == truth).sum())
    state.labelled["int8_exact"] = state.labelled.get("int8_exact", 0) + int((q_exact.argmax(axis=1) == truth).sum())


def _update_task(
    state: CompareState,
    options: StreamOptions,
    names: list[str],
    fp_out: dict[str, np.ndarray],
    q_out: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
    labels: np.ndarray | None,
    start: int,
    size: int,
) -> None:
    """Feed one batch of model outputs (and its labels) to the task metrics; ``q_out``: the INT8
    outputs as graded (deployed) and in exact mode (``f1_exact`` reads those)."""
    fp = {n: fp_out[n] for n in names}
    graded, exact = ({n: out[n] for n in names} for out in q_out)
    truth = labels[start : start + size] if labels is not None else None
    for key, metric in state.task.items():
        q = exact if key == "f1_exact" else graded
        call_update(metric, options.metric if key == "plugin" and options.metric else "f1", fp, q, truth)


def _scale_for(pair: TensorPair, q_out: dict[str, np.ndarray] | None) -> float | None:
    if pair.grid is not None:
        return pair.grid.per_tensor_scale
    if pair.dynamic_scale and q_out is not None and pair.dynamic_scale in q_out:
        return float(np.max(q_out[pair.dynamic_scale]))
    return None
