"""The file-system edge: checked paths in, all-or-nothing output sets out.

Every path a verb reads goes through :func:`input_file` (or :func:`input_path` for a file-or-folder
argument); every file a verb writes goes through :func:`write_set`. Nothing else in diag opens a user's
path for writing, so the guarantees below hold for every verb:

- A path that does not exist, names a folder, a FIFO, a device or a socket, cannot be read, or is
  longer than the operating system allows is a one-line ``DiagError``, decided by ``os.stat`` before
  anything opens it (opening a FIFO would block forever).
- Every file read is remembered for the rest of the command; an output that resolves to one of them
  (same path, a symlink to it, a hard link) is ``bad-out`` and the input stays untouched.
- An output set is staged in a hidden work folder next to its targets, then moved in with every
  signal blocked; if any target is in the way (a folder named like an output file, a read-only
  folder, a full disk) nothing is replaced and the error names the file that blocked it.
- Work folders are named ``.diag-<kind>-<pid>-*``: a run removes its own on the way out, and the next
  run into the same ``--out`` removes those left by a process that no longer exists (``kill -9``).

NOTE: this module imports nothing from diag but :mod:`diag.foundations.errors`, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from diag.foundations.errors import DiagError

#: What one command has read and written so far (reset by the CLI before each command).
_READ: dict[tuple[int, int], Path] = {}


@dataclass
class _Written:
    """What :func:`write_set` committed in this command (the interrupt message depends on it)."""

    sets: list[list[Path]] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)
    internal: int = 0
    #: Files written outside a set, one finished piece at a time, that a rerun resumes from (and the
    #: sentence that says so): :func:`resume_file`.
    resumable: list[tuple[Path, str]] = field(default_factory=list)


_WRITTEN = _Written()

Content = str | bytes | Path


def reset() -> None:
    """Forget the inputs and outputs of the previous command (the CLI calls this first)."""
    _READ.clear()
    _WRITTEN.sets.clear()
    _WRITTEN.created.clear()
    _WRITTEN.resumable.clear()


def written_sets() -> list[list[Path]]:
    """The output sets committed by this command, each a list of target paths."""
    return list(_WRITTEN.sets)


def remove_created_empty_folders() -> None:
    """Remove ``--out`` folders this command created and left empty (after an error or Ctrl-C)."""
    for folder in reversed(_WRITTEN.created):
        with contextlib.suppress(OSError):
            folder.rmdir()
    _WRITTEN.created.clear()


def resume_file(path: str | os.PathLike[str], what: str) -> None:
    """Note a file this command appends to piece by piece (``sweep.jsonl``), outside any output set.

    After Ctrl-C with no set written, :func:`interrupt_state` says that ``what`` is in it and that
    the same command resumes from it, when the file holds anything.
    """
    _WRITTEN.resumable.append((Path(path), what))


def interrupt_state() -> str:
    """What is on disk after Ctrl-C, in the words ``diag: interrupted; ...`` ends with.

    Output sets are written whole (:func:`write_set`) or not at all, so the answer is the sets this
    command committed, else a resume file (:func:`resume_file`) that holds something, else nothing.
    Removes the ``--out`` folders this command created and left empty.

    Example:
        >>> reset(); interrupt_state()
        'no output was written'
    """
    written = written_sets()
    remove_created_empty_folders()
    if written:
        return f"the new outputs are complete ({', '.join(str(p) for s in written for p in s)})"
    for path, what in _WRITTEN.resumable:
        with contextlib.suppress(OSError):
            if path.is_file() and path.stat().st_size > 0:
                return f"{what} are in {path}: run the same command again to resume"
    return "no output was written"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so work folders are removed on the way out.

    The CLI runs every verb inside it; in a thread other than the main one it does nothing (Python
    delivers signals to the main thread only).
    """
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stat(p: Path, obj: str, *, missing_slug: str = "missing-file") -> os.stat_result | None:
    """``os.stat`` that turns every OS refusal into a slugged error; None when the path is absent."""
    try:
        return os.stat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise DiagError(missing_slug, obj, "has a name longer than this system allows", "use a shorter path") from e
        if e.errno == errno.ENOTDIR:
            return None
        if e.errno == errno.ELOOP:
            raise DiagError(missing_slug, obj, "is a symlink loop", "point it at a real file") from e
        if e.errno == errno.EACCES:
            raise DiagError("unreadable", obj, "cannot be reached (permission denied)", "check permissions") from e
        raise DiagError(missing_slug, obj, f"cannot be examined ({e.strerror or e})", "check the path") from e


def _existing(p: Path, obj: str) -> os.stat_result:
    """``os.stat`` of an input that must exist (``missing-file`` when it does not)."""
    st = _stat(p, obj)
    if st is None:
        raise DiagError("missing-file", obj, "does not exist", "check the path")
    return st


