"""Atomic file writes, without torch: the result records, `k3lab bench --json` and the report's pages
and assets all write through `write_atomic`, so an interrupted write never destroys the previous file.
(The report's notebook workers import no torch; this module keeps it that way.)"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
