"""Atomic outputs: a reader never sees a half-written file or directory, and a crash leaves the old one intact.

Every command writes through these helpers (nothing else calls ``os.replace``):

    atomic_write_text(path, text)          # also atomic_write_bytes, atomic_write_json, atomic_write_figure
    with atomic_path(path) as tmp:         # for writers that want a path: torch.save, safetensors, savefig
        save_file(tensors, tmp)
    with atomic_dir(out, force=args.force) as tmp:   # a whole output directory, swapped in by one rename
        ...write files under tmp...

The data is fsynced before the rename, the rename is fsynced in its directory, a temporary name starts
with ``.`` beside its target (same file system), and it is removed when the block fails. Files get the
usual permissions (``0666 & ~umask``), not ``mkstemp``'s 0600.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.job.errors import InputError, UserError

__all__ = ["DiskFullError", "DISK_FULL", "disk_full", "disk_full_cause", "tree_size", "read_utf8_text",
           "read_json_object", "atomic_path", "atomic_write_bytes", "atomic_write_text", "atomic_write_json",
           "atomic_dir", "check_output_dir", "check_output_file", "refuse_overlap", "OutputError", "fsync_tree",
           "crash_point", "refuse_links_out", "IN_PLACE_FILES", "open_append"]


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFullError(UserError, OSError):
    """An output that did not fit: no space left, a quota, or the process's file-size limit."""
    exit_code = 1
    every_rank = True  # the rank whose write failed may not be rank 0

    def __init__(self, message: str, cause: OSError | None = None):
        super().__init__(message)
        self.cause = cause  # the OS's error (an outer output names itself with it)


def disk_full_cause(error: BaseException | None) -> OSError | None:
    """The OS error of a write that did not fit, else None: the error itself, an inner output's
    ``DiskFullError``'s, or one in its chain (torch.save to a Python file raises a RuntimeError whose context is
    the file's OSError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        cause = error.cause if isinstance(error, DiskFullError) else error
        if isinstance(cause, OSError) and cause.errno in DISK_FULL:
            return cause
        error = error.__cause__ or error.__context__
    return None


def disk_full(error: OSError, target: Path, what: str, needed: int | None = None) -> DiskFullError:
    """The one line of a write that did not fit: the path, what filled, the bytes needed and free."""
    reason = ("a file reached the process's file-size limit (ulimit -f)" if error.errno == errno.EFBIG
              else "no space left on the device" if error.errno == errno.ENOSPC else "the disk quota is exceeded")
    free = shutil.disk_usage(target.parent if not target.exists() else target).free
    need = f"it needs about {needed} bytes, {free} are free there" if needed else f"{free} bytes are free there"
    return DiskFullError(f"{target}: {reason} while writing {what} ({need}); nothing that was there before is "
                         f"changed and the partial files are removed; free space or choose another path, then run "
                         f"the same command again", error)


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


class OutputError(UserError, FileExistsError):
    """An output that would replace or delete something the command did not write (an input, a user's file)."""

    def __init__(self, message: str):
        super().__init__(message)  # one argument: the handler prints the message, not an OS error format


def contents_digest(path: str | os.PathLike) -> str | None:
    """"sha256:<hex>" of a file's bytes (what a resumed run must read again), None for anything else (a folder,
    a dataset name)."""
    path = Path(path)
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def read_utf8_text(path: str | os.PathLike, what: str = "text file") -> str:
    """A whole UTF-8 file; a missing file or one that is not UTF-8 is refused naming ``what`` and the path."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path} is not UTF-8 (byte {e.start}): {e.reason}") from None


def read_json_object(path: str | os.PathLike, what: str = "JSON file") -> dict:
    """A UTF-8 file holding one JSON object; anything else (not JSON, not UTF-8, a list) is refused naming
    ``what``, the path and, for JSON, the line and column."""
    path = Path(path)
    text = read_utf8_text(path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg}); give a JSON "
                         f"object") from None
    if not isinstance(value, dict):
        raise InputError(f"{what} {path}: holds a JSON {type(value).__name__}, not an object {{...}}; give a JSON "
                         f"object")
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (data first, then the rename that publishes it)."""
    for path in sorted(Path(root).rglob("*"), reverse=True):
        if path.is_file() or path.is_dir():
            _fsync(path)
    _fsync(Path(root))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it replaces ``path`` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if disk_full_cause(e):
            raise disk_full(disk_full_cause(e), path, "it") from None
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_figure(path: str | os.PathLike, fig, dpi: int = 100) -> Path:
    """A matplotlib ``Figure`` (made without pyplot) in the format its suffix names, PNG without one."""
    # matplotlib only when a chart is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", dpi=dpi)
    return atomic_write_bytes(path, buf.getvalue())


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, **dump_kwargs) -> Path:
    """``obj`` as indented JSON plus a final newline."""
    return atomic_write_text(path, json.dumps(obj, **{"indent": 2, **dump_kwargs}) + "\n")


