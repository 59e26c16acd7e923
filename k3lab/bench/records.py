"""Result records: one measured (study, case, variant) as a `Record`, kept as JSON under
profiles/<device>/<study>/ (`save_records`, `load_records`); `compare` lines before, after, peer
and floor up."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
import numbers
import os
import re
import subprocess
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3lab import env as _env
from k3lab.bench.timing import Timing
from k3lab.files import locked, tracked_files
from k3lab.files import write_atomic  # noqa: F401 - re-exported: bench's writers and the CLI use it

VARIANTS = ("before", "after", "reference")
# Public packages a k3lab kernel is compared with in the same run ('torch' = plain PyTorch ops).
PEERS = {"fla", "torch", "triton", "aiter", "flashmla", "flashinfer", "flash_attn", "vllm", "sglang",
         "cublas"}
# What a record from elsewhere (`k3lab import`) may say: timing modes (bench.Timing's, and 'model' for a
# fitted model's numbers), backends (k3lab.env's), commit ids (git_commit's).
MODES = ("eager", "graph", "cpu", "model")
RECORD_BACKENDS = ("cpu", "cuda", "rocm")
_COMMIT = re.compile(r"[0-9a-f]{7,40}(-dirty)?|unknown")
# A study or case name becomes a folder or file name: letters, digits, '_', '.', '-', not starting with
# '.' or '-' (no '.', '..', hidden or option-like names), at most 120 characters.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,119}")
_TEXT_FIELDS = ("device", "backend", "commit", "date", "dtype", "mode")
_DICT_FIELDS = ("versions", "shape", "error", "extra")
_TIME_FIELDS = ("median_us", "p20_us", "p80_us")


def validate_variant(variant: str) -> str:
    if isinstance(variant, str) and (variant in VARIANTS or variant in PEERS):
        return variant
    raise ValueError(f"variant must be one of {list(VARIANTS)} or a peer package name {sorted(PEERS)}, "
                     f"got {variant!r}")


@dataclass
class Record:
    study: str
    case: str
    variant: str
    device: str
    backend: str
    versions: dict
    commit: str
    date: str
    shape: dict
    dtype: str
    median_us: float
    p20_us: float
    p80_us: float
    floor_us: float | None = None
    error: dict = field(default_factory=dict)
    mode: str = "eager"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        """Every field of the right kind, so that no reader meets a text median or a NaN: ValueError
        naming the field. (Checks that need more context, such as known study names, are
        `record_from_import`'s.)"""
        validate_variant(self.variant)
        for label in ("study", "case"):
            v = getattr(self, label)
            if not isinstance(v, str) or not _NAME.fullmatch(v):
                raise ValueError(f"{label} must be a name of letters, digits, '_', '.', '-' that does not "
                                 f"start with '.' or '-' (it becomes a file name), got {v!r}")
        for label in _TEXT_FIELDS:
            if not isinstance(getattr(self, label), str):
                raise ValueError(f"{label} must be a string, got {getattr(self, label)!r}")
        for label in _DICT_FIELDS:
            if not isinstance(getattr(self, label), dict):
                raise ValueError(f"{label} must be a dict, got {type(getattr(self, label)).__name__}")
        for label in _TIME_FIELDS + (("floor_us",) if self.floor_us is not None else ()):
            v = getattr(self, label)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{label} must be a finite number of microseconds >= 0"
                                 f"{' (or None)' if label == 'floor_us' else ''}, got {v!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING} - set(d)
        if missing:
            raise ValueError(f"record is missing fields {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})


def record_from_import(d, studies=None) -> Record:
    """A record from another machine's run (`k3lab bench --json`), every field checked before anything
    is saved: the Record's own checks (names, kinds, finite times >= 0), no unknown field, the study among
    `studies` (when given), a known backend and timing mode, a device name, a commit id, an ISO date,
    a dtype, p20 <= median <= p80, versions as text. ValueError naming the field."""
    if not isinstance(d, dict):
        raise ValueError(f"expected a record (a JSON object), got {type(d).__name__}")  # noqa: TRY004 - bad input is a ValueError here
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(Record)})
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    r = Record.from_dict(d)
    if studies is not None and r.study not in studies:
        raise ValueError(f"study {r.study!r} is not a known study ({', '.join(studies)})")
    if r.backend not in RECORD_BACKENDS:
        raise ValueError(f"backend must be one of {RECORD_BACKENDS}, got {r.backend!r}")
    if r.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {r.mode!r}")
    if not r.device.strip() or not r.dtype.strip():
        raise ValueError(f"device and dtype must be non-empty, got {r.device!r} and {r.dtype!r}")
    if not _COMMIT.fullmatch(r.commit):
        raise ValueError(f"commit must be a commit id (7-40 hex digits, optional '-dirty') or 'unknown', "
                         f"got {r.commit!r}")
    try:
        _dt.datetime.fromisoformat(r.date)
    except ValueError:
        raise ValueError(f"date must be an ISO 8601 date, got {r.date!r}") from None
    if not r.p20_us <= r.median_us <= r.p80_us:
        raise ValueError(f"expected p20_us <= median_us <= p80_us, got {r.p20_us}, {r.median_us}, {r.p80_us}")
    if not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in r.versions.items()):
        raise ValueError(f"versions must map names to version strings (or null), got {r.versions!r}")
    return r


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


