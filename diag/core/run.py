"""onnxruntime sessions for FP32, INT8 and cut models, run one batch at a time.

Heavy import: onnxruntime is imported inside the functions so ``diag --help`` stays instant.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from diag.core.fp16 import float16_feeds, float32_outputs
from diag.core.protos import structure_only
from diag.foundations.environment import custom_op_libraries, session_options
from diag.foundations.errors import DiagError


def session_from_model(
    model: onnx.ModelProto | Path,
    role: str,
    opt_level: str = "disabled",
    threads: int | None = None,
    external_data_dir: Path | None = None,
    optimized_path: Path | None = None,
    takes_turns: bool = False,
    frees_inside_run: bool = False,
) -> Any:
    """An ``InferenceSession`` on the CPU for ``model``.

    ``opt_level="disabled"`` (exact mode) keeps every tensor onnxruntime would otherwise fuse
    away. ``external_data_dir`` lets a model whose weights stay in external files be loaded from
    memory without copying the weights: ``model`` holds only the references, onnxruntime reads the
    files from that folder. ``threads`` sets intra-op threads (default: onnxruntime's; ``diag compare`` passes
    :func:`default_threads`); ``takes_turns=True`` for sessions
    that run one after the other (no spinning workers, no memory arena); ``frees_inside_run=True``
    for a session whose intermediate tensors are freed inside the run (the diagnostic graph): it
    keeps its memory arena and runs without onnxruntime's memory pattern.
    ``optimized_path`` makes onnxruntime save the graph it really runs there (fused kernels).
    ``model`` may be a path (a graph too large to pass as bytes, saved with external data).

    Example:
        >>> s = session_from_model(onnx.load("m.onnx"), "FP32 model", threads=2)  # doctest: +SKIP
        >>> s.get_session_options().intra_op_num_threads  # doctest: +SKIP
        2
    """
    import onnxruntime as ort

    levels = {  # by diag.foundations.ortfacts.OPT_LEVELS (tests/test_ortfacts.py)
        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    so = session_options()
    so.graph_optimization_level = levels[opt_level]
    so.log_severity_level = 4  # errors reach the user as one DiagError line, not as onnxruntime's log
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if takes_turns:
        # NOTE: diag compare's sessions (FP32, INT8, cut) run one after the other. Idle onnxruntime
        # workers would spin after each run, stealing the cores from the next session and from the
        # numpy reductions; and each session's memory arena would keep its peak (every exposed
        # tensor of a batch) reserved for good, three times over. Without the arena a run's buffers
        # go back to the system: measured on PP-OCRv4 det 320x320, peak RSS 898 -> 686 MB.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # NOTE: ``frees_inside_run=True`` keeps it for a session whose intermediate tensors are freed inside
        # the run (the diagnostic graph): its peak is one run's working set, and reusing arena
        # blocks for thousands of small statistic tensors halves that session's run time.
        so.enable_cpu_mem_arena = frees_inside_run
    # NOTE: onnxruntime's memory pattern preallocates one block for every intermediate tensor of
    # a run as planned; on the diagnostic graph (three models and their statistics) that block is
    # most of the peak: PP-OCRv4 det 320x320, peak RSS 804 -> 516 MB without it, no slower.
    so.enable_mem_pattern = not frees_inside_run
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    if external_data_dir is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_data_dir))
    try:
        source = str(model) if isinstance(model, Path) else model.SerializeToString()
        return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise _load_failure(e, role) from e


def _load_failure(e: Exception, role: str) -> DiagError:
    """Why onnxruntime could not create a session, as one line: a custom op names its library flag."""
    custom = _UNKNOWN_OP.search(str(e))
    if custom is not None:
        return DiagError(
            "invalid-model",
            role,
            f"uses the custom op {custom.group(1)}:{custom.group(2)}, which onnxruntime runs only with "
            f"its library ({len(custom_op_libraries())} registered)",
            "register the library that implements it: diag --custom-op-library PATH VERB ... "
            "(AMD Quark's Extended(De)QuantizeLinear: quark/onnx/operators/custom_ops/lib/libcustom_ops.so)",
        )
    return DiagError(
        "invalid-model",
        role,
        f"fails to load in onnxruntime: {_first_line(e)}",
        "check the model runs with onnxruntime.InferenceSession; custom ops need their library",
    )


#: onnxruntime's message for an op of a domain no registered library provides.
_UNKNOWN_OP = re.compile(r"([\w.]+):(\w+)\(-?\d+\) is not a registered function/op")


_ALLOCATOR_TUNED = False


def reuse_freed_memory() -> None:
    """Make glibc keep and reuse the memory of freed arrays instead of returning it at once.

    Why: every batch allocates the same few hundred large arrays (exposed tensors, their
    temporaries). By default glibc maps each array above a threshold afresh and unmaps it when it
    is freed, so the kernel zeroes every page again on every batch: on PP-OCRv4 det at 320x320,
    8 samples, page faults fell from 370k to 164k and ``diag compare`` from 4.7 to 3.5 s with
    this. Peak RSS does not grow (the same memory is reused); the process keeps its peak heap
    until it exits. Process-wide and idempotent; does nothing where glibc is not the allocator.

    Example:
        >>> reuse_freed_memory()  # doctest: +SKIP
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED or not sys.platform.startswith("linux"):
        return
    _ALLOCATOR_TUNED = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc (e.g. musl): nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum; larger arrays are still mapped
    mallopt(m_trim_threshold, 1 << 30)


