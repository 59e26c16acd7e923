"""Roofline points from records (k3lab.profiling.roofline) and their figure (plots.study_roofline)."""

from __future__ import annotations

import math

import pytest

from k3lab import bench, env, plots
from k3lab.bench.records import Record
from k3lab.profiling import roofline as rl

DEVICE = "nvidia-h200"
H200 = env.PEAKS["H200"]  # the peak the committed H200 records' floors were computed with


def _rec(study="copy_removal", case="c", variant="after", device="NVIDIA H200", extra=None, shape=None,
         median=10.0, floor=None):
    return Record(study=study, case=case, variant=variant, device=device, backend="cuda", versions={},
                  commit="abcdef1", date="2026-12-01T00:00:00+00:00", shape=shape or {}, dtype="bfloat16",
                  median_us=median, p20_us=median, p80_us=median, floor_us=floor, extra=extra or {})


@pytest.mark.parametrize("study", ["copy_removal", "kda_scan", "kda_decode", "mla_padding"])
def test_work_reproduces_the_committed_floors(study):
    """The bytes and flops a point uses are the ones the study's floor was computed from: max(bytes /
    bandwidth, flops / matrix rate) at the peak the records used gives each record's floor_us back
    (mla_padding's floor counts bytes only)."""
    recs = [r for r in bench.load_records(study, device=DEVICE) if r.floor_us]
    pts = rl.points(recs)
    assert len(pts) >= 10, f"{study}: expected committed points, got {len(pts)}"
    for row in pts.itertuples():
        mem = row.bytes / (H200.bandwidth_tbs * 1e6)
        floor = mem if study == "mla_padding" else max(mem, row.flops / (H200.bf16_tflops * 1e6))
        assert floor == pytest.approx(row.floor_us, rel=1e-9), row.name
        assert row.flops > 0


def test_work_is_none_where_no_formula_and_refuses_non_records():
    assert rl.work(_rec("serving")) is None
    assert rl.work(_rec("copy_removal", shape={"tokens": 1})) is None  # fields missing
    with pytest.raises(ValueError, match="record"):
        rl.work({"study": "copy_removal"})


def test_points_keep_cases_in_order_and_modes():
    recs = [_rec(case=c, variant=v, shape={"tokens": 1, "hidden": 8, "sources": 2}, extra={"bytes": 64},
                 median=m) for c, v, m in (("a", "before", 4.0), ("a", "after", 2.0), ("b", "after", 1.0))]
    pts = rl.points(recs, cases=["b", "a"])
    assert list(pts["case"]) == ["b", "a", "a"]
    assert pts["flops"].tolist() == [8 * (4 * 2 + 4)] * 3
    assert rl.points(recs, modes=("graph",)).empty


def test_ceilings_from_records_then_peaks_labelled():
    measured = [_rec(extra={"bandwidth_tbs": b, "bandwidth_how": "1 GiB device copy, measured in this run"})
                for b in (4.0, 4.2, 4.4)]
    assumed = _rec(extra={"bandwidth_tbs": 9.0, "bandwidth_how": "env peak"})  # not a measurement
    c = rl.ceilings(DEVICE, records=measured + [assumed])
    assert c.bandwidth_tbs == pytest.approx(4.2) and c.bandwidth_source.startswith("measured")
    assert c.matrix_tflops == H200.bf16_tflops and c.matrix_source.startswith("k3lab.env.PEAKS")
    probe = _rec(rl.PROBE_STUDY, variant="reference", extra={"matmul_tflops": 650.0})
    c2 = rl.ceilings(DEVICE, records=[probe])
    assert c2.matrix_tflops == 650.0 and "probe" in c2.matrix_source
    assert c2.bandwidth_source.startswith("k3lab.env.PEAKS")
    assert c2.ridge == pytest.approx(650.0 / H200.bandwidth_tbs)
    with pytest.raises(ValueError, match="device"):
        rl.ceilings("some-npu", records=[])
    with pytest.raises(ValueError, match="device"):
        rl.ceilings("")


def test_committed_h200_ceilings_are_the_measured_copy():
    c = rl.ceilings(DEVICE)
    assert c.device == "NVIDIA H200" and c.bandwidth_source.startswith("measured")
    assert 3.5 < c.bandwidth_tbs < 4.8  # a device copy on an H200 (datasheet 4.8 TB/s)


