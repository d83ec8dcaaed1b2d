"""Hostile input, round two (issue 18): every verb, every file, every interrupt.

Each row runs the real CLI (``diag.cli.commands.main``) in a child process forked from this one after diag,
onnx and onnxruntime are imported, so a row costs milliseconds of start-up instead of seconds: the
child has its own exit code, stdout, stderr, signals and memory limit, exactly as ``python -m diag``
would. A row asserts the exit code, the slug, one line on stderr, no traceback, every input file
byte-identical and ``--out`` either unchanged or holding exactly the new set.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from diag.cli import commands as cli
from diag.foundations.errors import INTERRUPTED, OK, USER_ERROR

sys.path.insert(0, str(Path(__file__).parent))
from test_hostile import Pair, _pair, _x, mlp

ROOT = os.geteuid() == 0
# Imported once here, so that every forked run starts with them loaded (a fresh interpreter spends
# seconds importing onnx and onnxruntime; the rows test diag's behaviour, not Python's start-up).
for _module in (
    "diag.analysis.compare",
    "diag.analysis.merge",
    "diag.fix.sweep",
    "diag.fix.exclude",
    "diag.fix.quantize",
    "diag.fix.bench",
    "diag.report.view",
    "diag.fix.lint",
    "diag.report.gate",
    "diag.report.diff",
    "diag.fix.infer",
    "diag.report.plots",
    "diag.report.plots_sweep",
    "onnxruntime",
):
    __import__(_module)
matplotlib.use("Agg")  # what diag.report.plots selects; imported now so that no forked run pays for it
__import__("matplotlib.pyplot")
TIMES: dict[str, float] = {}


@dataclass
class Ran:
    """What a forked ``diag`` run left: exit code, stdout, stderr, peak RSS of the child in bytes."""

    code: int
    out: str
    err: str
    peak_rss: int  # the child's peak RSS minus its RSS when diag started (bytes)


def run_diag(
    args: list[object],
    tmp: Path,
    *,
    limit_as: int | None = None,
    before: Callable[[], None] | None = None,
    cwd: Path | None = None,
) -> Ran:
    """Run ``diag ARGS`` in a forked child; ``limit_as`` caps its address space (bytes above the current size)."""
    out_path, err_path = tmp / ".stdout", tmp / ".stderr"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            fo = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            fe = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fo, 1)
            os.dup2(fe, 2)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the child's stdout for the rest of its life
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if cwd is not None:
                os.chdir(cwd)
            if limit_as is not None:
                vm = _vm_size()
                resource.setrlimit(resource.RLIMIT_AS, (vm + limit_as, vm + limit_as))
            if before is not None:
                before()
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now (what fork inherited)
            start = _status("VmRSS")
            code = cli.main([str(a) for a in args])
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(w, f"{_status('VmHWM') - start}\n".encode())  # forks of an interrupt test write too: last wins
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        except BaseException as e:
            os.write(2, f"CHILD CRASH {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    rss = (b"".join(chunks).split() or [b"0"])[-1]
    code = os.waitstatus_to_exitcode(status)
    return Ran(code, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"), int(rss or 0))


def _status(key: str) -> int:
    """A size from /proc/self/status (VmSize, VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


def _vm_size() -> int:
    return _status("VmSize")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    """Every regular file under ``folder`` (hidden ones too) with its hash; FIFOs and sockets by type."""
    if not folder.exists():
        return {}
    found = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if rel.startswith(".std"):
            continue
        mode = p.lstat().st_mode
        if stat.S_ISREG(mode) and os.access(p, os.R_OK):
            found[rel] = _sha(p)
        elif stat.S_ISDIR(mode):
            found[rel] = "dir"
        else:
            found[rel] = "special"
    return found


# ---------------------------------------------------------------- the prepared files, once per module


@dataclass
class Zoo:
    d: Path
    p: Pair
    shard0: Path
    shard1: Path
    report: Path
    other: Pair
    other_shard0: Path
    fifo: Path
    extras: dict[str, Path] = field(default_factory=dict)


FAST = ["--quiet", "--effects", "0", "--no-distributions", "--no-local"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    d = tmp_path_factory.mktemp("zoo2")
    p = _pair(d, "mlp", mlp(), {"x": _x()})
    other = _pair(d, "deep", mlp(hidden=8, seed=5, names=("a1", "a2")), {"x": _x()})
    shards = []
    for k in (0, 1):
        ran = run_diag(
            ["compare", p.fp32, p.int8, "--inputs", p.inputs, "--shard", f"{k}/2", "--out", d / f"part{k}", *FAST], d
        )
        assert ran.code == OK, ran.err
        shards.append(d / f"part{k}" / "diag.json")
    ran = run_diag(
        ["compare", other.fp32, other.int8, "--inputs", other.inputs, "--shard", "0/2", "--out", d / "opart0", *FAST],
        d,
    )
    assert ran.code == OK, ran.err
    fifo = d / "fifo.npz"
    os.mkfifo(fifo)
    folder = d / "feeds_with_fifo"
    folder.mkdir()
    np.savez(folder / "000.npz", x=_x(1))
    os.mkfifo(folder / "001.npz")
    (d / "recipe.json").write_text('{"mode": "dynamic", "weight_type": "QUInt8"}\n')
    (d / "doc.html").write_bytes(shards[0].read_bytes())
    (d / "trap").mkdir()
    with open(d / "trap" / "diag.json", "wb") as fh:
        np.savez(fh, x=_x())
    (d / "trap2").mkdir()
    (d / "trap2" / "sweep.json").write_text('{"mode": "dynamic", "weight_type": "QUInt8"}\n')
    (d / "ext").mkdir()
    onnx.save(
        onnx.load(str(p.int8)),
        str(d / "ext" / "m.int8.onnx"),
        save_as_external_data=True,
        location="w.data",
        size_threshold=0,
    )
    # A shard's diag.json is a complete compare document too (with a shard section): it serves as "the report".
    return Zoo(d, p, shards[0], shards[1], shards[0], other, d / "opart0" / "diag.json", fifo)


@dataclass(frozen=True)
class Row:
    """One hostile command: what it must print (slug, fragment) and exit with."""

    cls: int
    label: str
    args: list[object]
    slug: str
    fragment: str
    code: int = USER_ERROR
    out: str | None = None  # the folder (relative to the row's folder) that must stay unchanged


def check_row(ran: Ran, row: Row) -> list[str]:
    problems = []
    lines = ran.err.strip().splitlines()
    if ran.code != row.code:
        problems.append(f"exit {ran.code} != {row.code}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} stderr lines")
    elif not lines[0].startswith(f"diag: error[{row.slug}]: "):
        problems.append("wrong slug")
    elif row.fragment not in lines[0]:
        problems.append(f"fragment {row.fragment!r} missing")
    if "Traceback" in ran.err or "internal error" in ran.err:
        problems.append("traceback or internal error")
    return problems


def run_rows(rows: list[Row], zoo: Zoo, tmp_path: Path) -> None:
    """Run every row; inputs (the whole zoo) must stay byte-identical, ``--out`` unchanged."""
    assert len({r.label for r in rows}) == len(rows)
    before = tree(zoo.d)
    failures = []
    for row in rows:
        folder = tmp_path / f"row{rows.index(row)}"
        folder.mkdir()
        args = [str(a).replace("{tmp}", str(folder)) for a in row.args]
        t0 = time.perf_counter()
        ran = run_diag(args, folder, limit_as=1 << 30)  # absurd counts and bombs must not allocate
        TIMES[row.label] = time.perf_counter() - t0
        problems = check_row(ran, row)
        if ran.peak_rss > 256 << 20:
            problems.append(f"peak RSS grew by {ran.peak_rss >> 20} MiB")
        left = sorted(k for k in tree(folder) if not k.startswith(".std"))
        if left:
            problems.append(f"left in the row's folder: {left}")
        if tree(zoo.d) != before:
            changed = sorted(k for k, v in tree(zoo.d).items() if before.get(k) != v)
            problems.append(f"inputs changed: {changed}")
            before = tree(zoo.d)
        if problems:
            failures.append(f"[class {row.cls}] {row.label}: {'; '.join(problems)}: {ran.err.strip()!r}")
    if os.environ.get("DIAG_ROW_TIMES"):
        print("\n".join(f"{t:6.2f} s  {k}" for k, t in sorted(TIMES.items(), key=lambda kv: -kv[1])))
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- classes 1 and 2: odd paths, outputs that are inputs


def _path_rows(z: Zoo) -> list[Row]:
    p, d = z.p, z.d
    long_name = d / ("n" * 300 + ".npz")
    long_model = d / ("m" * 300 + ".onnx")
    out = "{tmp}/out"

    def cmp(*flags: object) -> list[object]:
        return ["compare", p.fp32, p.int8, *flags, "--out", out, *FAST]

    return [
        # 1. special and odd paths
        Row(1, "FIFO as --inputs", cmp("--inputs", z.fifo), "not-a-file", "is not a regular file (a FIFO)"),
        Row(
            1,
            "FIFO inside an inputs folder",
            cmp("--inputs", d / "feeds_with_fifo"),
            "not-a-file",
            "001.npz' | is not a regular file (a FIFO)",
        ),
        Row(
            1,
            "FIFO as --calib",
            ["quantize", p.fp32, "--recipe", '{"mode": "static"}', "-o", "{tmp}/q.onnx", "--calib", z.fifo],
            "not-a-file",
            "a FIFO",
        ),
        Row(1, "FIFO as --labels", cmp("--inputs", p.inputs, "--labels", z.fifo), "not-a-file", "a FIFO"),
        Row(1, "FIFO as a recipe", ["lint", z.fifo], "not-a-file", "recipe '"),
        Row(1, "FIFO as a diag.json", ["check", z.fifo, "--max-grade", "reject"], "not-a-file", "report '"),
        Row(1, "FIFO as a model", ["bench", z.fifo, "--random", "--runs", "1"], "not-a-file", "a FIFO"),
        Row(1, "name too long: --inputs", cmp("--inputs", long_name), "missing-file", "longer than this system"),
        Row(1, "name too long: model", ["inspect", long_model], "missing-file", "longer than this system allows"),
        Row(1, "name too long: diff", ["diff", z.report, d / ("r" * 300)], "missing-file", "longer than this system"),
        Row(
            1,
            "name too long: --out",
            ["compare", p.fp32, p.int8, "--inputs", p.inputs, "--out", "{tmp}/" + "o" * 300, *FAST],
            "bad-out",
            "longer than this system allows",
        ),
        Row(
            1,
            "name too long: -o",
            ["quantize", p.fp32, "--recipe", d / "recipe.json", "-o", "{tmp}/" + "q" * 300 + ".onnx"],
            "bad-out",
            "longer than this system allows",
        ),
        Row(
            1,
            "name too long: grid",
            ["sweep", p.fp32, "--inputs", p.inputs, "--grid", d / ("g" * 300 + ".toml"), "--out", out],
            "missing-file",
            "longer than this system allows",
        ),
        Row(1, "a folder as --labels", cmp("--inputs", p.inputs, "--labels", d), "not-a-file", "is a directory"),
        # 2. outputs that are inputs
        Row(
            2,
            "bench --json over the model",
            ["bench", p.fp32, "--random", "--runs", "1", "--json", p.fp32],
            "bad-out",
            "is an input of this command (mlp.fp32.onnx)",
        ),
        Row(
            2,
            "inspect --recipe-out over the model",
            ["inspect", p.int8, "--recipe-out", p.int8],
            "bad-out",
            "is an input of this command (mlp.int8.onnx)",
        ),
        Row(
            2,
            "quantize -o over the model",
            ["quantize", p.fp32, "--recipe", d / "recipe.json", "-o", p.fp32],
            "bad-out",
            "is the FP32 model itself",
        ),
        Row(
            2,
            "merge --out over a shard's folder",
            ["merge", z.shard0, z.shard1, "--out", z.shard0.parent],
            "bad-out",
            "diag.json' | is an input of this command (diag.json)",
        ),
        Row(
            2,
            "report --out FILE.html that is the diag.json",
            ["report", d / "doc.html", "--out", d / "doc.html"],
            "bad-out",
            "doc.html' | is an input of this command (doc.html)",
        ),
        Row(
            2,
            "compare writing diag.json over its --inputs",
            ["compare", p.fp32, p.int8, "--inputs", d / "trap" / "diag.json", "--out", d / "trap", *FAST],
            "bad-out",
            "is an input of this command",
        ),
        Row(
            2,
            "sweep --out over the recipe grid",
            [
                "sweep",
                p.fp32,
                "--inputs",
                p.inputs,
                "--grid",
                d / "trap2" / "sweep.json",
                "--runs",
                "0",
                "--out",
                d / "trap2",
                "--quiet",
            ],
            "bad-out",
            "sweep.json' | is an input of this command",
        ),
        Row(
            2,
            "inspect --recipe-out over the model's external data",
            ["inspect", d / "ext" / "m.int8.onnx", "--recipe-out", d / "ext" / "w.data"],
            "bad-out",
            "is an input of this command (w.data)",
        ),
    ]


def test_odd_paths_and_outputs_that_are_inputs_fail_cleanly(zoo, tmp_path):
    run_rows(_path_rows(zoo), zoo, tmp_path)


# ---------------------------------------------------------------- class 3: all or nothing, in every verb

OLD = "an earlier run's file\n"


@dataclass(frozen=True)
class Blocked:
    """A verb whose --out holds an earlier set and something in the way; nothing may be replaced."""

    label: str
    args: list[object]
    old: tuple[str, ...]
    blocker: str
    fragment: str = "is in the way: a folder has this name"
    disk_full: bool = False
    hook: Callable[[], None] | None = None  # instead of the disk-full hook


def _blocked(z: Zoo) -> list[Blocked]:
    p, d = z.p, z.d
    cmp = ["compare", p.fp32, p.int8, "--inputs", p.inputs, "--out", "{out}", *FAST]
    report_set = ("diag.json", "report.html", "summary.md")
    sweep = ["sweep", p.fp32, "--inputs", p.inputs, "--grid", '{"mode": "dynamic", "weight_type": "QUInt8"}']
    sweep += ["--runs", "0", "--out", "{out}", "--quiet"]
    exclude = ["exclude", p.fp32, "--recipe", d / "recipe.json", "--target", "cosine>=0.5", "--inputs", p.inputs]
    exclude += ["--bench-runs", "0", "--out", "{out}", "--quiet"]
    full = "cannot be written (No space left on device); no output was replaced"
    return [
        Blocked("compare: a folder named summary.md", cmp, report_set, "summary.md"),
        Blocked("compare: disk full on the second file", cmp, report_set, "report.html", full, disk_full=True),
        Blocked(
            "compare: the last rename fails",
            cmp,
            report_set,
            "summary.md",
            "cannot be replaced (No space left on device); every old file was put back",
            disk_full=True,
            hook=_last_rename_fails,
        ),
        Blocked(
            "merge: a folder named report.html",
            ["merge", z.shard0, z.shard1, "--out", "{out}"],
            report_set,
            "report.html",
        ),
        Blocked("report: a folder named summary.md", ["report", z.report, "--out", "{out}"], report_set, "summary.md"),
        Blocked("sweep: a folder named pareto.svg", sweep, ("sweep.json", "sweep.md", "sweep.html"), "pareto.svg"),
        Blocked("sweep: disk full", sweep, ("sweep.json", "sweep.md", "sweep.html"), "sweep.md", full, True),
        Blocked("exclude: a folder named summary.md", exclude, ("exclusion.json", "diag.json"), "summary.md"),
        Blocked("exclude: disk full", exclude, ("exclusion.json", "diag.json"), "reproduce.py", full, True),
        Blocked(
            "bench: --json names a folder",
            ["bench", p.fp32, p.int8, "--random", "--runs", "1", "--warmup", "0", "--json", "{out}/bench.json"],
            ("x.json",),
            "bench.json",
        ),
        Blocked(
            "quantize: -o names a folder",
            ["quantize", p.fp32, "--recipe", d / "recipe.json", "-o", "{out}/q.onnx"],
            ("x.onnx",),
            "q.onnx",
        ),
        Blocked(
            "inspect: --recipe-out names a folder",
            ["inspect", p.int8, "--recipe-out", "{out}/r.toml"],
            ("r.json",),
            "r.toml",
        ),
    ]


def _disk_full_on_second_staged_file() -> None:
    """In the child: fsync of the second file staged by diag.foundations.files.write_set fails with ENOSPC."""
    import errno

    real, seen = os.fsync, []

    def fsync(fd: int) -> None:
        if ".diag-stage-" in os.readlink(f"/proc/self/fd/{fd}"):
            seen.append(fd)
            if len(seen) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    os.fsync = fsync  # type: ignore[assignment]


def _last_rename_fails() -> None:
    """In the child: renaming the staged summary.md over the old one fails (after two renames succeeded)."""
    import errno

    real = os.replace

    def replace(src: object, dst: object) -> None:
        if ".diag-stage-" in str(src) and "/.old/" not in str(src) and str(dst).endswith("summary.md"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(src, dst)  # type: ignore[arg-type]

    os.replace = replace  # type: ignore[assignment]


def test_a_blocked_output_set_replaces_nothing_and_names_the_blocker(zoo, tmp_path):
    before = tree(zoo.d)
    failures = []
    for i, case in enumerate(_blocked(zoo)):
        out = tmp_path / f"case{i}"
        out.mkdir()
        for name in case.old:
            if name != case.blocker or case.disk_full:
                (out / name).write_text(OLD)
        if not case.disk_full:
            (out / case.blocker).mkdir()
        old = tree(out)
        args = [str(a).replace("{out}", str(out)) for a in case.args]
        hook = case.hook or (_disk_full_on_second_staged_file if case.disk_full else None)
        ran = run_diag(args, tmp_path, before=hook)
        row = Row(3, case.label, args, "bad-out", f"{case.blocker}' | {case.fragment}")
        problems = check_row(ran, row)
        now = tree(out)
        now.pop("sweep.jsonl", None)  # the resume file: one line per finished recipe, by design
        if now != old:
            problems.append(f"--out changed: {sorted(set(tree(out)) ^ set(old))} or contents")
        if problems:
            failures.append(f"[class 3] {case.label}: {'; '.join(problems)}: {ran.err.strip()!r}")
    assert tree(zoo.d) == before
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- class 5: untrusted documents, recipes and grids


def _write_json(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def docs(zoo: Zoo) -> dict[str, Path]:
    """Hostile diag.json / shard / recipe files derived from the real ones."""
    d = zoo.d / "docs"
    d.mkdir()
    full = json.loads(zoo.report.read_text())
    shard = json.loads(zoo.shard0.read_text())
    out: dict[str, Path] = {}
    out["deep"] = d / "deep.json"
    out["deep"].write_text('{"schema": "diag/compare", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    out["digits"] = d / "digits.json"
    out["digits"].write_text(json.dumps(full).replace('"samples": ', '"samples": ' + "9" * 5000 + ', "_": ', 1))
    bad_type = json.loads(json.dumps(full))
    bad_type["nodes"][0]["accumulated"]["sqnr_db"] = {"not": "a number"}
    out["type"] = _write_json(d / "type.json", bad_type)
    missing = {k: v for k, v in full.items() if k != "verdict"}
    out["missing"] = _write_json(d / "missing.json", missing)
    huge = json.loads(json.dumps(shard))
    huge["shard"]["count"] = 10**12
    out["huge_count"] = _write_json(d / "huge_count.json", huge)
    index = json.loads(json.dumps(shard))
    index["shard"]["index"] = 5
    out["index"] = _write_json(d / "index.json", index)
    samples = json.loads(json.dumps(shard))
    samples["shard"]["state"]["samples"] = "many"
    out["state_type"] = _write_json(d / "state_type.json", samples)
    deep_state = json.loads(json.dumps(shard))
    deep_state["shard"]["state"]["accumulated"]["h"]["s_ee"] = [[[[1]]]]
    out["state_value"] = _write_json(d / "state_value.json", deep_state)
    (d / "deep.toml").write_text("mode = " + "[" * 5000 + "]" * 5000 + "\n")
    (d / "digits.toml").write_text('mode = "dynamic"\ncalibration_samples = ' + "9" * 5000 + "\n")
    (d / "deep_options.json").write_text('{"mode": "dynamic", "extra_options": ' + '{"a": ' * 40 + "1" + "}" * 41)
    out.update({k: d / f"{k}" for k in ("deep.toml", "digits.toml", "deep_options.json")})
    return out


def _document_rows(z: Zoo, docs: dict[str, Path]) -> list[Row]:
    p, o = z.p, z.other
    merge = ["merge", "--out", "{tmp}/out"]
    return [
        Row(5, "check: deep nesting", ["check", docs["deep"], "--max-grade", "reject"], "bad-report", "nested deeper"),
        Row(5, "diff: deep nesting", ["diff", z.report, docs["deep"]], "bad-report", "nested deeper than 64 levels"),
        Row(
            5,
            "report: 5000-digit integer",
            ["report", docs["digits"], "--out", "{tmp}/out"],
            "bad-report",
            "has an integer too long to read",
        ),
        Row(
            5,
            "check: wrong type",
            ["check", docs["type"], "--min-sqnr", "10"],
            "bad-report",
            "field 'nodes[0].accumulated.sqnr_db' has {'not': 'a number'}, which is not a number",
        ),
        Row(
            5,
            "diff: missing key",
            ["diff", docs["missing"], z.report],
            "bad-report",
            "the document lacks the required key 'verdict'",
        ),
        Row(
            5,
            "report: missing key",
            ["report", docs["missing"], "--out", "{tmp}/out"],
            "bad-report",
            "lacks the required key 'verdict'",
        ),
        Row(
            5,
            "merge: a shard count of 10^12",
            [*merge, docs["huge_count"], z.shard1],
            "bad-report",
            "field 'shard.count' is 1,000,000,000,000, more than 100,000",
        ),
        Row(
            5,
            "merge: shard index >= count",
            [*merge, docs["index"], z.shard1],
            "bad-report",
            "field 'shard.index' is 5 but 'shard.count' is 2",
        ),
        Row(
            5,
            "merge: a state count of the wrong type",
            [*merge, docs["state_type"], z.shard1],
            "bad-report",
            "field 'shard.state.samples' is 'many', not a count",
        ),
        Row(
            5,
            "merge: a state value of the wrong type",
            [*merge, docs["state_value"], z.shard1],
            "bad-report",
            "has a missing or malformed field",
        ),
        Row(
            5,
            "merge: shards of model A, --fp32/--int8 of model B",
            [*merge, z.shard0, z.shard1, "--fp32", o.fp32, "--int8", o.int8],
            "model-mismatch",
            "is not the model the shards ran on",
        ),
        Row(5, "merge: shards of two models", [*merge, z.shard0, z.other_shard0], "bad-report", "merge shards of one"),
        Row(5, "lint: deeply nested TOML recipe", ["lint", docs["deep.toml"]], "bad-recipe", "nested deeper than 16"),
        Row(
            5,
            "quantize: 5000-digit integer in a TOML recipe",
            ["quantize", p.fp32, "--recipe", docs["digits.toml"], "-o", "{tmp}/q.onnx"],
            "bad-recipe",
            "is not valid TOML (Exceeds the limit (4300 digits)",
        ),
        Row(5, "lint: deeply nested extra_options", ["lint", docs["deep_options.json"]], "bad-recipe", "nested deeper"),
        Row(
            5,
            "sweep: 5000-digit integer in an inline grid",
            [
                "sweep",
                p.fp32,
                "--inputs",
                p.inputs,
                "--grid",
                '{"mode": "dynamic", "calibration_samples": ' + "9" * 5000 + "}",
                "--out",
                "{tmp}/out",
            ],
            "bad-recipe",
            "inline --grid | has an integer too long to read",
        ),
        Row(
            5,
            "quantize: deeply nested inline recipe",
            ["quantize", p.fp32, "--recipe", '{"mode": ' + "[" * 3000 + "]" * 3000 + "}", "-o", "{tmp}/q.onnx"],
            "bad-recipe",
            "inline --recipe | is nested deeper",
        ),
    ]


def test_untrusted_documents_and_recipes_are_refused_with_the_field_named(zoo, docs, tmp_path):
    run_rows(_document_rows(zoo, docs), zoo, tmp_path)


# ---------------------------------------------------------------- class 5: property-based, mutated documents

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.sampled_from([10**12, -1, 0, 2**63, "inf", "nan", ""])
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def _mutate(doc: object, data: st.DataObject, label: str) -> str:
    """JSON text of ``doc`` with a random path deleted, replaced, buried 5000 levels deep or made a
    4400-digit integer (the last two spliced in as text: Python's json cannot write them)."""
    doc = json.loads(json.dumps(doc))
    holder: object = None
    key: object = None
    node = doc
    for _ in range(data.draw(st.integers(0, 6), label=f"{label} depth")):
        if isinstance(node, dict) and node:
            k = data.draw(st.sampled_from(sorted(node)), label=f"{label} key")
        elif isinstance(node, list) and node:
            k = data.draw(st.integers(0, len(node) - 1), label=f"{label} index")
        else:
            break
        holder, key, node = node, k, node[k]  # type: ignore[index]
    op = data.draw(st.sampled_from(["replace", "delete", "bury", "giant"]), label=f"{label} op")
    splice = {"bury": "[" * 5000 + json.dumps(node) + "]" * 5000, "giant": "9" * 4400}.get(op)
    if holder is None:
        return json.dumps(data.draw(JSON_VALUES)) if op == "replace" else (splice or json.dumps(doc))
    if op == "delete" and isinstance(holder, dict):
        del holder[key]
    else:
        holder[key] = "__SPLICE__" if splice else data.draw(JSON_VALUES, label=f"{label} value")  # type: ignore[index]
    text = json.dumps(doc)
    return text.replace('"__SPLICE__"', splice, 1) if splice else text


@settings(
    max_examples=6,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # a failure prints its draws; shrinking forks for minutes
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_mutated_documents_never_reach_an_internal_error(zoo, tmp_path_factory, data):
    """check, diff, merge, report and lint on mutated diag.json / shard / recipe files: exit 0, 2 or 3
    (a gate or a lint finding), never 1, never over 1 GiB of address space beyond the start."""
    folder = tmp_path_factory.mktemp("mutated")
    full = json.loads(zoo.report.read_text())
    shard = json.loads(zoo.shard0.read_text())
    recipe = {"mode": "static", "quant_format": "QDQ", "per_channel": True, "extra_options": {"ActivationSymmetric": 1}}
    (folder / "doc.json").write_text(_mutate(full, data, "doc"))
    (folder / "shard.json").write_text(_mutate(shard, data, "shard"))
    (folder / "recipe.json").write_text(_mutate(recipe, data, "recipe"))
    runs = [
        (["check", folder / "doc.json", "--max-grade", "reject", "--min-cosine", "0.5"], (OK, USER_ERROR, 3)),
        (["diff", zoo.report, folder / "doc.json"], (OK, USER_ERROR)),
        (["report", folder / "doc.json", "--out", folder / "out"], (OK, USER_ERROR)),
        (["merge", folder / "shard.json", zoo.shard1, "--out", folder / "merged"], (OK, USER_ERROR)),
        (["lint", folder / "recipe.json", "--model", zoo.p.fp32], (OK, USER_ERROR, 3)),
    ]
    for args, allowed in runs:
        ran = run_diag(args, folder, limit_as=1 << 30)
        assert ran.code in allowed, f"{args[0]}: exit {ran.code}: {ran.err[-400:]}"
        assert "Traceback" not in ran.err and "internal error" not in ran.err, ran.err[-400:]


# ---------------------------------------------------------------- class 4: Ctrl-C after every file operation

_KEEP: list[object] = []
_POINT_OPS = ("replace", "rename", "link", "unlink", "mkdir", "rmdir", "fsync", "chmod")


def _interrupt_after_each_file_operation(
    out: Path, record: Path, before_writing: int = 4, while_writing: int = 1
) -> Callable[[], None]:
    """A hook for :func:`run_diag`: in the child, after each file operation inside ``out``, fork.

    The fork gets SIGINT at once and runs to its end (exit code and stderr recorded); the child
    records what the fork left in ``out``, puts ``out`` back as it was and carries on, so one run
    yields every interrupt point. Every ``while_writing``-th operation of the output writer is a
    point; before it, every ``before_writing``-th operation in ``out`` (sweep.jsonl appends,
    exclude's work folder) is one.
    """

    def install() -> None:
        import shutil
        import weakref

        import onnxruntime

        import diag.foundations.files

        sessions: weakref.WeakSet[object] = weakref.WeakSet()
        real_init = onnxruntime.InferenceSession.__init__

        def init(self: object, *a: object, **k: object) -> None:
            real_init(self, *a, **k)  # type: ignore[arg-type]
            sessions.add(self)

        onnxruntime.InferenceSession.__init__ = init  # type: ignore[method-assign]
        state = {"n": 0, "busy": False, "writing": False}
        real_write_set = diag.foundations.files.write_set

        def write_set(*a: object, **k: object) -> object:
            state["writing"] = True
            try:
                return real_write_set(*a, **k)  # type: ignore[arg-type]
            finally:
                state["writing"] = False

        diag.foundations.files.write_set = write_set  # type: ignore[assignment]
        for name, mod in list(sys.modules.items()):  # every diag module that imported it by name
            if name.startswith("diag.") and getattr(mod, "write_set", None) is real_write_set:
                mod.write_set = write_set  # type: ignore[attr-defined]

        def inside(a: object) -> bool:
            if isinstance(a, int):  # fsync(fd)
                try:
                    a = os.readlink(f"/proc/self/fd/{a}")
                except OSError:
                    return False
            return isinstance(a, (str, os.PathLike)) and os.path.abspath(a).startswith(str(out) + os.sep)

        def point() -> None:
            state["n"] += 1
            n = state["n"]
            if n % (while_writing if state["writing"] else before_writing):
                return
            state["busy"] = True
            try:
                saved = record / f"saved{n}"
                shutil.copytree(out, saved, symlinks=True)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the interrupted run
                    for fd, name in ((1, "out"), (2, "err")):
                        f = os.open(record / f"p{n}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                        os.dup2(f, fd)
                    state["busy"] = True  # no points of its own
                    # NOTE: an onnxruntime session freed in a forked child waits forever for its
                    # thread pool (the threads stayed in the parent); a real Ctrl-C does not fork.
                    _KEEP.extend(sessions)
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                _, status = os.waitpid(pid, 0)
                (record / f"p{n}.code").write_text(str(os.waitstatus_to_exitcode(status)))
                (record / f"p{n}.tree").write_text(json.dumps(tree(out)))
                shutil.rmtree(out)
                shutil.copytree(saved, out, symlinks=True)
                shutil.rmtree(saved)
            finally:
                if os.getpid() == state.get("pid"):
                    state["busy"] = False

        state["pid"] = os.getpid()

        def wrap(name: str) -> None:
            real = getattr(os, name)

            def op(*a: object, **k: object) -> object:
                result = real(*a, **k)
                if not state["busy"] and any(inside(x) for x in a[:2]):
                    point()
                return result

            setattr(os, name, op)

        for name in _POINT_OPS:
            wrap(name)

    return install


@dataclass(frozen=True)
class Interrupted:
    verb: str
    args: list[object]
    new: tuple[str, ...]  # the set a complete run writes
    before_writing: int = 4  # every how many file operations is an interrupt point, before the writer
    while_writing: int = 1  # ... and within it


_EXCLUDE = ["exclude", "--target", "cosine>=0.5", "--bench-runs", "0", "--quiet"]
_ONE_RECIPE = '{"mode": "dynamic", "weight_type": "QUInt8"}'


def _interrupted_runs(z: Zoo) -> list[Interrupted]:
    p, d = z.p, z.d
    report_set = ("diag.json", "report.html", "summary.md")
    return [
        Interrupted("compare", ["compare", p.fp32, p.int8, "--inputs", p.inputs, "--out", "{out}", *FAST], report_set),
        Interrupted(
            "exclude",
            [*_EXCLUDE, p.fp32, "--recipe", d / "recipe.json", "--inputs", p.inputs, "--out", "{out}"],
            ("exclusion.json", *report_set),
            before_writing=6,
        ),
        Interrupted(
            "sweep",
            ["sweep", p.fp32, "--inputs", p.inputs, "--grid", _ONE_RECIPE, "--runs", "0", "--out", "{out}", "--quiet"],
            ("sweep.json", "sweep.md", "sweep.html", "pareto.svg", "best.recipe.json"),
            before_writing=16,
            while_writing=2,
        ),
    ]


def _jsonl_is_whole(text: str | None) -> bool:
    try:
        return all(isinstance(json.loads(line), dict) for line in (text or "").splitlines())
    except ValueError:
        return False


def test_ctrl_c_after_any_file_operation_says_what_is_on_disk(zoo, tmp_path):
    failures = []
    for case in _interrupted_runs(zoo):
        out, record = tmp_path / case.verb, tmp_path / f"{case.verb}.points"
        out.mkdir()
        record.mkdir()
        for name in case.new:
            (out / name).write_text(OLD)
        old = tree(out)
        args = [str(a).replace("{out}", str(out)) for a in case.args]
        hook = _interrupt_after_each_file_operation(out, record, case.before_writing, case.while_writing)
        ran = run_diag(args, tmp_path, before=hook)
        assert ran.code == OK, ran.err
        points = sorted(int(p.stem[1:]) for p in record.glob("p*.code"))
        if len(points) < 10:
            failures.append(f"{case.verb}: only {len(points)} interrupt points")
        for n in points:
            code = int((record / f"p{n}.code").read_text())
            err = (record / f"p{n}.err").read_text()
            disk: dict[str, str] = json.loads((record / f"p{n}.tree").read_text())
            jsonl = (out / "sweep.jsonl").read_text() if "sweep.jsonl" in disk else None
            lines = err.strip().splitlines()
            problems = []
            if code != INTERRUPTED or len(lines) != 1 or not lines[0].startswith("diag: interrupted; "):
                problems.append(f"exit {code}, stderr {err.strip()!r}")
            elif "no output was written" in lines[0]:
                if {k: v for k, v in disk.items() if k != "sweep.jsonl"} != old or not _jsonl_is_whole(jsonl):
                    problems.append(f"says nothing was written but --out holds {sorted(disk)} (old: {sorted(old)})")
            elif "the new outputs are complete (" in lines[0]:
                listed = {Path(x).name for x in lines[0].split("complete (", 1)[1].rstrip(")").split(", ")}
                bad = [k for k in listed if k not in disk or disk[k] == old.get(k)]
                bad += [k for k in old if k not in listed and k in disk]  # an earlier run's file next to new ones
                if bad:
                    problems.append(f"says the outputs are complete but {sorted(bad)} are old, missing or stale")
            elif "finished recipes are in" in lines[0]:
                rest = {k: v for k, v in disk.items() if k != "sweep.jsonl"}
                if rest != old or not jsonl or not _jsonl_is_whole(jsonl):
                    problems.append("says finished recipes are in sweep.jsonl, but they are not (or more changed)")
            else:
                problems.append(f"unknown message {lines[0]!r}")
            if any(k.startswith(".diag-") for k in disk):
                problems.append(f"work folder left: {[k for k in disk if k.startswith('.diag-')][:2]}")
            if problems:
                failures.append(f"{case.verb} point {n}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------- class 6: inputs that are bombs


def _npy_bytes(shape: tuple[int, ...], data: bytes, dtype: str = "<f4") -> bytes:
    """A .npy file whose header declares ``shape`` whatever ``data`` holds (crafted, as an attacker would)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + data


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def bombs(zoo: Zoo) -> dict[str, Path]:
    import zipfile

    d = zoo.d / "bombs"
    d.mkdir()
    x = _x().tobytes()  # 6 rows of 8 float32
    out = {
        "longer": _zip(d / "longer.npz", {"x.npy": _npy_bytes((4, 8), x)}),
        "shorter": _zip(d / "shorter.npz", {"x.npy": _npy_bytes((6, 8), x[: len(x) // 2])}),
        "huge_claim": _zip(d / "huge_claim.npz", {"x.npy": _npy_bytes((10**12, 8), x)}),
    }
    (d / "longer.npy").write_bytes(_npy_bytes((4, 8), x))
    out["longer.npy"] = d / "longer.npy"
    folder = d / "feeds"
    folder.mkdir()
    _zip(folder / "000.npz", {"x.npy": _npy_bytes((1, 8), x[:64])})
    out["folder"] = folder
    # 2^23 rows x 8 float32 = 256 MiB of zeros, ~0.3 MB on disk: written as a stream, never in memory.
    rows = 1 << 23
    with (
        zipfile.ZipFile(d / "bomb.npz", "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf,
        zf.open("x.npy", "w", force_zip64=True) as fh,
    ):
        fh.write(_npy_bytes((rows, 8), b""))
        fh.write(_x(4).tobytes())  # four real samples first, then zeros
        zero = bytes(1 << 22)
        left = rows * 32 - 4 * 32
        while left:
            fh.write(zero[: min(left, len(zero))])
            left -= min(left, len(zero))
    out["bomb"] = d / "bomb.npz"
    return out


def _bomb_rows(z: Zoo, b: dict[str, Path]) -> list[Row]:
    p = z.p

    def cmp(inputs: Path, *flags: object) -> list[object]:
        return ["compare", p.fp32, p.int8, "--inputs", inputs, *flags, "--out", "{tmp}/out", *FAST]

    return [
        Row(
            6,
            "member larger than its declared shape",
            cmp(b["longer"]),
            "bad-inputs",
            "holds 192 bytes but its header declares float32[4, 8] (128 bytes)",
        ),
        Row(6, "member shorter than its declared shape", cmp(b["shorter"]), "bad-inputs", "holds 96 bytes but"),
        Row(6, "a member claiming 10^12 rows", cmp(b["huge_claim"]), "bad-inputs", "float32[1000000000000, 8]"),
        Row(6, ".npy larger than its declared shape", cmp(b["longer.npy"]), "bad-inputs", "holds 192 bytes but"),
        Row(6, "a feed file larger than declared", cmp(b["folder"]), "bad-inputs", "holds 64 bytes but"),
        Row(
            6,
            "calibration member larger than declared",
            ["quantize", p.fp32, "--recipe", '{"mode": "static"}', "-o", "{tmp}/q.onnx", "--calib", b["longer"]],
            "bad-inputs",
            "holds 192 bytes but",
        ),
    ]


def test_inputs_that_lie_about_their_size_are_refused(zoo, bombs, tmp_path):
    run_rows(_bomb_rows(zoo, bombs), zoo, tmp_path)


def test_a_256_mib_npz_bomb_is_read_one_batch_at_a_time(zoo, bombs, tmp_path):
    """256 MiB of declared samples (0.3 MB on disk), --samples 4: memory follows the batch, not the file
    (measured: the run's peak RSS grows by ~36 MiB, a 512 MiB member alike; reading it whole would add 256)."""
    p = zoo.p
    args = ["compare", p.fp32, p.int8, "--inputs", bombs["bomb"], "--samples", "4", "--out", tmp_path / "o", *FAST]
    ran = run_diag(args, tmp_path, limit_as=1 << 30)
    assert ran.code == OK, ran.err
    assert "4 samples" in ran.out
    assert ran.peak_rss < 100 << 20, f"peak RSS grew by {ran.peak_rss >> 20} MiB reading a 256 MiB member"


# ---------------------------------------------------------------- classes 7-9: resume files, generated text, flags


def test_a_torn_sweep_jsonl_is_skipped_and_the_sweep_resumes(zoo, tmp_path):
    """The last line cut mid-UTF-8 character, mid-JSON, or binary garbage: skipped, never exit 1."""
    p = zoo.p
    args = ["sweep", p.fp32, "--inputs", p.inputs, "--grid", _ONE_RECIPE, "--runs", "0", "--quiet"]
    first = tmp_path / "first"
    ran = run_diag([*args, "--out", first], tmp_path)
    assert ran.code == OK, ran.err
    whole = (first / "sweep.jsonl").read_bytes()
    assert whole.count(b"\n") == 1
    torn = {
        "cut mid-UTF-8": whole + '{"é'.encode()[:-1],
        "cut mid-JSON": whole + whole[: len(whole) // 2],
        "binary garbage and deep nesting": whole + b"\xff\xfe\x00" + b"[" * 10_000 + b"\n",
    }
    failures = []
    for label, data in torn.items():
        out = tmp_path / label.replace(" ", "_")
        out.mkdir()
        (out / "sweep.jsonl").write_bytes(data)
        ran = run_diag([*args, "--out", out], tmp_path)
        if ran.code != OK or "1 resumed from sweep.jsonl" not in ran.out or ran.err.strip():
            failures.append(f"{label}: exit {ran.code}: {ran.err.strip()[-300:]} {ran.out[-300:]}")
    assert not failures, "\n".join(failures)


def test_names_from_files_cannot_inject_lines_into_generated_files(zoo, tmp_path):
    import shutil

    import tomllib

    evil = tmp_path / 'evil\nmode = "static"\n[extra_options]\nx = 1\n.onnx'
    shutil.copy(zoo.p.int8, evil)
    ran = run_diag(["inspect", evil, "--recipe-out", tmp_path / "r.toml"], tmp_path)
    assert ran.code == OK, ran.err
    recipe = tomllib.loads((tmp_path / "r.toml").read_text())
    assert recipe["mode"] == "dynamic" and "extra_options" not in recipe
    ran = run_diag(["inspect", evil, "--recipe"], tmp_path)
    assert ran.code == OK and tomllib.loads(ran.out)["mode"] == "dynamic"
    ran = run_diag(["compare", zoo.p.fp32, evil, "--inputs", zoo.p.inputs, "--out", tmp_path / "o", *FAST], tmp_path)
    assert ran.code == OK, ran.err
    summary = (tmp_path / "o" / "summary.md").read_text()
    assert "\nmode = " not in summary and "\n[extra\\_options]" not in summary and "\n[extra_options]" not in summary
    assert json.loads((tmp_path / "o" / "diag.json").read_text())["models"]["int8"]["path"] == str(evil)


@pytest.mark.parametrize("where", ["before the verb", "after the verb", "both"])
def test_debug_shows_the_traceback_wherever_it_is_given(zoo, tmp_path, where):
    args: list[object] = ["inspect", zoo.d / "nope.onnx"]
    flagged = {
        "before the verb": ["--debug", *args],
        "after the verb": [*args, "--debug"],
        "both": ["--debug", *args, "--debug"],
    }[where]
    ran = run_diag(flagged, tmp_path)
    # --debug re-raises: python -m diag would print the traceback; the forked child reports the crash.
    assert "CHILD CRASH DiagError" in ran.err and ran.code == 1, ran.err
    plain = run_diag(args, tmp_path)
    assert plain.code == USER_ERROR and plain.err.startswith("diag: error[missing-file]")


# ---------------------------------------------------------------- class 10: IR and opset edges


def test_a_model_quantized_from_ir3_is_accepted_by_every_other_verb(zoo, tmp_path):
    """IR 3 (initializers listed as graph inputs, opset 8): the quantizer writes opset 11+ and scale
    initializers that are not inputs, which IR 3 forbids; diag raises the IR so its own output loads
    everywhere without an onnx.checker finding."""
    from onnx import helper

    m = mlp()
    m.ir_version = 3
    m.opset_import[0].version = 8
    for t in m.graph.initializer:
        m.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.checker.check_model(m)
    fp = tmp_path / "ir3.onnx"
    onnx.save(m, str(fp))
    failures = []
    for fmt, recipe in (
        ("dynamic", '{"mode": "dynamic", "weight_type": "QUInt8"}'),
        ("qdq", '{"mode": "static", "quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QUInt8"}'),
        ("qoperator", '{"mode": "static", "quant_format": "QOperator", "activation_type": "QUInt8"}'),
    ):
        q = tmp_path / f"ir3.{fmt}.onnx"
        calib = [] if fmt == "dynamic" else ["--calib", zoo.p.inputs]
        steps = [
            ["quantize", fp, "--recipe", recipe, "-o", q, *calib],
            ["inspect", q],
            ["inspect", q, "--recipe"],
            ["compare", fp, q, "--inputs", zoo.p.inputs, "--out", tmp_path / f"o_{fmt}", *FAST],
        ]
        for args in steps:
            ran = run_diag(args, tmp_path)
            if ran.code != OK or "onnx.checker rejects" in ran.out or "problem:" in ran.out:
                failures.append(f"{fmt} {args[0]}: exit {ran.code}: {(ran.err or ran.out).strip()[-300:]}")
    assert not failures, "\n".join(failures)


def test_a_work_folder_left_by_a_killed_run_is_removed_by_the_next_run(zoo, tmp_path):
    """kill -9 leaves .diag-<kind>-<pid>-*; the next run into the same --out removes it (its pid is gone)."""
    import subprocess

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    out = tmp_path / "out"
    (out / f".diag-stage-{pid}-x1y2").mkdir(parents=True)
    (out / f".diag-stage-{pid}-x1y2" / "diag.json").write_text("half")
    (out / f".diag-sweep-{os.getpid()}-live").mkdir()  # a live process's folder stays
    ran = run_diag(["report", zoo.report, "--out", out], tmp_path)
    assert ran.code == OK, ran.err
    assert sorted(p.name for p in out.iterdir()) == [f".diag-sweep-{os.getpid()}-live", "report.html", "summary.md"]