def drop_mapped_pages(files: Iterable[Path]) -> int:
    """Unmap the clean pages of ``files`` that this process has mapped; returns the mappings advised.

    onnxruntime maps aligned external data (one mapping per initializer) and reads it in place.
    A Gather over an embedding table touches new rows every batch, and the kernel maps the pages
    around each touched one: the resident size grows with the number of samples (500M int4
    decoder: ~6 MB a sample, +236 MB over 64 samples) though nothing new is held. After a batch,
    ``MADV_DONTNEED`` on those mappings gives the pages back to the page cache; the next access
    maps them again from there (a minor fault). Only mappings without private (copied-on-write)
    pages are advised, so no byte onnxruntime might have written is ever discarded. Linux only;
    elsewhere, or without ``/proc``, it does nothing and returns 0.

    Example:
        >>> drop_mapped_pages([Path("no-such-model.onnx.data")])
        0
    """
    targets = {str(Path(f).resolve()) for f in files}
    if not targets or not sys.platform.startswith("linux"):
        return 0
    ranges: list[tuple[int, int]] = []
    try:
        with open("/proc/self/smaps") as fh:
            current: tuple[int, int] | None = None
            for line in fh:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    path = head[5].strip() if len(head) > 5 else ""
                    a, b = (int(x, 16) for x in head[0].split("-"))
                    current = (a, b) if path in targets else None
                elif current is not None and head and head[0] == "Anonymous:":
                    if head[1] == "0":
                        ranges.append(current)
                    current = None
        libc = ctypes.CDLL("libc.so.6")
    except (OSError, ValueError):
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madv_dontneed = 4
    return sum(libc.madvise(a, b - a, madv_dontneed) == 0 for a, b in ranges)


