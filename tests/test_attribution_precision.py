"""The decode-step attribution at each precision (k3lab.studies.decode_step.attribution): the step built
through the study's settings, each part's bytes from part_bytes at the precision the step runs, tables
that name their precision, and variants without a record shown as 'not measured'."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.ops.moe_experts import mxfp4
from k3lab.studies import decode_step as ds
from k3lab.studies.decode_step import attribution
from k3lab.studies.decode_step import measure as sb

from cpu_child import on_a_cpu
from test_shown_tables import bare_missing

TP8 = K3Config.tp_slice(8)
PRECISIONS = ("bf16", "fp8", "article")


def _summed(kinds: dict) -> float:
    return sum(sum(k.values()) for k in kinds.values())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tp8_parts_sum_to_part_bytes_total_at_their_precision(precision):
    """Every byte of the TP8 step's floor is in one attributed part, at the precision asked."""
    for batch, ctx in ((1, 1024), (64, 8192)):
        parts = attribution.part_floors(TP8, batch, ctx, precision=precision)
        assert set(parts) == set(attribution.FLOOR_OF)
        total = sb.step_bytes(TP8, batch, ctx, precision=precision)["total"]
        assert _summed(parts) == pytest.approx(total, rel=1e-12)
        assert _summed(sb.part_bytes(TP8, batch, ctx, precision=precision)) == pytest.approx(total, rel=1e-12)


def test_the_parts_a_precision_changes_show_it_and_the_rest_do_not():
    cols = {p: {part: attribution.bytes_columns(k) for part, k in
                attribution.part_floors(TP8, 1, 1024, precision=p).items()} for p in PRECISIONS}
    bf16, fp8, art = (cols[p] for p in PRECISIONS)
    for part in ("kda", "mla", "moe", "dense"):  # FP8 projections: fewer dense bytes in every layer kind
        assert fp8[part]["dense_MB"] < bf16[part]["dense_MB"]
        assert art[part]["dense_MB"] == fp8[part]["dense_MB"]
    assert art["moe"]["experts_MB"] < fp8["moe"]["experts_MB"] == bf16["moe"]["experts_MB"]  # MXFP4 experts
    assert art["mla"]["cache_MB"] < fp8["mla"]["cache_MB"] == bf16["mla"]["cache_MB"]  # the FP8 cache
    assert art["kda"]["state_MB"] == bf16["kda"]["state_MB"] > 0  # the KDA state stays fp32
    assert art["lm_head"] == bf16["lm_head"]  # lm_head and the embedding stay bf16
    assert attribution.bytes_columns(None) == dict.fromkeys(attribution.BYTES_COLUMNS)


def test_article_experts_are_mxfp4_bits_over_bf16_bits_of_the_bf16_bytes():
    """The ratio from the formats: an E2M1 code (a sign bit and an index into its magnitudes) plus an
    8-bit E8M0 scale shared by a block, against bf16's bits."""
    code_bits = 1 + math.log2(len(mxfp4.E2M1))
    scale_bits = math.log2(mxfp4.E8M0_MAX - mxfp4.E8M0_MIN + 2)  # 255 exponents and the NaN code
    ratio = (code_bits + scale_bits / mxfp4.BLOCK) / torch.finfo(torch.bfloat16).bits
    for batch in (1, 64):
        art, bf16 = (attribution.part_floors(TP8, batch, 1024, precision=p)["moe"]["weights_experts"]
                     for p in ("article", "bf16"))
        assert art / bf16 == pytest.approx(ratio, rel=1e-12)


def test_bad_names_are_refused_by_argument_before_anything_runs():
    with pytest.raises(ValueError, match="precision must be one of"):
        attribution.attribute(1, 8, precision="fp4")
    with pytest.raises(ValueError, match="precision must be one of"):
        attribution.part_floors(TP8, 1, 8, precision="int4")
    with pytest.raises(ValueError, match="precision must be one of"):
        attribution.floors(1, 8, precision="bf32")
    with pytest.raises(ValueError, match="precision='article' contradicts variant='all_on'"):
        attribution.choose("all_on", "article")
    with pytest.raises(ValueError, match="variant must be one of"):
        attribution.precision_of("all_on_fp4")
    with pytest.raises(ValueError, match="variant must be one of"):
        attribution.records(variants=["all_on_fp4"], log=lambda *_: None)


def test_variants_resolve_to_their_precision_through_the_study_settings():
    assert {p: attribution.precision_of(v) for p, v in attribution.VARIANT_OF.items()} == {
        p: p for p in PRECISIONS}
    assert attribution.precision_of("all_on") == attribution.precision_of("all_on_gemv") == "bf16"
    assert attribution.choose() == ("all_on", "bf16")
    assert attribution.choose(precision="article") == ("all_on_article", "article")
    assert attribution.choose("all_on_fp8") == ("all_on_fp8", "fp8")