# The committed results: found from any working directory (a notebook runs in notebooks/).
PROFILES = _repo_root() / "profiles"
# Folders beside the studies' under a device's folder that hold no result records: the GPU check's
# test reports and report timings (scripts/gpu_check.py, docs/gpu_check.md) and Nsight Compute's
# captures with their summaries (`k3lab profile --tool ncu`, k3lab.profiling.tools). Reading every study
# skips them; a file that does not parse inside a study's folder is still named (load_records).
NOT_STUDIES = frozenset({"gpu_check", "ncu"})
# Records a model computed, not measured (projected to another GPU, or modelled for a configuration nobody
# measured; extra["projected"] is True), are saved under
# <root>/projected/<device-slug>/<study>/, never beside a measured device's folder, and reading a root's
# devices passes that folder over: readers of projections read root=<root>/projected (k3lab.studies.serving).
PROJECTED = "projected"


@functools.lru_cache(maxsize=4)
def git_commit(path: str | None = None) -> str:
    """K3LAB_COMMIT from the environment when it is set and looks like a commit id (a copied tree,
    such as a device machine's, may carry a stale .git); else HEAD of the git tree holding k3lab
    (or `path`), '-dirty' appended when it has changes; else 'unknown'."""
    given = os.environ.get("K3LAB_COMMIT", "").strip()
    if given:
        if not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", given):
            raise ValueError(f"K3LAB_COMMIT must be a commit id (7-40 hex digits, optional '-dirty'), got "
                             f"{given!r}")
        return given
    where = path or str(_repo_root())
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                              check=False, timeout=10)
        if head.returncode != 0:
            raise OSError(head.stderr)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, check=False, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_slug(device: str | None = None, backend: str | None = None) -> str:
    """Folder name for a device: 'cpu' on CPU, else the lower-cased name with non-alphanumerics
    as '-' ('NVIDIA H200' -> 'nvidia-h200')."""
    if device is None or backend is None:
        info = _env.detect()
        device = device if device is not None else info.name
        backend = backend if backend is not None else info.backend
    if backend == "cpu":
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return slug or "unknown-device"


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    return str(dtype)


