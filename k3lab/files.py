"""Files without torch: atomic writes, a lock for read-merge-write updates, and the checks of an output
path that run before any work.

The result records, `k3lab bench --json` and the report's pages and assets all write through
`write_atomic`, so an interrupted write never destroys the previous file. Writers that read a file,
merge into it and write it back (the result records) hold `locked(folder)` around the three steps, so two
processes saving at once both keep their records. (The report's notebook workers import no torch; this
module keeps it that way.)"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here (see `locked`)
    fcntl = None

REPO = Path(__file__).resolve().parent.parent
LOCK_NAME = ".k3lab.lock"  # the lock file `locked` falls back to where a folder itself cannot be locked


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import: os.umask can only be read by setting it


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, flush it to disk, then rename it over `path`: an
    interrupted write leaves the previous file whole (UTF-8). The file gets the previous file's permissions,
    or those of a file newly made under the umask (not the temp file's owner-only ones)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_UMASK
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(folder):
    """Hold an exclusive advisory lock on `folder` (made if missing) for the block: other processes that
    take the same lock wait until it is released (by the block's end, or by this process's death).

    The folder itself is locked (flock on its descriptor), so no lock file is left among the records;
    where a filesystem refuses that (some network mounts), a hidden LOCK_NAME file in the folder is locked
    instead. On a platform without fcntl (Windows) the block runs unlocked, with a warning that
    concurrent writers there may lose records."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        warnings.warn(f"no file locks on this platform: concurrent writers into {folder} may lose records",
                      RuntimeWarning, stacklevel=3)
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666 & ~_UMASK)
            fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _existing_dir(path: Path) -> Path:
    """`path` when it is a folder, else its nearest existing ancestor folder."""
    base = path
    while not base.is_dir():
        base = base.parent
    return base


def tracked_files(path) -> list[str] | None:
    """The files git tracks at or under `path` (a file or a folder, existing or not), as git names them
    relative to the nearest existing folder; None when git cannot answer (no git on PATH, a tree with no
    .git such as a copy on a GPU machine, an unsafe directory) and, for a path inside k3lab's tree, when
    that tree is not a checkout of its own (a copy of it inside another repository, whose git would
    call every file of the copy untracked)."""
    path = Path(path).absolute()
    base = _existing_dir(path if path.is_dir() else path.parent)
    spec = os.path.relpath(path, base)
    if _inside(path.resolve(), REPO) and not repo_is_checkout():
        return None
    try:
        out = subprocess.run(["git", "--literal-pathspecs", "ls-files", "-z", "--", spec], cwd=base,
                             capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return [n for n in out.stdout.split("\0") if n] if out.returncode == 0 else None


_CHECKOUT: dict[Path, bool] = {}


def repo_is_checkout() -> bool:
    """Whether k3lab's tree is the top of a git checkout (False for a `git archive` copy, with or without
    another repository around it). Kept once git has answered; not kept while git cannot be run."""
    if REPO not in _CHECKOUT:
        try:
            out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO, capture_output=True,
                                 text=True, check=False, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return False
        _CHECKOUT[REPO] = out.returncode == 0 and Path(out.stdout.strip()).resolve() == REPO
    return _CHECKOUT[REPO]


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def _writable_place(path: Path, flag: str) -> None:
    """ValueError naming `flag` when nothing can be made at `path`: an ancestor is a file, or the nearest
    existing folder cannot be written."""
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    base = _existing_dir(path.parent if not path.is_dir() else path)
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {base} cannot be written here")


def check_output_dir(path, flag: str = "--out", *, tracked_ok: bool = False) -> Path:
    """The folder a run writes into, checked before the run starts; ValueError naming `flag` when:
    it is a file; it cannot be made or written; it is k3lab's repository (or holds it); or it holds files
    git tracks (a run writes pages and notebooks by fixed names, and would overwrite committed ones). Where
    git cannot answer, a folder inside the repository is accepted only under build/ (ignored output).
    tracked_ok=True (a records root, whose committed files the saver itself protects) checks only that
    the folder can be written. Returns the folder as an absolute path."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: is a file, expected a folder")
    _writable_place(path, flag)
    if tracked_ok:
        return path
    real = path.resolve()
    if _inside(REPO, real):
        raise ValueError(f"{flag} {path}: holds k3lab's repository, whose tracked files a run would "
                         f"overwrite; write into {REPO / 'build'} or a folder outside the repository")
    tracked = tracked_files(real)
    if tracked:
        raise ValueError(f"{flag} {path}: holds {len(tracked)} file(s) git tracks (such as {tracked[0]}), "
                         f"which a run could overwrite; choose an empty folder or one git ignores, such as "
                         f"build/")
    if tracked is None and _inside(real, REPO) and not _inside(real, REPO / "build"):
        raise ValueError(f"{flag} {path}: inside the repository, and git cannot tell here which files are "
                         f"committed; write under {REPO / 'build'} or outside the repository")
    return path


def check_output_file(path, flag: str) -> Path:
    """One file a run writes at its end, checked before the run starts; ValueError naming `flag` when it
    is a folder, cannot be written (or made), or is a file git tracks. Returns it as an absolute path."""
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file name")
    _writable_place(path, flag)  # the file is replaced by a rename: its folder must be writable
    if path.exists():
        tracked = tracked_files(path)
        if tracked:
            raise ValueError(f"{flag} {path}: git tracks this file; write to a new file (or under build/)")
        if tracked is None and _inside(path.resolve(), REPO) and not _inside(path.resolve(), REPO / "build"):
            raise ValueError(f"{flag} {path}: an existing file inside the repository, and git cannot tell "
                             f"here whether it is committed; write to a new file, under {REPO / 'build'}, or "
                             f"outside the repository")
    return path