def _remember(p: Path, st: os.stat_result) -> None:
    if any(part.startswith(".diag-") for part in p.parts):
        return  # diag's own work files (a quantized candidate) are not the user's inputs
    _READ[(st.st_dev, st.st_ino)] = p


def input_file(
    path: str | os.PathLike[str], role: str, hint: str = "pass a regular file", *, allow_empty: bool = True
) -> Path:
    """Check that ``path`` names a readable regular file and remember it as an input of this command.

    Never opens the file: a FIFO named as input would block ``open`` forever, so the type is decided
    from ``os.stat`` alone.

    Example:
        >>> input_file("/dev/null", "inputs", "pass a .npz")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        diag.foundations.errors.DiagError: inputs '/dev/null' | is not a regular file (a character device). Hint: pass a
        .npz
    """
    p = Path(path)
    obj = f"{role} '{p}'"
    st = _existing(p, obj)
    if stat.S_ISDIR(st.st_mode):
        raise DiagError("not-a-file", obj, "is a directory", hint)
    if not stat.S_ISREG(st.st_mode):
        raise DiagError("not-a-file", obj, f"is not a regular file ({_kind(st.st_mode)})", hint)
    if not os.access(p, os.R_OK):
        raise DiagError("unreadable", obj, "cannot be read (permission denied)", "check permissions")
    if not allow_empty and st.st_size == 0:
        raise DiagError("empty-file", obj, "is empty (0 bytes)", "re-export or re-copy the file")
    _remember(p, st)
    return p


def input_path(path: str | os.PathLike[str], role: str, hint: str = "pass a regular file or a folder") -> Path:
    """As :func:`input_file`, but a folder is accepted too (``--inputs DIR``); its files are checked when listed."""
    p = Path(path)
    obj = f"{role} '{p}'"
    st = _existing(p, obj)
    if stat.S_ISDIR(st.st_mode):
        if not os.access(p, os.R_OK | os.X_OK):
            raise DiagError("unreadable", obj, "cannot be listed (permission denied)", "check permissions")
        return p
    return input_file(p, role, hint)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def remember_input(path: str | os.PathLike[str]) -> None:
    """Remember a file read without :func:`input_file` (external data next to a model) as an input."""
    p = Path(path)
    with contextlib.suppress(OSError):
        _remember(p, os.stat(p))


def is_input(path: Path) -> Path | None:
    """The input of this command that ``path`` resolves to (same file, symlink or hard link), if any."""
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and (st.st_dev, st.st_ino) in _READ:
        source = _READ[(st.st_dev, st.st_ino)]
        with contextlib.suppress(OSError):
            again = os.stat(source)
            if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):  # not a deleted file's reused inode
                return source
    return None


def check_outputs(
    folder: str | os.PathLike[str], names: Iterable[str], inputs: Iterable[object] = (), role: str = "output"
) -> None:
    """Before any work: none of a verb's outputs in ``folder`` may be one of ``inputs`` or be in the way.

    ``inputs`` are the paths the user gave (models, inputs, recipes; None skipped); they are
    remembered as inputs of this command without being read. The same checks run again when the
    set is written (:func:`write_set`), against every file read by then.

    Example:
        >>> check_outputs("out", ["diag.json"], inputs=["out/diag.json"])  # doctest: +SKIP
        Traceback (most recent call last):
        ...
        diag.foundations.errors.DiagError: output 'out/diag.json' | is an input of this command (diag.json). Hint: ...
    """
    for item in inputs:
        if isinstance(item, (str, os.PathLike)) and str(item):
            with contextlib.suppress(OSError):
                q = Path(item)
                found = os.stat(q)
                if stat.S_ISREG(found.st_mode):
                    _remember(q, found)
    base = Path(folder)
    obj = f"{role} '{base}'"
    st = _stat(base, obj, missing_slug="bad-out")
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise DiagError("bad-out", f"--out '{base}'", "cannot be created (it is a file)", "choose a folder path")
    _check_writable(base, obj)
    for name in names:
        t = base / name
        _check_target(t, _stat(t, f"{role} '{t}'", missing_slug="bad-out"), f"{role} '{t}'")


