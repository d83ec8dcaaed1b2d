"""Input arrays read one batch at a time: ``.npz`` members and ``.npy`` files, never whole.

``np.load(path)["x"]`` decompresses a whole member into memory: a 40 KB ``.npz`` of zeros can
declare 4 GB, and a file with a million samples is read whole even for ``--samples 8``. Here a
member is opened as a stream and only the rows a batch asks for are read (skipping forward reads and
discards in fixed-size chunks), so peak memory follows the batch, never the file.

Every member's header is checked against the zip directory before any row is read: a member
holding more bytes than its declared shape and dtype allow (or fewer) is ``bad-inputs``; pickled
object arrays are refused without being read.
"""

from __future__ import annotations

import os
import threading
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from diag.foundations.errors import DiagError

#: Bytes read at a time when skipping rows of a stream.
_CHUNK = 1 << 20


class LazyRows:
    """Rows of one stored array, read on demand along the first axis (``a[i]``, ``a[i:j]``).

    A ``.npy`` file or an uncompressed ``.npz`` member is read with ``pread`` at the rows' offset;
    a compressed member is decompressed forward from one open stream (asking for an earlier row
    reopens it). Never holds more than the rows of one request; never memory-maps (mapped pages
    would count in the process's resident memory as the run goes through the file).
    """

    def __init__(
        self,
        path: Path,
        member: str | None,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        offset: int,
        file_offset: int | None = None,
    ) -> None:
        self.path = path
        self.member = member or path.name
        self.shape = shape
        self.dtype = dtype
        self.ndim = len(shape)
        self._offset = offset  # bytes of .npy header before the data, inside the stream
        self._file_offset = file_offset  # where the data starts in the file, when it is stored as is
        self._row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        self._zip: zipfile.ZipFile | None = None
        self._stream: IO[bytes] | None = None
        self._pos = 0  # next row the stream will deliver
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def _open(self) -> None:
        self.close()
        self._zip = zipfile.ZipFile(self.path)
        self._stream = self._zip.open(self.member)
        self._pos = 0
        self._skip(self._offset)

    def _skip(self, n: int) -> None:
        assert self._stream is not None
        while n > 0:
            got = len(self._stream.read(min(n, _CHUNK)))
            if got == 0:
                raise self._short(self._pos)
            n -= got

    def _short(self, row: int) -> DiagError:
        return DiagError(
            "bad-inputs",
            f"inputs '{self.path}' array '{self.member}'",
            f"ends before row {row} its header declares",
            "write it again with np.savez",
        )

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start`` to ``stop`` (exclusive) as a new array (thread-safe: one reader at a time)."""
        want = (stop - start) * self._row_bytes
        with self._lock:
            if self._file_offset is not None:
                with open(self.path, "rb") as fh:
                    data = os.pread(fh.fileno(), want, self._file_offset + start * self._row_bytes)
            else:
                if self._stream is None or start < self._pos:
                    self._open()
                self._skip((start - self._pos) * self._row_bytes)
                assert self._stream is not None
                data = self._stream.read(want)
                self._pos = stop
        if len(data) != want:
            raise self._short(stop - 1)
        return np.frombuffer(data, self.dtype).reshape((stop - start, *self.shape[1:])).copy()

    def __getitem__(self, key: int | slice) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("LazyRows supports contiguous slices only")
            return self.rows(start, max(start, stop))
        row: np.ndarray = self.rows(key, key + 1)[0]
        return row

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._zip is not None:
            self._zip.close()
        self._stream = self._zip = None

    def __del__(self) -> None:
        self.close()


def _stored_data_start(path: Path, info: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed member's bytes start in the file (after its local header), else None."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        local = fh.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        return None
    name_len = int.from_bytes(local[26:28], "little")
    extra_len = int.from_bytes(local[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def _header(fh: IO[bytes], where: str) -> tuple[tuple[int, ...], np.dtype[Any], bool, int]:
    """Shape, dtype, Fortran order and header length of a ``.npy`` stream (pickles refused)."""
    try:
        fmt = np.lib.format
        version = fmt.read_magic(fh)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(fh, max_header_size=10_000)
    except Exception as e:  # numpy raises ValueError, OSError, SyntaxError... for a bad header
        raise DiagError("bad-inputs", where, f"is not a plain .npy array ({type(e).__name__})", "use np.savez") from e
    if dtype.hasobject:
        raise DiagError(
            "bad-inputs",
            where,
            "contains pickled Python objects",
            "save plain numeric arrays (np.savez); pickles are never loaded",
        )
    return tuple(int(d) for d in shape), dtype, bool(fortran), fh.tell()


def _declared_bytes(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def lazy_npz(path: Path) -> dict[str, Any]:
    """The arrays of an ``.npz``, each a :class:`LazyRows` (or a small array read at once).

    Example:
        >>> arrays = lazy_npz(Path("inputs.npz"))  # doctest: +SKIP
        >>> arrays["x"].shape, arrays["x"][0:2].shape  # doctest: +SKIP
        ((100000, 3, 224, 224), (2, 3, 224, 224))
    """
    where = f"inputs '{path}'"
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise DiagError(
            "bad-inputs", where, f"is not a readable .npz ({type(e).__name__})", "write it with np.savez"
        ) from e
    arrays: dict[str, Any] = {}
    with zf:
        for info in zf.infolist():
            name = info.filename.removesuffix(".npy")
            obj = f"{where} array '{name}'"
            with zf.open(info) as fh:
                shape, dtype, fortran, offset = _header(fh, obj)
            declared = _declared_bytes(shape, dtype)
            if info.file_size - offset != declared:
                raise DiagError(
                    "bad-inputs",
                    obj,
                    f"holds {info.file_size - offset:,} bytes but its header declares {dtype}{list(shape)} "
                    f"({declared:,} bytes)",
                    "write the file again with np.savez; it is corrupt or crafted",
                )
            if fortran or not shape or declared <= _CHUNK:
                with zf.open(info) as fh:
                    fh.read(offset)
                    data = fh.read(declared)
                arr = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C").copy()
                arrays[name] = arr
            else:
                start = _stored_data_start(path, info)
                arrays[name] = LazyRows(
                    path, info.filename, shape, dtype, offset, None if start is None else start + offset
                )
    return arrays


def lazy_npy(path: Path) -> Any:
    """A ``.npy``: small ones read at once, larger ones as :class:`LazyRows` (rows read per batch); size checked."""
    where = f"inputs '{path}'"
    with open(path, "rb") as fh:
        shape, dtype, fortran, offset = _header(fh, where)
    size = path.stat().st_size
    declared = _declared_bytes(shape, dtype)
    if size - offset != declared:
        raise DiagError(
            "bad-inputs",
            where,
            f"holds {size - offset:,} bytes but its header declares {dtype}{list(shape)} ({declared:,} bytes)",
            "write the file again with np.save; it is corrupt or crafted",
        )
    if fortran or not shape or declared <= _CHUNK:
        return np.load(path, allow_pickle=False)
    return LazyRows(path, None, shape, dtype, offset, offset)