def test_roofline_reads_the_probe_study_and_measures_nothing():
    # the ceilings are measured by the study k3lab.studies.ceilings; this module only reads its records
    import ast
    from pathlib import Path

    from k3lab.studies import ceilings

    assert rl.PROBE_STUDY == ceilings.NAME
    tree = ast.parse(Path(rl.__file__).read_text())
    calls = {n.func.attr for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not calls & {"time_fn", "make_record", "save_records", "synchronize"}
    assert not hasattr(rl, "probe_ceilings")


def test_projected_ceilings_are_marked():
    p = rl.projected_ceilings("MI355X")
    assert p.projected and "projected" in p.name and p.bandwidth_source.startswith("projected")
    with pytest.raises(ValueError, match="name"):
        rl.projected_ceilings("CPU")


def test_step_points_from_an_attribution_record():
    rec = next(r for r in bench.load_records("decode_step", device=DEVICE) if "parts" in r.extra)
    pts = rl.step_points(rec)
    floored = {p["part"] for p in rec.extra["parts"] if rl._num(p.get("floor_us")) is not None}
    assert {n.split()[0] for n in pts["name"]} == floored and floored >= {"kda", "mla", "moe"}
    bw = rec.extra["bandwidth_tbs"]
    for row in pts.itertuples():
        assert row.bytes / (bw * 1e6) == pytest.approx(row.floor_us)
        assert 0.2 < row.flops / row.bytes < 200  # a decode step: far left of an H200's ridge (~166)
    with pytest.raises(ValueError, match="attribution"):
        rl.step_points(_rec())


def test_part_flops_scale_with_batch_and_context():
    from k3lab.config import K3Config

    c = K3Config.tp_slice(8)
    f1, f2 = rl._part_flops(c, 1, 1024), rl._part_flops(c, 2, 1024)
    assert f2["dense"] == pytest.approx(2 * f1["dense"])
    long = rl._part_flops(c, 1, 2048)
    extra = 2.0 * c.num_mla_layers * c.num_attention_heads * 1024 * (c.mla_latent_dim + c.kv_lora_rank)
    assert long["mla"] - f1["mla"] == pytest.approx(extra)


@pytest.mark.parametrize("study", ["copy_removal", "mla_padding", "kda_scan", "decode_step"])
def test_study_roofline_figure(study):
    fig = plots.study_roofline(study, projected="MI355X")
    title = fig.layout.title.text
    assert "NVIDIA H200" in title and "bandwidth: measured" in title and "matrix:" in title
    names = [t.name for t in fig.data]
    assert any(n.startswith("bandwidth ") for n in names) and any(n.startswith("matrix ") for n in names)
    projected = [n for n in names if "(projected)" in n]
    assert len(projected) == 2  # MI355X's slope and ceiling, labelled
    isa = [n for n in names if "ISA" in n]  # what MI355X would need, or a note that nothing was projected
    assert isa and all("not measured" in n or "nothing drawn" in n for n in isa)
    points = [t for t in fig.data if t.mode == "markers+text"]
    assert points and all(len(t.x) for t in points)


def test_study_roofline_before_and_after_share_an_intensity():
    fig = plots.study_roofline("mla_padding", cases=["ctx32k"])
    by = {t.name: (t.x[0], t.y[0]) for t in fig.data if t.mode == "markers+text"}
    assert {"before", "after"} <= set(by)
    assert by["before"][0] == pytest.approx(by["after"][0])
    assert by["after"][1] > by["before"][1]  # the after is faster: higher on the same x


def test_study_roofline_refuses_unknown():
    with pytest.raises(ValueError, match="study"):
        plots.study_roofline("copy_removal", device="no-such-device")
    with pytest.raises(ValueError, match="cases"):
        plots.study_roofline("copy_removal", cases=["no_such_case"])


def test_roofline_point_height_is_flops_over_time():
    fig = plots.study_roofline("kda_decode", cases=["B1_H12"], modes=("graph",))
    recs = {r.variant: r for r in bench.load_records("kda_decode", device=DEVICE)
            if r.case == "B1_H12" and r.mode == "graph"}
    for t in fig.data:
        if t.mode == "markers+text":
            b, f = rl.work(recs[t.name])
            assert t.y[0] == pytest.approx(f / recs[t.name].median_us / 1e6)
            assert t.x[0] == pytest.approx(f / b) and math.isfinite(t.x[0])


def test_probe_records_import_and_set_the_ceilings(tmp_path):
    """The H100's committed probe records go through `k3lab import` (the ceilings probe is a study of
    k3lab.studies.PROBES, not of STUDIES, and import takes it) and set both ceilings, each labelled
    measured, to the records' own figures."""
    import json
    from pathlib import Path

    from k3lab import cli

    folder = Path(__file__).parents[1] / "profiles" / "nvidia-h100-80gb-hbm3" / rl.PROBE_STUDY
    rows = [d for f in sorted(folder.glob("*.json")) for d in json.loads(f.read_text())]
    assert {d["case"] for d in rows} == {"copy_1GiB", "matmul_bf16_8192"}
    (tmp_path / "in.json").write_text(json.dumps(rows))
    assert cli.main(["import", str(tmp_path / "in.json"), "--root", str(tmp_path / "p")]) == 0
    c = rl.ceilings("nvidia-h100-80gb-hbm3",
                    records=bench.load_records(device="nvidia-h100-80gb-hbm3", root=str(tmp_path / "p")))
    by = {d["case"]: d["extra"] for d in rows}
    assert c.bandwidth_tbs == pytest.approx(by["copy_1GiB"]["bandwidth_tbs"])
    assert "measured" in c.bandwidth_source
    assert c.matrix_tflops == pytest.approx(by["matmul_bf16_8192"]["matmul_tflops"])
    assert "measured" in c.matrix_source


# k3lab.env.PEAKS key -> its records' folder under profiles/
PEAK_FOLDERS = {"H200": "nvidia-h200", "H100": "nvidia-h100-80gb-hbm3"}


def peak_label_problems(peaks, load=bench.load_records) -> list[str]:
    """Each PEAKS label that the committed records contradict: a figure labelled 'measured' with no record
    of that device measuring it within 5 %, or one said to have 'no committed record' where a ceilings
    probe record of it exists."""
    out = []
    for key, pk in peaks.items():
        folder = PEAK_FOLDERS.get(key)
        recs = list(load(device=folder)) if folder else []
        for label, value, field in ((pk.bandwidth_source, pk.bandwidth_tbs, "bandwidth_tbs"),
                                    (pk.bf16_source, pk.bf16_tflops, "matmul_tflops")):
            found = [float(r.extra[field]) for r in recs if isinstance(r.extra.get(field), (int, float))
                     and (field == "matmul_tflops" or "measured" in str(r.extra.get("bandwidth_how", "")))]
            if label.startswith("measured") and not any(abs(f / value - 1) <= 0.05 for f in found):
                out.append(f"{key} {field}: labelled {label!r}, and no record of {folder or 'that device'} "
                           f"measured {value:g} (records: {sorted(round(f, 2) for f in found)[:5]})")
            if "no committed record" in label and found:
                out.append(f"{key} {field}: labelled {label!r}, and {len(found)} records measured it")
    return out


def test_peaks_labelled_measured_are_backed_by_records():
    assert peak_label_problems(env.PEAKS) == []


def test_a_peak_label_the_records_contradict_is_found():
    from dataclasses import replace

    claimed = {"H200": replace(H200, bf16_source="measured (bf16 8192^3 random)"),
               "H100": replace(env.PEAKS["H100"], bandwidth_source="measured", bandwidth_tbs=3.35)}
    out = peak_label_problems(claimed)
    assert len(out) == 2 and "H200 matmul_tflops" in out[0] and "H100 bandwidth_tbs" in out[1]
    probe = _rec(rl.PROBE_STUDY, variant="reference", extra={"matmul_tflops": 707.0})
    copy = _rec(extra={"bandwidth_tbs": 4.3, "bandwidth_how": "device copy, measured in this run"})
    out = peak_label_problems({"H200": H200}, load=lambda device: [probe, copy])
    assert out == [f"H200 matmul_tflops: labelled {H200.bf16_source!r}, and 1 records measured it"]
