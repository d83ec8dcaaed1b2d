"""The only exceptions the CLI catches: user mistakes with a stable slug, an object and a hint.

Every message renders as one line::

    diag: error[<slug>]: <object> | <problem>. Hint: <what to do>

Slugs are stable (scripts grep for them) and documented in docs/errors.md, one heading each.
"""

from __future__ import annotations

OK = 0
INTERNAL_ERROR = 1
USER_ERROR = 2
GATE_FAILED = 3
INTERRUPTED = 130

#: slug -> one-line meaning; docs/errors.md says the same under each slug's heading (tests/test_readme.py).
SLUGS: dict[str, str] = {
    "missing-file": "a path given on the command line does not exist",
    "not-a-file": "a path names a directory or special file where a file is expected",
    "unreadable": "a file exists but cannot be read (permissions)",
    "empty-file": "a model file has zero bytes",
    "not-onnx": "a file is not a parseable ONNX model (wrong format or truncated)",
    "invalid-model": "an ONNX model fails onnx.checker or cannot be loaded by onnxruntime",
    "unsafe-external-data": "external data points outside the model's folder",
    "missing-external-data": "a model's external data file is missing",
    "not-quantized": "the model given as INT8 has no quantized operators",
    "fp32-is-quantized": "the model given as FP32 already contains quantized operators",
    "swapped-models": "FP32 and INT8 were given in the wrong order",
    "model-mismatch": (
        "FP32 and INT8 models are not two versions of the same graph, or shards are merged with other models"
    ),
    "bad-inputs": "input data does not fit the model (names, dtypes, shapes, values)",
    "bad-reader": "a --reader factory cannot be imported, raises or yields wrong types",
    "bad-metric": "a --metric plugin cannot be imported, raises, or does not follow the TaskMetric protocol",
    "bad-option": "a command-line option has an invalid value",
    "too-large": "the request would need more memory than allowed; refused up front",
    "runtime-failure": "onnxruntime failed while running a model (node named)",
    "bad-out": (
        "an output cannot be written (folder, permissions, space, a folder in the way) or would overwrite an input"
    ),
    "bad-report": (
        "a diag.json or shard file is unreadable, fails the shipped schema or its checks (field named), "
        "or shards do not form one run"
    ),
    "missing-templates": "the report templates are not installed with the package",
    "bad-recipe": "a recipe file is not valid JSON/TOML or has an unknown key or value",
    "bad-encodings": (
        "an AIMET .encodings file is unreadable, or holds encodings diag cannot build (a bit width it does not "
        "build, scales or blocks that do not fit their tensor, a per-block model that does not convert to opset 21)"
    ),
    "recipe-mismatch": (
        "a recipe does not rebuild the user's INT8 model exactly, so re-quantizing from it would fix another model"
    ),
    "quantize-failed": "onnxruntime's quantizer failed, or its output does not load in onnxruntime",
    "missing-extra": 'an optional dependency a flag needs is not installed (e.g. pip install "diag[dask]")',
    "no-scheduler": "the Dask scheduler given by --scheduler cannot be reached or has no workers",
    "cluster-failure": "a task failed on the Dask cluster (e.g. its workers kept dying, or cannot read the files)",
}


class DiagError(Exception):
    """A user-facing failure: one line, a stable slug, a hint, a named exit code.

    Example:
        >>> e = DiagError("bad-inputs", "input 'x'", "has dtype int32, model wants float32",
        ...               "cast the array with .astype(np.float32)")
        >>> str(e)
        "input 'x' | has dtype int32, model wants float32. Hint: cast the array with .astype(np.float32)"
    """

    exit_code = USER_ERROR

    def __init__(self, slug: str, obj: str, problem: str, hint: str = "") -> None:
        if slug not in SLUGS:
            raise ValueError(f"undocumented error slug {slug!r}")
        self.slug = slug
        self.obj = obj
        self.problem = problem
        self.hint = hint
        super().__init__(self.message())

    def message(self) -> str:
        """The one-line message, without the ``diag: error[slug]:`` prefix."""
        text = f"{self.obj} | {self.problem}"
        if self.hint:  # a problem that ends in its own mark ("did you swap them?") gets no second one
            text += f"{'' if self.problem.endswith(('.', '?', '!')) else '.'} Hint: {self.hint}"
        return _one_line(text)


def _one_line(text: str) -> str:
    """Collapse newlines and strip terminal control characters (names come from untrusted files)."""
    cleaned = "".join(ch if ch.isprintable() else " " for ch in text.replace("\n", " "))
    return cleaned