def file_resident_bytes() -> int:
    """Bytes of this process's memory that are file-backed and resident (``/proc/self/statm``'s
    shared pages: mapped files, libraries included); 0 where that file does not exist.

    One line to read, unlike ``/proc/self/smaps``: cheap enough to ask after every batch.

    Example:
        >>> file_resident_bytes() >= 0
        True
    """
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[2]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def default_threads() -> int:
    """Cores this process may run on: every session gets all of them, one session at a time.

    Example:
        >>> default_threads() >= 1
        True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def run_batch(session: Any, feeds: dict[str, np.ndarray], role: str) -> dict[str, np.ndarray]:
    """Run one batch; returns every output by name. Failures name the node onnxruntime reported."""
    import onnxruntime as ort

    names = [o.name for o in session.get_outputs()]
    feeds = float16_feeds(session, feeds)
    run_options = ort.RunOptions()
    run_options.log_severity_level = 4
    try:
        values = session.run(names, feeds, run_options)
    except Exception as e:
        node = re.search(r"Name:\s*'([^']*)'", str(e)) or re.search(r"[Nn]ode(?: \(|:\s*)?'([^'\s)]+)", str(e))
        where = f" at node '{node.group(1)}'" if node else ""
        raise DiagError(
            "runtime-failure",
            role,
            f"onnxruntime failed{where}: {_first_line(e)}",
            "check the inputs' shapes and values; run with --debug for the full error",
        ) from e
    return float32_outputs(dict(zip(names, values, strict=True)))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:400]


def available_memory() -> int | None:
    """Bytes of memory the OS says are available now (``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def tensor_bytes(model: onnx.ModelProto) -> list[tuple[int, str, tuple[int | str, ...]]]:
    """Bytes per sample of every tensor whose shape onnx shape inference knows, largest first.

    Symbolic dims count as 1 (one sample; unknown sizes are not guessed), so the estimate is a
    lower bound: it catches declared shapes that can never fit, never refuses a model for a dim
    it cannot see. Runs on a weight-free copy of the model.

    Example:
        >>> tensor_bytes(model)[0]  # doctest: +SKIP
        (4000000000000, 'huge', (1000000, 1000000))
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(structure_only(model), strict_mode=False)
    except Exception:  # inference is a help, not a requirement
        inferred = model
    g = inferred.graph
    weights = {t.name for t in model.graph.initializer}  # held once by the session, not per batch
    sizes: dict[str, tuple[int, str, tuple[int | str, ...]]] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.name in weights:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape") or not tt.elem_type:
            continue
        dims: tuple[int | str, ...] = tuple(
            int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim
        )
        try:
            itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).itemsize
        except Exception:
            itemsize = 4
        elems = math.prod(d if isinstance(d, int) and d > 0 else 1 for d in dims)
        sizes[vi.name] = (elems * itemsize, vi.name, dims)
    return sorted(sizes.values(), reverse=True)


def check_memory(models: list[tuple[onnx.ModelProto, str, int]], batch: int, limit: int | None = None) -> int:
    """Refuse up front (``too-large``) when one batch's exposed tensors cannot fit in memory.

    ``models`` are ``(model, role, copies)``: the INT8 model's tensors are held twice (the INT8
    pass and the cut model of the local-error pass). ``limit`` defaults to the memory available
    now. Returns the estimate in bytes.

    Example:
        >>> check_memory([(fp32, "FP32 model", 1), (int8, "INT8 model", 2)], batch=8)  # doctest: +SKIP
        1048576
    """
    limit = available_memory() if limit is None else limit
    total = 0
    largest: tuple[int, str, tuple[int | str, ...], str] | None = None
    for model, role, copies in models:
        sizes = tensor_bytes(model)
        total += copies * batch * sum(s[0] for s in sizes)
        if sizes and (largest is None or sizes[0][0] > largest[0]):
            largest = (*sizes[0], role)
    if limit is not None and largest is not None and total > limit:
        nbytes, name, dims, role = largest
        shape = "x".join(str(d) for d in dims)
        raise DiagError(
            "too-large",
            f"{role} tensor '{name}'",
            f"one batch of {batch} sample(s) needs at least {_human(total)} of tensors, {_human(limit)} available "
            f"(the largest, '{name}' [{shape}], alone takes {_human(nbytes * batch)} per batch)",
            "check the declared shape of that tensor, or lower --batch",
        )
    return total


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(text: str) -> int:
    """Bytes from ``4GB``, ``512MB``, ``1.5GiB`` or a plain number (``--max-memory``).

    Units are powers of 1024 whether written ``GB`` or ``GiB``, as memory is counted.

    Example:
        >>> parse_size("4GB"), parse_size("512 MiB"), parse_size("1000")
        (4294967296, 536870912, 1000)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise DiagError("bad-option", f"size '{text}'", "is not a positive size", "write e.g. 4GB, 512MB or 1.5GiB")
    power = " KMGT".index((m.group(2) or " ").upper())
    return int(float(m.group(1)) * 1024**power)