def check_output_dir(out: str | os.PathLike, force: bool = False) -> Path:
    """Refuse an output path that is a file, or a non-empty directory unless ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output path {out} exists and is not a directory; choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputError(f"output directory {out} is not empty; choose another one or pass --force to replace it")
    return out


def check_output_file(path: str | os.PathLike, force: bool = False, flag: str = "--out") -> Path:
    """Refuse an existing output file unless ``force``, and a directory always."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a directory; give a file path")
    if path.exists() and not force:
        raise OutputError(f"{flag} {path} exists; pass --force to replace it or choose another path")
    return path


def refuse_overlap(out: str | os.PathLike, inputs, flag: str = "--out") -> None:
    """An output equal to an input, a directory holding one, or an existing file or directory inside an input
    directory is refused outright (even with --force: it replaces an earlier output, never a file of an input).
    A new name inside an input directory is allowed. ``inputs``: (flag, path or None) pairs."""
    target = Path(out).resolve()
    named = Path(out).absolute().parent.resolve() / Path(out).name  # the name itself, a final link not followed
    for input_flag, path in inputs:
        if path is None:
            continue
        source = Path(path).resolve()
        if source == target or target in source.parents:
            what = "is" if source == target else "holds"
            raise OutputError(f"{flag} {out} {what} the input {input_flag} {path}; writing there would replace "
                              f"it; choose another {flag}")
        if source.is_dir() and os.path.lexists(named) and (source in named.parents or source in target.parents):
            raise OutputError(f"{flag} {out} is a file of the input {input_flag} {path}; --force replaces an "
                              f"earlier output, never a file of an input; choose a new name or a path outside {path}")


# files a run directory writes in place (appended, truncated, copied over): through a link they would change
# the link's target
IN_PLACE_FILES = (".run.lock", "metrics.jsonl", "samples.jsonl", "zero_to_fp32.py", "zero_to_torch.py")


def open_append(path: str | os.PathLike):
    """A log opened for appending (text) that is not reached through a link: a symbolic link there raises
    ELOOP rather than appending to its target."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666), "a")


def refuse_links_out(root: str | os.PathLike, flag: str = "--save") -> None:
    """A directory a job writes into never writes through a link to outside itself: a symbolic link under
    ``root`` whose target is outside it, or a file it writes in place that has other hard links, is refused
    (nothing is removed: the link may be the user's)."""
    root = Path(root)
    if not root.is_dir():
        return
    inside = root.resolve()
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if path.is_symlink() and inside not in path.resolve().parents:
                raise OutputError(f"{flag} {root}: {path} is a link to {os.readlink(path)}, outside the run "
                                  f"directory, which a run never writes through; remove the link (or put a copy "
                                  f"of the file in its place), then run the same command again")
    for name in IN_PLACE_FILES:
        path = root / name
        if path.is_file() and not path.is_symlink() and path.stat().st_nlink > 1:
            raise OutputError(f"{flag} {root}: {path} has {path.stat().st_nlink} hard links; the run writes it in "
                              f"place, which would change the other names too; replace it by a copy (cp {path} "
                              f"{path}.copy && mv {path}.copy {path}), then run the same command again")


def _foreign_entries(out: Path, new: Path) -> list[str]:
    """Entries of an existing ``out`` that the new output does not have: not written by this command."""
    return sorted(set(os.listdir(out)) - set(os.listdir(new))) if out.is_dir() else []


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success it becomes ``out`` in one rename.

    A failure (or a kill) part-way leaves ``out`` as it was. A non-empty ``out`` is refused unless ``force``;
    ``force`` replaces only an earlier output of the same kind: an ``out`` holding files the new output
    does not have (someone else's) is refused, and nothing is deleted.
    """
    out = check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        foreign = _foreign_entries(out, tmp)
        if foreign:
            raise OutputError(f"output directory {out} holds {', '.join(foreign[:5])}"
                              f"{' ...' if len(foreign) > 5 else ''}, which this command did not write; --force "
                              f"replaces only an earlier output of the same command; choose a new or empty "
                              f"directory")
        os.chmod(tmp, 0o777 & ~_umask())
        fsync_tree(tmp)
        crash_point(f"written:{out.name}")
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            crash_point(f"moved-aside:{out.name}")
        os.replace(tmp, out)
        _fsync(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        written = tree_size(tmp) if tmp.is_dir() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full_cause(e):
            raise disk_full(disk_full_cause(e), out, f"the output directory (after {written} bytes)") from None
        raise


def crash_point(where: str) -> None:
    """Fault injection for the kill -9 tests: ``PIPELINE_CRASH_AT=<where>`` kills this process here (SIGKILL: no
    handler, no clean-up runs), e.g. ``written:<name>`` (an output directory complete under its temporary name)."""
    if os.environ.get("PIPELINE_CRASH_AT") == where:
        os.kill(os.getpid(), signal.SIGKILL)