def provenance() -> dict:
    """Where and when a measurement was made, for result files that are not Records: device,
    backend, versions, commit, date (the fields make_record fills)."""
    info = _env.detect()
    return {"device": info.name, "backend": info.backend, "versions": dict(_env.versions()),
            "commit": git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def make_record(study: str, case: str, variant: str, timing: Timing, *, shape: dict, dtype,
                floor_us: float | None = None, error: dict | None = None, **extra) -> Record:
    """A Record for this machine now: device, backend, versions, commit and date filled in; the
    timing's repeats, overhead and graph copies kept in `extra`. A timing made by the host clock (mode
    'cpu': `time_fn(device="cpu")`) names the CPU as its device on any machine, so a host-side
    measurement made on a GPU machine is filed under cpu/, not under the GPU's name."""
    if not isinstance(timing, Timing):
        raise ValueError(f"timing must be a bench.Timing, got {type(timing).__name__}")  # noqa: TRY004 - bad input is a ValueError here
    if not isinstance(shape, dict):
        raise ValueError(f"shape must be a dict of named sizes, got {type(shape).__name__}")  # noqa: TRY004 - bad input is a ValueError here
    info = _env.cpu_info() if timing.mode == "cpu" else _env.detect()
    ext = {"repeats": timing.repeats, "overhead_us": timing.overhead_us,
           "calls_per_sample": timing.calls_per_sample, "graph_copies": timing.graph_copies,
           "rotate_sets": timing.rotate_sets, "flush_l2": timing.flush_l2}
    ext.update(extra)
    return Record(study=study, case=case, variant=variant, device=info.name, backend=info.backend,
                  versions=dict(_env.versions()), commit=git_commit(),
                  date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  shape=dict(shape), dtype=_dtype_name(dtype), median_us=timing.median_us,
                  p20_us=timing.p20_us, p80_us=timing.p80_us, floor_us=floor_us,
                  error=dict(error or {}), mode=timing.mode, extra=_jsonable(ext))


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return _dtype_name(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _git_tracked(path: Path) -> bool | None:
    """Whether git tracks `path`: True or False when git answers, None when it cannot (no git on
    PATH, a tree without .git such as a `git archive` copy, an unsafe directory)."""
    tracked = tracked_files(path)
    return None if tracked is None else bool(tracked)


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def committed_reason(path: Path) -> str | None:
    """Why an existing record file counts as a committed reference (None: it does not). Git is
    asked first; when it cannot answer, every file under the committed tree (PROFILES) counts, so
    a copy without git or .git (what a GPU machine often gets) protects its references too."""
    tracked = _git_tracked(path)
    if tracked:
        return "tracked by git"
    if tracked is None and _inside(path, Path(PROFILES)):
        return f"under {PROFILES}, and git cannot tell here whether it is committed"
    return None


def _read_record_file(path: Path) -> list[Record]:
    """The records of one file (a JSON list of records, or one record); ValueError naming the file
    when it does not parse as records."""
    try:
        data = json.loads(path.read_text())
        return [Record.from_dict(item) for item in (data if isinstance(data, list) else [data])]
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} does not hold result records: {type(exc).__name__}: {exc}") from exc


def _merge(existing: list[Record], new: list[Record]) -> list[Record]:
    """The existing records, then the new ones not already there (equal in every field): a re-run
    adds its records after the earlier ones, so readers that keep the last one see the newest."""
    out = list(existing)
    seen = [r.to_dict() for r in out]
    for r in new:
        d = r.to_dict()
        if d not in seen:
            out.append(r)
            seen.append(d)
    return out


def save_records(records: Iterable[Record], root=None, overwrite: bool = False) -> list[Path]:
    """Write records as JSON: <root>/<device-slug>/<study>/<case>__<variant>.json, one file per
    (device, study, case, variant) holding a list (eager and graph timings of one variant share it); a
    projected record (extra["projected"] is True) under <root>/projected/<device-slug>/ instead.

    No record is lost: a file that exists already keeps its records and gains the new ones (a second
    save merges; `overwrite=True` replaces the file's records with the new ones). A committed
    reference (`committed_reference`: git tracks it, or git cannot tell and it lies under PROFILES)
    is not touched unless overwrite=True: FileExistsError, before anything is written. Every file is
    written atomically (temp file + rename). Returns the paths written.

    Concurrent saves (two processes, two `k3lab import`s) keep every record: the read, the merge and the
    rename run under an exclusive lock on `root` (files.locked), so a second saver reads the first one's
    file only after its rename. A lock, not one file per record: the files keep the one layout that
    every reader and the committed tree use, (case, variant) to a file."""
    root = Path(PROFILES if root is None else root)
    records = list(records)
    if not records:
        raise ValueError("records is empty: nothing to save")
    groups: dict[Path, list[Record]] = {}
    for r in records:
        if not isinstance(r, Record):
            raise ValueError(f"records must hold bench.Record, got {type(r).__name__}")  # noqa: TRY004 - bad input is a ValueError here
        folder = device_slug(r.device, r.backend)
        if r.extra.get("projected") is True:
            folder = f"{PROJECTED}/{folder}"
        path = root / folder / r.study / f"{r.case}__{r.variant}.json"
        if not _inside(path, root):  # a Record's names cannot leave it; a symlinked folder could
            raise ValueError(f"{path} resolves outside {root}: not written")
        groups.setdefault(path, []).append(r)
    with locked(root):
        merged: dict[Path, list[Record]] = {}
        for path, recs in groups.items():  # refuse before writing anything
            if overwrite or not path.exists():
                merged[path] = recs
                continue
            why = committed_reason(path)
            if why is not None:
                raise FileExistsError(f"{path} is a committed reference ({why}); pass overwrite=True to "
                                      f"replace it, or save under another root= for a scratch run")
            try:
                merged[path] = _merge(_read_record_file(path), recs)
            except ValueError as exc:
                raise FileExistsError(f"{exc}: not merged into; pass overwrite=True to replace it") from exc
        for path, recs in merged.items():
            write_atomic(path, json.dumps([r.to_dict() for r in recs], indent=1, sort_keys=True) + "\n")
    return list(merged)


def load_records(study: str | None = None, device: str | None = None, root=None) -> list[Record]:
    """Read records back from <root>/<device-slug>/<study>/*.json. `device` is a slug ('nvidia-h200',
    'cpu') or a device name; None reads every device. Missing folders give an empty list. A file that
    does not parse as records (truncated, hand-edited) is skipped with a RecordFileWarning naming it:
    one bad file does not hide every other record. With study=None the folders of NOT_STUDIES are
    passed over quietly (they hold the GPU check's reports, not records). The PROJECTED folder is no
    device's: projected records are read with root=<root>/projected."""
    base = Path(PROFILES if root is None else root)
    if not base.is_dir():
        return []
    dev_dirs = sorted(p for p in base.iterdir() if p.is_dir() and p.name != PROJECTED)
    if device is not None:
        slug = device if device == "cpu" else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
        dev_dirs = [p for p in dev_dirs if p.name == slug]
    out: list[Record] = []
    for d in dev_dirs:
        study_dirs = ([d / study] if study else
                      sorted(p for p in d.iterdir() if p.is_dir() and p.name not in NOT_STUDIES))
        for sd in study_dirs:
            for f in sorted(sd.glob("*.json")) if sd.is_dir() else []:
                try:
                    out += _read_record_file(f)
                except ValueError as exc:
                    warnings.warn(f"skipped a bad record file: {exc}", RecordFileWarning, stacklevel=2)
    return out


class RecordFileWarning(UserWarning):
    """A record file under profiles/ (or another root) that does not parse was skipped."""


def records_frame(records: Iterable[Record]):
    """One row per record with the main fields (shape and error flattened to strings)."""
    import pandas as pd

    rows = []
    for r in records:
        rows.append(
            {
                "device": r.device,
                "study": r.study,
                "case": r.case,
                "variant": r.variant,
                "mode": r.mode,
                "dtype": r.dtype,
                "median_us": r.median_us,
                "p20_us": r.p20_us,
                "p80_us": r.p80_us,
                "floor_us": r.floor_us,
                "shape": json.dumps(r.shape, sort_keys=True),
                "max_rel": r.error.get("max_rel"),
                "commit": r.commit,
                "date": r.date,
            }
        )
    return pd.DataFrame(rows)


def _variant_order(v: str) -> tuple:
    return (VARIANTS.index(v) if v in VARIANTS else len(VARIANTS), v)


def _mode_label(recs: list[Record]) -> str:
    """One mode when all records share it, else 'before:eager after:graph' (variant:mode pairs)."""
    modes = {r.mode for r in recs}
    if len(modes) == 1:
        return modes.pop()
    pairs = {r.variant: r.mode for r in recs}
    return " ".join(f"{v}:{pairs[v]}" for v in sorted(pairs, key=_variant_order))


def compare(records: Iterable[Record]):
    """One row per (device, study, case): before_us, after_us, reference_us, <peer>_us per peer,
    peer (the fastest peer) and peer_us, floor_us (the largest floor given), and the ratios
    speedup = before / after, after_vs_peer = peer / after (> 1: after beats the peer),
    floor_fraction = floor / after (1 = at the floor).

    `mode` names the timing mode, or 'before:eager after:graph' when the variants were timed
    differently (graph replay as the 'after' of a launch-bound case). When one variant of a case was
    timed in several modes, the case gets one row per mode instead."""
    import pandas as pd

    by_case: dict[tuple, list[Record]] = {}
    for r in records:
        by_case.setdefault((r.device, r.study, r.case), []).append(r)
    groups: list[list[Record]] = []
    for recs in by_case.values():
        modes_per_variant: dict[str, set] = {}
        for r in recs:
            modes_per_variant.setdefault(r.variant, set()).add(r.mode)
        if any(len(m) > 1 for m in modes_per_variant.values()):
            split: dict[str, list[Record]] = {}
            for r in recs:
                split.setdefault(r.mode, []).append(r)
            groups += list(split.values())
        else:
            groups.append(recs)
    rows = []
    peer_names = sorted({r.variant for recs in groups for r in recs if r.variant not in VARIANTS})
    for recs in groups:
        first = recs[0]
        g = {"device": first.device, "study": first.study, "case": first.case, "mode": _mode_label(recs),
             "before_us": math.nan, "after_us": math.nan, "reference_us": math.nan, "floor_us": math.nan}
        peers: dict[str, float] = {}
        for r in recs:
            if r.variant in VARIANTS:
                g[f"{r.variant}_us"] = r.median_us
            else:
                peers[r.variant] = r.median_us
            if r.floor_us is not None and not (g["floor_us"] >= r.floor_us):
                g["floor_us"] = float(r.floor_us)
        for p in peer_names:
            g[f"{p}_us"] = peers.get(p, math.nan)
        if peers:
            best = min(peers, key=peers.get)
            g["peer"], g["peer_us"] = best, peers[best]
        else:
            g["peer"], g["peer_us"] = None, math.nan
        after = g["after_us"]
        g["speedup"] = g["before_us"] / after if after > 0 else math.nan
        g["after_vs_peer"] = g["peer_us"] / after if after > 0 else math.nan
        g["floor_fraction"] = g["floor_us"] / after if after > 0 else math.nan
        rows.append(g)
    cols = ["device", "study", "case", "mode", "before_us", "after_us", "reference_us",
            *[f"{p}_us" for p in peer_names], "peer", "peer_us", "floor_us", "speedup", "after_vs_peer",
            "floor_fraction"]
    return pd.DataFrame(rows, columns=cols)