def _check_writable(folder: Path, obj: str) -> None:
    """An existing output folder this process cannot write into is ``bad-out`` now, before any work
    (sweep and exclude create their work folder in it first; a PermissionError there was an internal error)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DiagError("bad-out", obj, "cannot be written (permission denied)", "choose a writable folder")


def output_file(path: str | os.PathLike[str], role: str) -> Path:
    """Check an output path before any work starts: not an input, not a folder, a name the OS accepts.

    The folder must exist (a single-file output such as ``-o`` or ``--json`` never creates folders).

    Example:
        >>> output_file("/no-dir/x.json", "--json")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        diag.foundations.errors.DiagError: --json '/no-dir/x.json' | is in a folder that does not exist. Hint: create it
        first
    """
    p = Path(path)
    obj = f"{role} '{p}'"
    st = _stat(p, obj, missing_slug="bad-out")
    parent = p.parent if str(p.parent) else Path(".")
    pst = _stat(parent, obj, missing_slug="bad-out")
    if pst is None or not stat.S_ISDIR(pst.st_mode):
        raise DiagError("bad-out", obj, "is in a folder that does not exist", "create it first")
    _check_target(p, st, obj)
    return p


def _check_target(p: Path, st: os.stat_result | None, obj: str) -> None:
    source = is_input(p)
    if source is not None:
        raise DiagError(
            "bad-out", obj, f"is an input of this command ({source.name})", "write the output to another path"
        )
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise DiagError("bad-out", obj, "is in the way: a folder has this name", "move the folder or choose another")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise DiagError("bad-out", obj, f"is in the way: {_kind(st.st_mode)}", "choose another output path")


def out_dir(path: str | os.PathLike[str], role: str = "--out") -> Path:
    """Create the ``--out`` folder if missing (remembered, so a failed command can remove it again).

    Also removes work folders left in it by a diag process that no longer exists.
    """
    out = Path(path)
    obj = f"{role} '{out}'"
    st = _stat(out, obj, missing_slug="bad-out")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise DiagError("bad-out", obj, "cannot be created (it is a file)", "choose a folder path")
    source = is_input(out)
    if source is not None:
        raise DiagError("bad-out", obj, f"is an input of this command ({source.name})", "choose another folder")
    if st is None:
        missing = []
        for q in [out, *out.parents]:
            if q.exists():
                break
            missing.append(q)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DiagError("bad-out", obj, f"cannot be created ({e.strerror or e})", "choose a writable folder") from e
        _WRITTEN.created.extend(reversed(missing))
    else:
        _check_writable(out, obj)
    sweep_stale_work(out)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def sweep_stale_work(folder: Path) -> None:
    """Remove ``.diag-<kind>-<pid>-*`` work folders whose process is gone (a run killed with -9)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        parts = entry.name.split("-")
        if not entry.name.startswith(".diag-") or len(parts) < 4 or not parts[2].isdigit():
            continue
        if int(parts[2]) != os.getpid() and not _pid_alive(int(parts[2])):
            shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def work_dir(folder: str | os.PathLike[str], kind: str) -> Iterator[Path]:
    """A hidden work folder ``.diag-<kind>-<pid>-*`` in ``folder``, removed on the way out, even on Ctrl-C.

    It sits next to the outputs so that publishing a file from it is a rename on the same file system.
    """
    path: Path | None = None
    try:
        with signals_held():  # a Ctrl-C between mkdtemp and the assignment would leave the folder behind
            path = make_work_dir(folder, kind)
        yield path
    finally:
        if path is not None:
            remove_tree(path)


def make_work_dir(folder: str | os.PathLike[str], kind: str) -> Path:
    """Create ``.diag-<kind>-<pid>-*`` in ``folder``; an OS refusal is ``bad-out``.

    The caller removes it (:func:`remove_tree`); :func:`work_dir` does so itself. NOTE: call it inside
    :func:`signals_held` *and assign the result there*: a Ctrl-C held here would otherwise be raised
    when the block ends, after the folder exists and before the caller knows its name.
    """
    try:
        return Path(tempfile.mkdtemp(prefix=f".diag-{kind}-{os.getpid()}-", dir=folder))
    except OSError as e:
        raise DiagError(
            "bad-out", f"--out '{folder}'", f"cannot be written ({e.strerror or e})", "choose a writable folder"
        ) from e


@contextlib.contextmanager
def internal_writes() -> Iterator[None]:
    """Files written inside are a verb's intermediate results (candidate models), not its outputs:
    the interrupt message does not list them."""
    _WRITTEN.internal += 1
    try:
        yield
    finally:
        _WRITTEN.internal -= 1


