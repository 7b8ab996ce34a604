"""Atomic writes: everything fp8ref writes appears complete or not at all.

A file or folder is built under a temporary name beside its destination and renamed into place,
so an interrupted run never leaves a half-written checkpoint or golden file behind:

- SIGTERM and SIGHUP (``kill``, ``timeout``, Slurm, docker, a closed terminal) raise ``SystemExit``
  inside the write, so the temporary is removed as for Ctrl-C (only where the signal still has
  its default action, and only in the main thread, where Python can handle signals);
- a temporary's name says who made it (``.NAME.fp8ref-HOST-PID.XXXX.partial``): one left by a
  process that no longer runs (SIGKILL, a power cut) is removed by the next write beside it,
  with a warning;
- the final rename never replaces an output that appeared meanwhile (another run writing the
  same folder without ``force``): ``renameat2(RENAME_NOREPLACE)`` where the kernel has it, a
  check just before ``os.rename`` elsewhere;
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

from ..errors import CheckpointError, Fp8RefWarning

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


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


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


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success, delete it on failure."""
    remove_stale(path)
    with terminating_signals_raise():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
        os.close(fd)
        try:
            yield Path(tmp)
            os.chmod(tmp, 0o666 & ~_umask())
            with _signals_blocked():
                os.replace(tmp, path)
        except BaseException:
            with _signals_blocked():
                Path(tmp).unlink(missing_ok=True)
            raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _refuse_existing(dest: Path, force: bool, error: type) -> None:
    if dest.exists() or dest.is_symlink():
        if not force:
            raise error(f"{dest}: already exists; pass force=True (CLI: --force) to replace it")
        if not dest.is_dir() or dest.is_symlink():
            raise error(f"{dest}: exists and is not a folder; refusing to replace it")


@contextmanager
def atomic_folder(dest: str | os.PathLike, *, force: bool = False, protect: Iterable[str | os.PathLike] = (),
                  error: type = CheckpointError) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; on success it replaces ``dest``.

    Refuses an existing ``dest`` unless ``force`` (also when it appears while the folder is being
    written), and any ``dest`` that is, contains or lies inside a protected path (the source
    checkpoint). On any failure, interrupts and SIGTERM/SIGHUP included, the temporary folder is
    removed and ``dest`` is left as it was.
    """
    dest = Path(dest)
    real = dest.resolve()
    for p in protect:
        src = Path(p).resolve()
        if real == src or is_inside(real, src) or is_inside(src, real):
            raise error(f"{dest}: output must not be, contain or lie inside the source {p}")
    _refuse_existing(dest, force, error)
    if not dest.parent.is_dir():
        raise error(f"{dest}: parent folder {dest.parent} does not exist")
    remove_stale(dest)
    with terminating_signals_raise():
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_temp_prefix(dest), suffix=".partial"))
        try:
            yield tmp
            os.chmod(tmp, 0o777 & ~_umask())
            with _signals_blocked():
                _install(tmp, dest, force, error)
        except BaseException:
            with _signals_blocked():
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def _install(tmp: Path, dest: Path, force: bool, error: type) -> None:
    """Rename the finished ``tmp`` to ``dest`` (with ``force``, replacing the folder there)."""
    old = None
    if force and dest.is_dir() and not dest.is_symlink():
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
