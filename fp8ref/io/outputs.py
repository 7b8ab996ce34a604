"""The output rule every fp8ref command follows (docs/architecture.md, "Outputs"):

- a regular file, or a new path, is written atomically (``atomic.atomic_file``: a temporary
  beside it, fsync, rename); a symlink is resolved first, so the link stays and its target is
  written;
- a character device or a FIFO is written *into*, never replaced (``/dev/null``, ``>(jq .)``,
  a named pipe a reader waits on); a folder, a block device or a socket is refused;
- before any work, an output that is one of the command's inputs, lies inside one (resolved,
  links followed) or, for an output folder, holds one or the current folder, is refused;
- an output folder is replaced (``--force``) only when fp8ref wrote it: every folder it writes
  holds ``MARKER``, listing the files it wrote; a folder without it, or holding anything else, is
  refused with the reason;
- one run at a time writes an output folder (``folder_lock``): a second gets a clear error;
- every write error, a full disk included, names the output file (``OutputError``).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import Fp8RefError, OutputError

MARKER = ".fp8ref-output.json"
MARKER_FORMAT = "fp8ref-output/1"
FIFO_WAIT_S = 60.0  # how long a FIFO output waits for a reader before the run fails
STREAM = "stream"  # a character device or a FIFO: written into
REGULAR = "regular"  # an existing regular file: replaced atomically
NEW = "new"  # nothing there yet


def node_kind(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a regular file" if stat.S_ISREG(mode) else "a special file")


def output_kind(path: str | os.PathLike, error: type[Fp8RefError] = OutputError) -> str:
    """How the output file ``path`` is written: ``NEW`` or ``REGULAR`` (atomically), ``STREAM``
    (into it); a folder, a block device or a socket is refused. Links are followed (``/dev/stdout``
    is the file or pipe it names)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return NEW
    except (OSError, ValueError) as exc:
        raise error(f"{path}: cannot write the output there: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISREG(mode):
        return REGULAR
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        return STREAM
    raise error(f"{path}: {node_kind(mode)}; an output file must be a regular file, a FIFO, a character "
                "device or a new path")


def resolved(path: str | os.PathLike) -> Path:
    """``path`` absolute, every link followed (those that resolve), ``..`` applied after."""
    return Path(os.path.realpath(os.path.abspath(path)))


def _inside(child: Path, root: Path) -> bool:
    return child == root or root in child.parents


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def refuse_overlaps(*, inputs: Iterable[tuple[str, str | os.PathLike]] = (),
                    files: Iterable[tuple[str, str | os.PathLike]] = (),
                    folders: Iterable[tuple[str, str | os.PathLike]] = (),
                    into: Iterable[tuple[str, str | os.PathLike]] = (),
                    error: type[Fp8RefError] = OutputError) -> None:
    """Before any work: refuse an output file or folder that is an input or lies inside one, an
    output folder that holds an input or the current folder, an output file inside an output
    folder, and two outputs that are one. Each item is ``(what, path)``: ``what`` names the
    option in the message (``--json``, ``OUT``). ``into``: folders whose files are written one by
    one (never replaced whole): refused only when they are or lie inside an input."""
    ins = [(what, Path(p), resolved(p)) for what, p in inputs if os.path.lexists(p)]
    outs_folders = [(what, Path(p), resolved(p)) for what, p in folders]
    outs_files = [(what, Path(p), resolved(p)) for what, p in files]
    outs_into = [(what, Path(p), resolved(p)) for what, p in into]
    cwd = resolved(os.getcwd())
    for what, given, real in outs_folders:
        if _inside(cwd, real):
            raise error(f"{given}: {what} is {'the' if real == cwd else 'a folder holding the'} current folder; "
                        "fp8ref writes an output folder beside it and replaces it: choose a new folder")
    for what, given, real in outs_files + outs_folders + outs_into:
        is_folder = (what, given, real) in outs_folders
        for iwhat, igiven, ireal in ins:
            if _inside(real, ireal) or _same_file(given, igiven) or (is_folder and _inside(ireal, real)):
                how = ("is" if real == ireal or _same_file(given, igiven) else
                       "lies inside" if _inside(real, ireal) else "holds")
                raise error(f"{given}: {what} {how} the input {igiven} ({iwhat}); refusing to write over an input")
    for i, (what, given, real) in enumerate(outs_files):
        for fwhat, fgiven, freal in outs_folders:
            if _inside(real, freal):
                raise error(f"{given}: {what} lies inside the output folder {fgiven} ({fwhat}), which fp8ref "
                            "writes whole; choose a path outside it")
        for owhat, ogiven, oreal in outs_files[i + 1:]:
            if real == oreal or _same_file(given, ogiven):
                raise error(f"{given}: {what} and {owhat} name the same file; give each its own")
    for _what, given, _ in outs_files:
        output_kind(given, error)


# --- the marker: which folders fp8ref wrote --------------------------------------------------
def _files_under(folder: Path) -> list[str]:
    """Every non-folder entry under ``folder`` (links not followed), as relative POSIX paths."""
    out = []
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            out.append(Path(root, name).relative_to(folder).as_posix())
    return sorted(out)


def write_marker(folder: Path, version: str) -> None:
    """Record in ``folder`` (being written) that fp8ref wrote it and which files it holds."""
    files = [n for n in _files_under(folder) if n != MARKER]
    doc = {"format": MARKER_FORMAT, "fp8ref_version": version, "files": files}
    with open(folder / MARKER, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


def why_not_replaceable(folder: Path) -> str | None:
    """None when ``--force`` may replace ``folder``: it is empty, or fp8ref wrote it and it holds
    nothing else. Else the reason, for the refusal."""
    with os.scandir(folder) as entries:
        if next(entries, None) is None:
            return None
    if not os.path.isfile(folder / MARKER) or os.path.islink(folder / MARKER):
        return f"it is not empty and has no {MARKER}, so fp8ref did not write it"
    try:
        with open(folder / MARKER, "rb") as f:
            doc = json.loads(f.read(1 << 24))
        listed = set(doc["files"]) if doc.get("format") == MARKER_FORMAT else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        listed = None
    if listed is None:
        return f"its {MARKER} is not one fp8ref wrote"
    foreign = [n for n in _files_under(folder) if n != MARKER and n not in listed]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return f"it holds files fp8ref did not write there: {shown}"
    return None


# --- one writer per output folder ------------------------------------------------------------
def lock_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.fp8ref-lock"


@contextmanager
def folder_lock(dest: Path, error: type[Fp8RefError] = OutputError, *, shown: Path | None = None) -> Iterator[None]:
    """Hold ``.DEST.fp8ref-lock`` beside ``dest`` (an exclusive ``flock``, released by the kernel
    if the process dies) while ``dest`` is written; another run gets a one-line error naming
    ``shown`` (default ``dest``). The file is removed on release; a lock on a file someone removed
    meanwhile is taken again."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the final no-replace rename still refuses a second writer
        yield
        return
    path = lock_path(dest)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise error(f"{shown or dest}: cannot write an output folder there (creating its lock {path.name}: "
                        f"{exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise error(f"{shown or dest}: another fp8ref run is writing this output now (it holds {path.name}); "
                            "wait for it or choose another output") from None
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed it between our open and our lock: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)


# --- writing into a FIFO or a device ---------------------------------------------------------
def write_error(path: str | os.PathLike, exc: OSError) -> OutputError:
    return OutputError(f"{path}: cannot write: {exc.strerror or exc}")


def _open_stream(path: Path, wait_s: float) -> int:
    """A FIFO or device opened for writing. A FIFO opens only once a reader has it open: wait for
    one at most ``wait_s`` seconds (a run must not hang on a pipe nobody reads)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno == errno.ENXIO and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            if exc.errno == errno.ENXIO:
                raise OutputError(f"{path}: a FIFO that no process opened for reading within {wait_s:g} s; "
                                  "nothing was written") from None
            raise write_error(path, exc) from None
        os.set_blocking(fd, True)
        return fd


def write_into(path: str | os.PathLike, data: bytes, *, wait_s: float | None = None) -> None:
    """Write ``data`` into the FIFO or character device ``path`` (never replacing it)."""
    path = Path(path)
    fd = _open_stream(path, FIFO_WAIT_S if wait_s is None else wait_s)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError as exc:  # ENOSPC (/dev/full), EPIPE (the reader left)
        raise write_error(path, exc) from None
    finally:
        os.close(fd)