def remove_tree(path: Path) -> None:
    """Remove a work folder with signals held, so that a Ctrl-C cannot leave half of it behind."""
    with signals_held():
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while the output set is replaced; they are delivered right after.

    NOTE: blocking the signals in this thread is not enough. A signal sent to the process goes to
    any thread that does not block it (onnxruntime's pools, the reduction pool, Dask's), and Python
    then raises KeyboardInterrupt in the main thread at its next instruction: in the middle of the
    set (issue 45: exclusion.json replaced, reproduce.py not). So Python's own handlers are swapped
    for one that only records the signal, and what was recorded is raised again once the set is whole.
    """
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum: int, frame: object) -> None:
        pending.append(signum)

    handlers = {s: signal.signal(s, record) for s in held}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(held))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a signal blocked until now is recorded here
        for s, h in handlers.items():
            signal.signal(s, h)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def _write_staged(target: Path, content: Content, stage: Path) -> Path:
    staged = stage / target.name
    if isinstance(content, Path):
        os.replace(content, staged)  # a file the verb produced in its work folder (same file system)
        return staged
    data = content.encode("utf-8") if isinstance(content, str) else content
    with open(staged, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o666 & ~umask)
    return staged


def write_set(
    files: Mapping[Path, Content], what: str = "output", remove: Iterable[Path] = (), folder: Path | None = None
) -> dict[str, Path]:
    """Write a verb's whole output set so that either every file is replaced or none is.

    ``files`` maps each target to its text, bytes, or a file already written in a work folder on the
    same file system (moved, not copied). ``remove`` lists stale files of an earlier run that must
    not survive next to the new set (a mixed model when this run found none). All targets must sit
    in one folder.

    Every file is first written and synced in a hidden stage folder; only then, with signals held,
    is each old file kept aside and the new one renamed over it; a rename that fails puts every old
    file back. A Ctrl-C arrives after the whole set is in place or before any of it is.

    Example:
        >>> write_set({Path("out/a.json"): "{}\\n", Path("out/b.md"): "# b\\n"})  # doctest: +SKIP
        {'a.json': PosixPath('out/a.json'), 'b.md': PosixPath('out/b.md')}
    """
    targets = [Path(p) for p in files]
    removals = [Path(p) for p in remove if Path(p) not in files]
    if not targets and not removals:
        return {}
    where = folder or (targets or removals)[0].parent
    if any(t.parent != where for t in [*targets, *removals]):
        raise ValueError("write_set: every target must be in one folder")
    for t in targets:
        _check_target(t, _stat(t, f"{what} '{t}'", missing_slug="bad-out"), f"{what} '{t}'")
    for r in removals:
        _check_target(r, _stat(r, f"{what} '{r}'", missing_slug="bad-out"), f"{what} '{r}'")
    if not os.access(where, os.W_OK | os.X_OK):
        raise DiagError(
            "bad-out",
            f"{what} '{targets[0] if targets else where}'",
            "cannot be written (permission denied)",
            "choose a writable folder",
        )
    current: Path = targets[0] if targets else where
    try:
        with work_dir(where, "stage") as stage:
            staged: list[tuple[Path, Path]] = []
            for target, content in files.items():
                current = Path(target)
                staged.append((_write_staged(current, content, stage), current))
            # a verb's own work folder or intermediate results are not outputs
            record = not _WRITTEN.internal and not any(part.startswith(".diag-") for part in where.parts)
            _commit(staged, removals, stage, targets if record else None)
    except DiagError:
        raise
    except OSError as e:
        raise DiagError(
            "bad-out",
            f"{what} '{current}'",
            f"cannot be written ({e.strerror or e}); no output was replaced",
            "check free space and permissions of the output folder",
        ) from e
    return {t.name: t for t in targets}


def _commit(staged: list[tuple[Path, Path]], removals: list[Path], stage: Path, record: list[Path] | None) -> None:
    """Rename every staged file over its target; on any failure restore every old file.

    ``record``: the targets to remember as written, noted before the held signals are let through,
    so that a Ctrl-C arriving during the commit reports the outputs as complete.
    """
    backup = stage / ".old"
    backup.mkdir()
    done: list[tuple[Path, Path | None]] = []  # (target, its old file in the backup folder or None)
    target = stage
    with signals_held():
        try:
            for target in removals:
                if os.path.lexists(target):
                    aside = backup / target.name
                    os.replace(target, aside)
                    done.append((target, aside))
            for new, target in staged:
                kept: Path | None = None
                if os.path.lexists(target):
                    kept = backup / target.name
                    try:
                        os.link(target, kept)  # the old file stays in place until the new one replaces it
                    except OSError:  # no hard links here (or a symlink): keep a copy instead
                        shutil.copy2(target, kept, follow_symlinks=False)
                os.replace(new, target)
                done.append((target, kept))
            if record is not None:
                _WRITTEN.sets.append(record)
        except BaseException as e:
            for put_back, kept in reversed(done):
                with contextlib.suppress(OSError):
                    if kept is not None:
                        os.replace(kept, put_back)
                    else:
                        os.unlink(put_back)
            if isinstance(e, OSError):  # name the file whose replacement failed, not the last one staged
                raise DiagError(
                    "bad-out",
                    f"output '{target}'",
                    f"cannot be replaced ({e.strerror or e}); every old file was put back",
                    "check the output folder (a folder or another file in the way, permissions)",
                ) from e
            raise
