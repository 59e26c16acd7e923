"""Roofline points from result records: each record's bytes and flops, and the device's ceilings.

A point is one timed (case, variant) of a study: x = arithmetic intensity (flops / bytes), y = achieved
TFLOP/s (flops / median time). Bytes and flops are the *problem's*, the same numbers the study's floor is
computed from (bench.floor_us: bytes over bandwidth, flops over the matrix rate), never what one variant
happens to move: so the before, the after and the peer of one case share an x and differ in height, and
the distance to the ceiling is the distance to the floor. `work(record)` derives them per study:

  copy_removal   bytes: extra['bytes'] (the floor's: read every source once, write mix and norm);
                 flops: per hidden element a score product and a weighted add per source (4 flops)
                 and the norm's square, sum and two scales (4)
  mla_padding    bytes: extra['cache_bytes'] (the latent cache read once); flops: the MLA op's count,
                 k3lab.ops.mla_decode.decode_flops (per query row, head and cached row, the score over
                 the 576-wide latent and the 512-wide value sum, 2 (576 + 512))
  kda_scan       the study's io_bytes and chunk_flops formulas from the record's shape (q, k, v, o in the
                 input dtype, g and beta fp32, state in and out fp32; the chunked algorithm's matmuls)
  kda_decode,    bytes: the record's extra['bytes'] (its parts summed); flops: 8 K V per head and token (the
  kda_verify     decay, k.S, the outer-product update, q.S)
  decode_step    attribution records (`step_points`): each part's floor bytes (floor_us x the run's
                 measured copy bandwidth) and its flops from k3lab.studies.decode_step.measure.part_bytes
                 (2 flops per weight a token uses, the experts a token routes to, the MLA scores and
                 value sums over the context, the KDA state update)
  dcp,           the formulas the study's floors are made of, kept by the study (k3lab.studies.<study>.work):
  moe_sharding   the record's extra['bytes'] and extra['flops'] where its measure wrote them, else the
                 study's work_of(record) from its shape and dtype (records saved before the study wrote
                 them); the point's `work` column says which

`ceilings(device)` takes the copy bandwidth and the matrix rate from the device's records where a run
measured them (decode_step's attribution measures a 1 GiB device copy in the same run; the ceilings
probe's records, profiles/<device>/ceilings/), else from k3lab.env.PEAKS, each labelled with its source.
The probe is the study k3lab.studies.ceilings (`python -m k3lab.studies.ceilings --save` on a GPU); which
devices it has run on is k3lab.studies.runs' data (its part `ceilings`), not this docstring's.
`projected_ceilings('MI355X')` is the datasheet line for a GPU nobody here ran on, labelled projected.
Pure functions over records: no GPU needed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import pandas as pd

from k3lab import bench
from k3lab import env as _env
from k3lab.ops.mla_decode.inputs import decode_flops
from k3lab.studies.ceilings import NAME as PROBE_STUDY  # profiles/<device>/ceilings/<case>__reference.json
KDA_FLOPS_PER_KV = 8  # per head and token: decay, k.S, outer-product update, q.S (2 flops each per K x V)
STEP_WORK = ("decode_step attribution: bytes = the part's floor x the run's measured bandwidth, flops = "
             "k3lab.profiling.roofline's count for the part's layer kind")
POINT_COLUMNS = ("name", "study", "case", "variant", "mode", "device", "bytes", "flops", "time_us",
                 "floor_us", "work")


@dataclass(frozen=True)
class Ceilings:
    """A device's two roofline ceilings and where each number comes from. `name` and `bf16_tflops`
    mirror k3lab.env.Peak's fields, so plots.roofline takes either. `projected`: not measured on that
    device by this project (a datasheet line for comparison)."""

    device: str
    bandwidth_tbs: float
    bandwidth_source: str
    matrix_tflops: float
    matrix_source: str
    projected: bool = False

    @property
    def name(self) -> str:
        return self.device

    @property
    def bf16_tflops(self) -> float:
        return self.matrix_tflops

    @property
    def ridge(self) -> float:
        """Flop per byte where the bandwidth slope meets the matrix ceiling."""
        return self.matrix_tflops / self.bandwidth_tbs


def _peak_for(device_name: str) -> _env.Peak | None:
    key = device_name.upper()
    return next((pk for name, pk in _env.PEAKS.items() if name != "CPU" and name in key), None)


def ceilings(device: str, records=None) -> Ceilings:
    """The ceilings of `device` (a slug such as 'nvidia-h200' or a device name), from `records` (default:
    every committed record of that device): the median of the copy bandwidths runs measured
    (extra['bandwidth_tbs'] with extra['bandwidth_how'] saying measured, or a `ceilings` probe record),
    and a probe's matrix rate (extra['matmul_tflops']); each missing one from k3lab.env.PEAKS with its
    source. ValueError when neither records nor PEAKS know the device."""
    if not isinstance(device, str) or not device.strip():
        raise ValueError(f"device: expected a device slug or name such as 'nvidia-h200', got {device!r}")
    recs = list(bench.load_records(device=device) if records is None else records)
    name = recs[0].device if recs else device
    bws = [float(r.extra["bandwidth_tbs"]) for r in recs
           if isinstance(r.extra.get("bandwidth_tbs"), (int, float))
           and "measured" in str(r.extra.get("bandwidth_how", "measured" if r.study == PROBE_STUDY else ""))]
    mats = [float(r.extra["matmul_tflops"]) for r in recs
            if r.study == PROBE_STUDY and isinstance(r.extra.get("matmul_tflops"), (int, float))]
    pk = _peak_for(name)
    if pk is None and not (bws and mats):
        raise ValueError(f"device: no record measured {name!r}'s ceilings and k3lab.env.PEAKS does not know "
                         "it "
                         f"(known: {', '.join(k for k in _env.PEAKS if k != 'CPU')})")
    if bws:
        bw, bw_src = statistics.median(bws), f"measured: device copy, median of {len(bws)} records"
    else:
        bw, bw_src = pk.bandwidth_tbs, f"k3lab.env.PEAKS: {pk.bandwidth_source}"
    if mats:
        mat, mat_src = statistics.median(mats), f"measured: bf16 matmul probe, median of {len(mats)} records"
    else:
        mat, mat_src = pk.bf16_tflops, f"k3lab.env.PEAKS: {pk.bf16_source}"
    return Ceilings(name, bw, bw_src, mat, mat_src)


def projected_ceilings(name: str = "MI355X") -> Ceilings:
    """The datasheet ceilings of a GPU this project has not measured, marked projected."""
    pk = _env.PEAKS.get(name)
    if pk is None or name == "CPU":
        raise ValueError(f"name: expected one of {[k for k in _env.PEAKS if k != 'CPU']}, got {name!r}")
    return Ceilings(f"{pk.name} (projected)", pk.bandwidth_tbs, f"projected: {pk.bandwidth_source}",
                    pk.bf16_tflops, f"projected: {pk.bf16_source}", projected=True)


def _elem(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "float32": 4, "fp32": 4, "float8_e4m3fn": 1,
            "fp8": 1}.get(str(dtype), 2)


def _copy_removal(r) -> tuple[float, float] | None:
    s = r.shape
    if not {"tokens", "hidden", "sources"} <= set(s) or not isinstance(r.extra.get("bytes"), (int, float)):
        return None
    return float(r.extra["bytes"]), float(s["tokens"] * s["hidden"] * (4 * s["sources"] + 4))


def _mla(r) -> tuple[float, float] | None:
    s = r.shape
    if "cache_bytes" not in r.extra or not {"heads", "lengths_sum", "latent", "value"} <= set(s):
        return None
    flops = decode_flops(s["lengths_sum"], s["heads"], s.get("q_len", 1), latent=s["latent"],
                         value=s["value"])
    return float(r.extra["cache_bytes"]), float(flops)


def _kda_scan(r) -> tuple[float, float] | None:
    s = r.shape
    if not {"K", "V", "T", "batch", "heads", "chunk"} <= set(s):
        return None
    K, V, C, H = s["K"], s["V"], s["chunk"], s["heads"]
    lengths = s.get("lengths") or [s["T"]] * s["batch"]
    e = _elem(r.dtype)
    chunks = sum(-(-int(L) // C) for L in lengths)
    flops = chunks * H * (2 * C * C * (3 * K + 2 * V) + 6 * C * K * V)
    nbytes = sum(lengths) * H * (K * (3 * e + 4 + e) + 4) + 2 * len(lengths) * H * K * V * 4
    return float(nbytes), float(flops)


def _kda_step(r) -> tuple[float, float] | None:
    s, b = r.shape, r.extra.get("bytes")
    if isinstance(b, dict):
        b = sum(b.values())
    if not {"B", "H", "K", "V"} <= set(s) or not isinstance(b, (int, float)):
        return None
    tokens = s["B"] * s.get("T", 1)
    return float(b), float(KDA_FLOPS_PER_KV * tokens * s["H"] * s["K"] * s["V"])


def _carried(r) -> tuple[float, float] | None:
    b, f = r.extra.get("bytes"), r.extra.get("flops")
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (b, f))
    return (float(b), float(f)) if ok else None


def _study_work_of(study: str):
    """The `work_of(record)` of a study that keeps its formulas itself (k3lab.studies.<study>.work),
    imported on first use: a study's package may import profiling/, so importing this module loads none."""
    import importlib

    from k3lab import studies

    return importlib.import_module(studies.STUDIES[study] + ".work").work_of


