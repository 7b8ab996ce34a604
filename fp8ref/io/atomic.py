"""Atomic writes: everything fp8ref writes appears complete or not at all.

A file or folder is built under a temporary name beside its destination and renamed into place,
so an interrupted run never leaves a half-written checkpoint or golden file behind:

- SIGTERM and SIGHUP (``kill``, ``timeout``, Slurm, docker, a closed terminal) raise ``SystemExit``
  inside the write, so the temporary is removed as for Ctrl-C (only where the signal still has
  its default action, and only in the main thread, where Python can handle signals);
- a temporary's name says who made it (``.NAME.fp8ref-HOST-PID.XXXX.partial``): one left by a
  process that no longer runs (SIGKILL, a power cut) is removed by the next write beside it,
  with a warning;
- one run at a time writes a folder (``outputs.folder_lock``), and the final rename never replaces
  an output that appeared meanwhile: ``renameat2(RENAME_NOREPLACE)`` where the kernel has it, a
  check just before ``os.rename`` elsewhere;
- what may be written where (inputs, devices, FIFOs, folders fp8ref did not write) is
  ``outputs``' rule, checked here too;
- the output gets the permissions the umask gives (``mkdtemp``/``mkstemp`` make 0700/0600).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import __version__
from ..errors import CheckpointError, Fp8RefWarning, OutputError
from .outputs import (
    STREAM,
    folder_lock,
    output_kind,
    refuse_overlaps,
    resolved,
    why_not_replaceable,
    write_error,
    write_marker,
)

HANDLED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # short: names stay under 255 bytes
_OWNED = re.compile(r"\.fp8ref-([0-9a-f]{8})-(\d+)\.[^.]+\.(partial|tmp)$")


def is_inside(child: Path, root: Path) -> bool:
    try:
        child.relative_to(root)
        return True
    except ValueError:
        return False


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C (clean-up runs), exits 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _raise_exit(signum, frame):
    raise Terminated(signum)


@contextmanager
def terminating_signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM/SIGHUP raise SystemExit(128 + signal) instead of killing the
    process outright, so ``except``/``finally`` clean-up runs. Signals someone else handles or
    ignores (``nohup``) are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed = {}
    for sig in HANDLED_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            installed[sig] = signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, old in installed.items():
            signal.signal(sig, old)


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGTERM/SIGHUP while cleaning up or renaming (delivered afterwards)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(dest: Path) -> list[Path]:
    """Remove the temporaries beside ``dest`` that an fp8ref process on this host left when it was
    killed (its pid no longer runs; the file is ours), warning about each. Returns them."""
    removed = []
    prefix = f".{dest.name}.fp8ref-"
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return removed
    for entry in entries:
        m = _OWNED.search(entry.name)
        if not entry.name.startswith(prefix) or m is None or m.group(1) != _HOST or _alive(int(m.group(2))):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
        warnings.warn(f"{entry.path}: removed the partial output of an earlier run (process {m.group(2)}) "
                      "that was killed before it finished", Fp8RefWarning, stacklevel=3)
    return removed


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.fp8ref-{_HOST}-{os.getpid()}."


def _load_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def rename_noreplace(src: Path, dest: Path) -> None:
    """Rename ``src`` to ``dest``; FileExistsError if ``dest`` exists, atomically where the kernel
    and file system support RENAME_NOREPLACE, else by a check just before the rename."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dest), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(src), None, str(dest))
    if os.path.lexists(dest):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dest))
    os.rename(src, dest)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _named(exc: OSError, tmp: Path, dest: Path) -> OSError:
    """A write error inside the temporary ``tmp`` as an ``OutputError`` naming the output ``dest``
    (a file of a folder by its final name); an error naming another file (a source read) as is."""
    for name in (exc.filename2, exc.filename):
        if name is not None and is_inside(Path(name), tmp):
            return write_error(dest / Path(name).relative_to(tmp) if Path(name) != tmp else dest, exc)
    if exc.filename is None and not isinstance(exc, OutputError):
        return write_error(dest, exc)
    return exc


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync it and rename it over ``path``,
    on failure delete it. A symlink is resolved first (the link stays, its target is replaced);
    a FIFO, a device or a folder is refused (``io.files.write_bytes`` writes into the first two)."""
    given = Path(path)
    if output_kind(given) == STREAM:
        raise OutputError(f"{given}: a FIFO or a device, and this output is written whole to a regular file "
                          "and renamed into place; give a file path")
    path = resolved(given) if given.is_symlink() else given
    remove_stale(path)
    with terminating_signals_raise():
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
        except OSError as exc:
            raise write_error(given, exc) from None
        os.close(fd)
        try:
            try:
                yield Path(tmp)
                os.chmod(tmp, 0o666 & ~_umask())
                _fsync(Path(tmp))
            except OSError as exc:
                named = _named(exc, Path(tmp), given)
                if named is exc:
                    raise
                raise named from None
            with _signals_blocked():
                os.replace(tmp, path)
        except BaseException:
            with _signals_blocked():
                Path(tmp).unlink(missing_ok=True)
            raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_output_folder(dest: str | os.PathLike, *, force: bool = False, protect: Iterable[str | os.PathLike] = (),
                        error: type = CheckpointError) -> bool:
    """Refuse, before any work, an output folder fp8ref may not write: one that is, holds or lies
    inside a protected path (the command's inputs) or holds the current folder; an existing file
    or link; an existing folder with files unless ``force``, and with ``force`` one fp8ref did not
    write (``outputs.why_not_replaceable``). Returns whether an existing folder will be replaced."""
    refuse_overlaps(inputs=[("the source", p) for p in protect], folders=[("the output", dest)], error=error)
    given = Path(dest)
    if not os.path.lexists(given):
        return False
    if given.is_symlink() or not given.is_dir():
        if not force:
            raise error(f"{given}: already exists; pass force=True (CLI: --force) to replace it")
        raise error(f"{given}: exists and is not a folder; refusing to replace it")
    with os.scandir(given) as entries:
        if next(entries, None) is None:
            return True  # an empty folder: nothing to lose
    if not force:
        raise error(f"{given}: already exists and is not empty; choose a new folder or pass force=True "
                    "(CLI: --force) to replace an output folder fp8ref wrote")
    reason = why_not_replaceable(given)
    if reason is not None:
        raise error(f"{given}: not replaced: {reason}; --force replaces only an output folder fp8ref wrote "
                    "(remove it yourself or choose a new folder)")
    return True


@contextmanager
def atomic_folder(dest: str | os.PathLike, *, force: bool = False, protect: Iterable[str | os.PathLike] = (),
                  error: type = CheckpointError) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; on success it replaces ``dest``.

    ``check_output_folder`` first (an existing empty folder is replaced; one with files only with
    ``force`` and only when fp8ref wrote it), under ``folder_lock`` (a second run writing ``dest``
    meanwhile gets an error). On success the folder gets ``outputs.MARKER``, listing its files. On
    any failure, interrupts and SIGTERM/SIGHUP included, the temporary folder is removed and
    ``dest`` is left as it was.
    """
    given = Path(dest)
    dest = Path(os.path.abspath(dest))  # '.' has no name to put a temporary beside
    protect = list(protect)
    check_output_folder(given, force=force, protect=protect, error=error)
    if not dest.parent.is_dir():
        raise error(f"{given}: parent folder {given.parent} does not exist or is not a folder")
    with folder_lock(dest, error, shown=given):
        replace = check_output_folder(given, force=force, protect=protect, error=error)  # now under the lock
        remove_stale(dest)
        with terminating_signals_raise():
            try:
                tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_temp_prefix(dest), suffix=".partial"))
            except OSError as exc:
                raise error(f"{given}: cannot write an output folder there: {exc.strerror or exc}") from None
            try:
                try:
                    yield tmp
                    write_marker(tmp, __version__)
                    os.chmod(tmp, 0o777 & ~_umask())
                except OSError as exc:
                    named = _named(exc, tmp, given)
                    if named is exc:
                        raise
                    raise named from None
                with _signals_blocked():
                    _install(tmp, dest, replace, error)
            except BaseException:
                with _signals_blocked():
                    shutil.rmtree(tmp, ignore_errors=True)
                raise


def _install(tmp: Path, dest: Path, replace: bool, error: type) -> None:
    """Rename the finished ``tmp`` to ``dest`` (with ``replace``, replacing the folder there, if
    it is still one fp8ref may replace)."""
    old = None
    if replace and dest.is_dir() and not dest.is_symlink():
        reason = why_not_replaceable(dest)
        if reason is not None:
            raise error(f"{dest}: changed while this output was being written ({reason}); nothing was replaced")
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_temp_prefix(dest), suffix=".partial"))
        os.replace(dest, old / "x")
    try:
        rename_noreplace(tmp, dest)
    except BaseException as exc:
        if old is not None and not os.path.lexists(dest):
            os.replace(old / "x", dest)  # put the folder we moved aside back
        if isinstance(exc, FileExistsError):
            raise error(f"{dest}: appeared while this output was being written (another run?); "
                        "nothing was replaced, pass force=True (CLI: --force) to replace it") from None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