@on_a_cpu  # the CPU step is built (not run) with the study's CPU weights
def test_the_cpu_step_at_each_precision_is_built_by_the_study_and_floored_at_it():
    said = []
    assert attribution.records(log=said.append) == []
    assert "nothing is timed" in said[0] and "instead" in said[0]
    for precision in PRECISIONS:
        f = attribution.floors(1, 8, precision=precision)
        assert f["variant"] == attribution.VARIANT_OF[precision] and f["ran"] == precision
        assert any(line.startswith(f"{f['variant']} at {precision} ") for line in said)
        want = sb.step_bytes(sb.CPU_CONFIG, 1, 8, act_bytes=4, cache_bytes=4, precision=precision)["total"]
        assert _summed(f["part_bytes"]) == pytest.approx(want, rel=1e-12)  # fp32 CPU weights: 4 bytes
        t = f["table"]
        assert set(t["precision"]) == {precision} and t["floor_us"].sum() == pytest.approx(f["floor_us"])
        assert f["floor_us"] == pytest.approx(want / (f["bandwidth_tbs"] * 1e6))


def _timing(ms: float) -> bench.Timing:
    return bench.Timing(ms * 1e3, ms * 1e3, ms * 1e3, 3, "eager", 0.0)


def _attribution_record(variant: str, step_ms: float, bw: float = 4.0) -> bench.Record:
    """An attribution record of b1_1k made by attribution.make_record from a synthetic replay (one
    kernel per part) and the real floors at the variant's precision."""
    prec = attribution.precision_of(variant)
    kinds = attribution.part_floors(TP8, 1, 1024, precision=prec)
    parts = ["moe", "kda", "mla", "mix", "lm_head", "dense"]
    rows = pd.DataFrame({"part": parts, "name": [f"k_{p}" for p in parts],
                         "start_ns": [i * 1000 for i in range(len(parts))], "dur_ns": [900] * len(parts),
                         "dur_us": [0.9] * len(parts)})
    floors_us = {p: sum(k.values()) / (bw * 1e6) for p, k in kinds.items()}
    import k3lab.profiling.attribution as at

    table = attribution.with_bytes(at.attribute(rows, floors_us=floors_us), prec, kinds)
    a = {"table": table, "variant": variant, "precision": prec, "part_bytes": kinds, "notes": {},
         "timing": _timing(step_ms), "floor_us": _summed(kinds) / (bw * 1e6), "top": pd.DataFrame(),
         "kernels": pd.DataFrame(), "span_us": step_ms * 1e3, "matched": 1.0, "launches": len(parts),
         "agree": True, "bandwidth_tbs": bw, "bandwidth_how": "given"}
    return attribution.make_record("b1_1k", a, 1, 1024)


def test_an_attribution_table_names_its_precision_and_shows_its_bytes():
    rec = _attribution_record("all_on_article", 9.0)
    assert rec.case == "attribution.b1_1k.all_on_article" and rec.extra["precision"] == "article"
    assert {p["precision"] for p in rec.extra["parts"]} == {"article"}  # the record's own table says it
    rows, summary = ds.attribution_rows("b1_1k", "all_on_article", records=[rec])
    assert summary["precision"] == "article" and {r["precision"] for r in rows} == {"article"}
    by = {r["part"]: r for r in rows}
    art = attribution.part_floors(TP8, 1, 1024, precision="article")
    assert by["moe"]["experts_MB"] == pytest.approx(art["moe"]["weights_experts"] / 1e6)
    assert by["mla"]["cache_MB"] == pytest.approx(art["mla"]["mla_cache"] / 1e6)
    assert by["mix"]["experts_MB"] is None and by["mix"]["floor_ms"] is None  # no floor, no bytes
    default = _attribution_record("all_on_default", 12.0)
    bf16, _ = ds.attribution_rows("b1_1k", "all_on_default", records=[default])
    assert {r["precision"] for r in bf16} == {"bf16"}
    assert {r["part"]: r for r in bf16}["moe"]["experts_MB"] > by["moe"]["experts_MB"]