def inferred_for_batch(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A weight-free copy of ``model`` with its inputs pinned to the batch's shapes, shapes inferred.

    Symbolic dims (batch, height, width) become numbers. Inference is a help, never a requirement:
    when it fails, the copy comes back without inferred shapes and callers fall back.
    """
    shell = structure_only(model)
    for vi in shell.graph.input:
        if vi.name in feeds and vi.type.HasField("tensor_type"):
            shape = vi.type.tensor_type.shape
            shape.ClearField("dim")
            for d in np.shape(feeds[vi.name]):
                shape.dim.add().dim_value = int(d)
    try:
        return onnx.shape_inference.infer_shapes(shell, strict_mode=False, data_prop=True)
    except Exception:
        return shell


def batch_tensor_bytes(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Bytes of every tensor of ``model`` for one batch ``feeds``, by shape inference on its shapes.

    The model's inputs are pinned to the batch's real shapes first, so symbolic dims (batch,
    height, width) become numbers. A tensor whose shape stays unknown (data-dependent) is
    counted as large as the largest input of its producer (elementwise ops keep sizes), or as
    the largest known tensor when none of those is known: overestimating costs an extra pass,
    underestimating could cost the memory the budget protects. Runs on a weight-free copy.

    Example:
        >>> sizes = batch_tensor_bytes(model, {"x": np.zeros((8, 3, 64, 64), np.float32)})  # doctest: +SKIP
        >>> sizes["conv1_out"]  # doctest: +SKIP
        4194304
    """
    g = inferred_for_batch(model, feeds).graph
    sizes: dict[str, int] = {k: int(np.asarray(v).nbytes) for k, v in feeds.items()}
    for vi in list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape") or not tt.elem_type:
            continue
        if not all(d.HasField("dim_value") for d in tt.shape.dim):
            continue
        try:
            itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).itemsize
        except Exception:
            itemsize = 4
        sizes[vi.name] = math.prod(int(d.dim_value) for d in tt.shape.dim) * itemsize
    largest = max(sizes.values(), default=0)
    initializers = {i.name for i in g.initializer}
    for node in g.node:
        for out in node.output:
            if out and out not in sizes:
                known = [sizes[i] for i in node.input if i in sizes and i not in initializers]
                sizes[out] = max(known) if known else largest
    return sizes


def plan_passes(names: list[str], cost: dict[str, int], budget: int | None) -> list[list[str]]:
    """Split ``names`` (in graph order) into consecutive groups whose summed ``cost`` fits ``budget``.

    One group (one pass) when there is no budget or everything fits. A tensor larger than the
    budget alone gets a pass of its own: it cannot be split further.

    Example:
        >>> plan_passes(["a", "b", "c"], {"a": 3, "b": 3, "c": 3}, 7)
        [['a', 'b'], ['c']]
    """
    if budget is None or sum(cost.get(n, 0) for n in names) <= budget:
        return [list(names)]
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        c = cost.get(name, 0)
        if groups[-1] and used + c > budget:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += c
    return groups


def parse_shard(text: str) -> tuple[int, int]:
    """``"3/8"`` -> ``(3, 8)``: shard 3 of 8 runs batches 3, 11, 19, ... (``--shard``).

    Example:
        >>> parse_shard("3/8")
        (3, 8)
    """
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise DiagError(
            "bad-option", f"--shard '{text}'", "must be K/N with 0 <= K < N", "shards of 4 are 0/4, 1/4, 2/4, 3/4"
        )
    return int(m.group(1)), int(m.group(2))


def parse_effect_samples(text: str) -> int | str:
    """``--effect-samples``: ``"auto"`` or a positive count of samples.

    Example:
        >>> parse_effect_samples("6"), parse_effect_samples("auto")
        (6, 'auto')
    """
    return _sample_count(text, "--effect-samples", ("auto",), "--effects 0 turns the effect check off")


def parse_local_samples(text: str) -> int | str:
    """``--local-samples``: ``"all"``, ``"auto"`` or a positive count of samples.

    Example:
        >>> parse_local_samples("16"), parse_local_samples("all")
        (16, 'all')
    """
    hint = "--local-samples all measures local error on every sample; --no-local skips it"
    return _sample_count(text, "--local-samples", ("all", "auto"), hint)


def _sample_count(text: str, flag: str, words: tuple[str, ...], hint: str) -> int | str:
    """A positive count of samples, or one of ``words``; else a bad-option error naming ``flag``."""
    word = text.strip().lower()
    if word in words:
        return word
    if word.isdigit() and int(word) > 0:
        return int(word)
    choices = " or ".join(words)  # "all or auto": "samples, all or auto"; "auto": "samples or auto"
    joined = f"{',' if len(words) > 1 else ' or'} {choices}"
    raise DiagError("bad-option", f"{flag} '{text}'", f"must be a positive number of samples{joined}", hint)