def _study_work(r) -> tuple[float, float] | None:
    carried = _carried(r)
    if carried is not None:
        return carried
    w = _study_work_of(r.study)(r)
    return None if w is None else (float(w["bytes"]), float(w["flops"]))


WORK = {"copy_removal": _copy_removal, "mla_padding": _mla, "kda_scan": _kda_scan, "kda_decode": _kda_step,
        "kda_verify": _kda_step, "dcp": _study_work, "moe_sharding": _study_work}


def _source(record) -> str:
    """Where `work(record)`'s bytes and flops come from, in words (a roofline point's `work` column)."""
    if WORK[record.study] is not _study_work:
        return f"k3lab.profiling.roofline's {record.study} formula from the record"
    if _carried(record) is not None:
        return "carried: the record's extra['bytes'] and extra['flops'], written by its study's measure"
    return (f"derived: {_study_work_of(record.study).__module__}.work_of from the record's shape and dtype "
            "(the record was saved before its study wrote bytes and flops)")


def work(record) -> tuple[float, float] | None:
    """(bytes, flops) of the problem a record timed (see the module docstring), or None when the record's
    study has no formula here or the record lacks the fields it needs."""
    if not isinstance(record, bench.Record):
        raise ValueError(f"record: expected a bench.Record, got {type(record).__name__}")  # noqa: TRY004
    fn = WORK.get(record.study)
    return fn(record) if fn else None