def test_floor_rows_list_each_precision_and_say_what_is_not_measured():
    bw = 4.0
    rows = ds.floor_rows(records=[_attribution_record("all_on_article", 9.0, bw)])
    by = {r["variant"]: r for r in rows}
    assert set(by) == set(attribution.VARIANT_OF.values())
    assert {by[v]["precision"] for v in by} == set(PRECISIONS)
    art = by["all_on_article"]
    assert art["of_floor"] == pytest.approx(art["floor_ms"] / 9.0) and art["step_ms"] == pytest.approx(9.0)
    for prec in ("bf16", "fp8"):
        r = by[attribution.VARIANT_OF[prec]]
        assert r["step_ms"] == r["of_floor"] == r["kernels"] == ds.NOT_MEASURED
        want = sb.step_bytes(TP8, 1, 1024, precision=prec)["total"] / (bw * 1e6) / 1e3
        assert r["floor_ms"] == pytest.approx(want, rel=1e-12)  # predicted at the case's bandwidth
    assert not bare_missing(pd.DataFrame(rows).to_html())
    assert ds.floor_rows(records=[]) == []


def _step_record(variant: str, ms: float, bw: float = 4.0, mode: str = "graph") -> bench.Record:
    return bench.make_record("decode_step", f"b1_1k.{variant}" + (".graph" if mode == "graph" else ""),
                             "after", bench.Timing(ms * 1e3, ms * 1e3, ms * 1e3, 3, mode, 0.0),
                             shape={"batch": 1, "context_len": 1024}, dtype="bfloat16", floor_us=8000.0,
                             bandwidth_tbs=bw, bandwidth_how="given",
                             step={"precision": attribution.precision_of(variant), "projections": "gemv"})


def test_precision_rows_list_every_setting_with_its_floor_and_not_measured():
    recs = [_step_record("all_on", 16.0), _step_record("all_on_gemv", 12.0)]
    rows = ds.precision_rows(recs, "b1_1k")
    by = {r["variant"]: r for r in rows}
    assert list(by) == list(ds.SETTING_ROWS)
    assert by["all_on_gemv"]["step_ms"] == pytest.approx(12.0) and by["all_on_gemv"]["of_floor"] == 8.0 / 12.0
    for v, prec in (("all_on_default", "bf16"), ("all_on_fp8", "fp8"), ("all_on_article", "article")):
        r = by[v]
        assert r["precision"] == prec and r["step_ms"] == r["of_floor"] == ds.NOT_MEASURED
        want = sb.case_floor(TP8, (1, 1024), 2, (4.0, "given"), prec)["floor_us"] / 1e3
        assert r["floor_ms"] == pytest.approx(want, rel=1e-12) and prec in r["floor_from"]
    assert by["all_on_article"]["floor_ms"] < by["all_on_fp8"]["floor_ms"] < by["all_on_default"]["floor_ms"]
    assert not bare_missing(pd.DataFrame(rows).to_html())
    nothing = ds.precision_rows([], "b1_1k")  # no record to take a bandwidth from: said, not NaN
    assert all(r["floor_ms"] == ds.NOT_MEASURED for r in nothing)
    assert not bare_missing(pd.DataFrame(nothing).to_html())
    eager = [_step_record(v, ms, mode="eager") for v, ms in (("all_on", 30.0), ("all_on_fp8", 20.0))]
    wf = ds.waterfall(recs + eager, "b1_1k")
    assert dict(zip(wf["variant"], wf["precision"])) == {"all_on": "bf16", "all_on_fp8": "fp8"}


def test_committed_attributions_read_back_with_their_precision_and_bytes():
    """Every committed attribution record: its precision named, and each floored part's bytes (kept in
    the record, or for records made before, part_floors at the variant's precision) over the record's
    bandwidth equal the floor it recorded."""
    recs = ds.attributions()
    if not recs:
        pytest.skip("no committed attribution records")
    for r in recs:
        case, variant = r.case[len(ds.ATTRIBUTION):].split(".", 1)
        rows, summary = ds.attribution_rows(case, variant)
        assert summary["precision"] == ds.variant_precision(variant, r) in PRECISIONS
        bw = r.extra["bandwidth_tbs"]
        for row in rows:
            if row["floor_ms"] is None:
                continue
            mb = sum(row[c] for c in attribution.BYTES_COLUMNS)
            assert mb / bw / 1e3 == pytest.approx(row["floor_ms"], rel=1e-9), (r.case, row["part"])
    fp8 = {row["part"]: row for row in ds.attribution_rows("b1_1k", "all_on_fp8")[0]}
    bf16 = {row["part"]: row for row in ds.attribution_rows("b1_1k", "all_on")[0]}
    if fp8 and bf16:
        assert ds.attribution_rows("b1_1k", "all_on_fp8")[1]["precision"] == "fp8"
        assert all(fp8[p]["dense_MB"] < bf16[p]["dense_MB"] for p in ("kda", "mla", "moe", "dense"))