def points(records, *, cases=None, modes=None) -> pd.DataFrame:
    """One row per record that `work` knows (POINT_COLUMNS): name 'case variant', bytes, flops, time_us
    (the median), floor_us, work (where bytes and flops come from). `cases`: keep these
    cases (in this order); `modes`: these timing modes."""
    rows = []
    for r in records:
        if cases is not None and r.case not in cases:
            continue
        if modes is not None and r.mode not in modes:
            continue
        w = work(r)
        if w is None:
            continue
        rows.append({"name": f"{r.case} {r.variant}", "study": r.study, "case": r.case, "variant": r.variant,
                     "mode": r.mode, "device": r.device, "bytes": w[0], "flops": w[1], "time_us": r.median_us,
                     "floor_us": r.floor_us, "work": _source(r)})
    df = pd.DataFrame(rows, columns=list(POINT_COLUMNS))
    if cases is not None and len(df):
        order = df["case"].map({c: i for i, c in enumerate(cases)})
        df = df.assign(_o=order).sort_values("_o", kind="stable").drop(columns="_o").reset_index(drop=True)
    return df


def _part_flops(config, batch: int, context_len: int, q_len: int = 1) -> dict[str, float]:
    """Flops of one step's layer kinds ('kda', 'mla', 'moe', 'dense', 'ends'), from part_bytes at bf16
    (flops do not depend on how weights are stored): 2 per weight a token uses, the routed experts a
    token chooses (top-k, not the distinct set the bytes count), the MLA scores and value sums over
    the context, the KDA state update."""
    from k3lab.studies.decode_step.measure import part_bytes

    c, N = config, batch * q_len
    kinds = part_bytes(config, batch, context_len, q_len, act_bytes=2, cache_bytes=2)
    out = {kind: 2.0 * N * parts["weights_dense"] / 2 for kind, parts in kinds.items()}
    out["moe"] += 2.0 * N * c.num_moe_layers * c.num_experts_per_token * 3 * c.moe_intermediate_size \
        * c.routed_expert_hidden_size
    out["mla"] += float(c.num_mla_layers * decode_flops(batch * (context_len + q_len), c.num_attention_heads,
                                                        q_len, latent=c.mla_latent_dim, value=c.kv_lora_rank))
    out["kda"] += float(KDA_FLOPS_PER_KV * N * c.num_kda_layers * c.kda_num_heads * c.kda_head_dim ** 2)
    return out


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def step_points(record, config=None) -> pd.DataFrame:
    """The parts of one decode_step attribution record (extra['parts']) that have a floor, as roofline
    points: bytes = floor_us x the run's measured bandwidth, flops from `_part_flops` for the record's
    batch and context, time = the part's kernel time (gaps left out: a roofline places kernels).
    `config`: the model slice the record ran (default K3Config.tp_slice(8), what the GPU runs use).
    The part 'lm_head' takes the 'ends' flops."""
    from k3lab.config import K3Config

    parts = record.extra.get("parts") if isinstance(record, bench.Record) else None
    if not isinstance(parts, list) or not isinstance(record.extra.get("bandwidth_tbs"), (int, float)):
        raise ValueError("record: expected a decode_step attribution record (extra['parts'] and "
                         "extra['bandwidth_tbs'])")
    s = record.shape
    flops = _part_flops(config or K3Config.tp_slice(8), s["batch"], s["context_len"], s.get("q_len", 1))
    bw = float(record.extra["bandwidth_tbs"])
    variant = record.case.rsplit(".", 1)[-1]
    rows = []
    for p in parts:
        floor = _num(p.get("floor_us"))
        kind = "ends" if p["part"] == "lm_head" else p["part"]
        if floor is None or kind not in flops:
            continue
        rows.append({"name": f"{p['part']} {variant}", "study": record.study, "case": record.case,
                     "variant": variant, "mode": record.mode, "device": record.device,
                     "bytes": floor * bw * 1e6, "flops": flops[kind], "time_us": float(p["kernel_us"]),
                     "floor_us": floor, "work": STEP_WORK})
    return pd.DataFrame(rows, columns=list(POINT_COLUMNS))
