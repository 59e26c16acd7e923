"""What MI355X would need, from the ISA report (k3lab.profiling.isa_roofline), on the study rooflines."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest

from k3lab import bench, plots
from k3lab.isa.targets import TARGETS
from k3lab.profiling import isa_roofline as ir
from k3lab.profiling import roofline as rl
from k3lab.profiling.trend import committed_isa_report

DEVICE = "nvidia-h200"
GFX950 = TARGETS["gfx950"]
MLA_CASES = ["ctx1k", "ctx32k", "verify8_32k"]


def _isa_trace(fig):
    found = [t for t in fig.data if t.name == ir.LABEL]
    return found[0] if found else None


def _rows(case: str) -> list[dict]:
    return [r for r in committed_isa_report()["rows"] if r["target"] == "gfx950" and r["case"] == case]


def _expected_need(nbytes: float, flops: float, rows: list[dict]) -> float:
    """The need recomputed from the report rows and the published peaks: fastest launch's rate (matrix
    kind's, else vector) times the SIMDs its programs x waves keep busy, floor = max(bytes / BW, flops /
    rate)."""
    simds = GFX950.simds * GFX950.compute_units
    best = 0.0
    for r in rows:
        kinds = [m.rsplit("_", 1)[-1] for m in r["matrix"]]
        rate = max(ir.MATRIX_TFLOPS[k] for k in kinds) if kinds else ir.VECTOR_TFLOPS
        busy = min(simds, math.prod(r["grid"]) * min(r["num_warps"], GFX950.simds))
        best = max(best, rate * busy / simds)
    floor = max(nbytes / (ir.BANDWIDTH_TBS * 1e6), flops / (best * 1e6))
    return flops / floor / 1e6


def test_projected_marker_only_where_the_kernel_has_isa_facts():
    """mla_padding at 1K and 32K has gfx950 compiles of the after (and the before at 32K); the 8-token
    verify, the peers and the before at 1K do not: the projected trace holds exactly the former, at
    their points' own intensity, and a legend entry counts the rest."""
    fig = plots.study_roofline("mla_padding", cases=MLA_CASES, modes=("graph",), projected="MI355X")
    trace = _isa_trace(fig)
    assert trace is not None and "projected" in trace.name and "not measured" in trace.name
    assert trace.marker.symbol == "diamond-open" and trace.mode == "markers"  # not a measured point's style
    named = sorted(t.split(":")[0] for t in trace.text)
    assert named == ["ctx1k after", "ctx32k after", "ctx32k before"]
    pts = rl.points(bench.load_records("mla_padding", device=DEVICE), cases=MLA_CASES, modes=("graph",))
    total = len(pts[(pts.flops > 0) & (pts.bytes > 0)])
    missing = [t.name for t in fig.data if t.name.startswith("no gfx950 ISA facts")]
    assert missing == [f"no gfx950 ISA facts, nothing drawn: {total - 3} of {total} points"]
    assert f"MI355X ISA projection for 3 of {total} points" in fig.layout.title.text
    measured = {t.name for t in fig.data if t.mode == "markers+text"}
    assert ir.LABEL not in measured


def test_nothing_projected_without_facts_or_without_mi355x():
    fig = plots.study_roofline("mla_padding", cases=["verify8_32k"], modes=("graph",), projected="MI355X")
    assert _isa_trace(fig) is None
    assert any(t.name.startswith("no gfx950 ISA facts") for t in fig.data)
    step = plots.study_roofline("decode_step", cases=["attribution.b1_1k.all_on"], projected="MI355X")
    assert _isa_trace(step) is None and "projection for 0 of" in step.layout.title.text
    for fig in (plots.study_roofline("mla_padding", cases=["ctx32k"], modes=("graph",)),
                plots.study_roofline("mla_padding", cases=["ctx32k"], modes=("graph",), projected="MI355X",
                                     isa=False)):
        assert not any("ISA" in (t.name or "") for t in fig.data)


@pytest.mark.parametrize(("variant", "isa_case"), [("after", "mla_decode.after_32k"),
                                                   ("before", "mla_decode.before")])
def test_the_height_is_recomputed_from_the_report_and_the_peaks(variant, isa_case):
    """The drawn height at ctx32k equals flops / max(bytes / 8 TB/s, flops / ISA rate), recomputed here
    from the committed record's shape and the report's rows (grid, waves, matrix instructions)."""
    rec = next(r for r in bench.load_records("mla_padding", device=DEVICE)
               if r.case == "ctx32k" and r.variant == variant and r.mode == "graph")
    s = rec.shape
    nbytes = s["lengths_sum"] * s["latent"] * 2  # the latent cache read once, bf16
    flops = 2 * s["q_len"] * s["heads"] * s["lengths_sum"] * (s["latent"] + s["value"])
    assert nbytes == rec.extra["cache_bytes"]
    want = _expected_need(nbytes, flops, _rows(isa_case))
    trace = _isa_trace(plots.study_roofline("mla_padding", cases=["ctx32k"], modes=("graph",),
                                            projected="MI355X"))
    i = next(i for i, t in enumerate(trace.text) if t.startswith(f"ctx32k {variant}:"))
    assert trace.y[i] == pytest.approx(want, rel=1e-12)
    assert trace.x[i] == pytest.approx(flops / nbytes)


def test_the_twelve_head_before_is_held_to_its_vector_units_on_48_simds():
    """The before has no MFMA and 12 programs of 8 waves: 48 SIMDs of the vector rate, so it cannot meet
    the bandwidth floor at 32K; the padded after (MFMA, 256 programs) can."""
    pts = rl.points([r for r in bench.load_records("mla_padding", device=DEVICE)
                     if r.case == "ctx32k" and r.mode == "graph" and r.variant in ("before", "after")])
    got = ir.project(pts).set_index("variant")
    before_rows = _rows("mla_decode.before")
    assert before_rows[0]["matrix"] == {}  # the premise, from the report
    assert got.loc["before", "rate_kind"].startswith("fp32 vector")
    assert got.loc["before", "compute_tflops"] == pytest.approx(
        ir.VECTOR_TFLOPS * 12 * min(before_rows[0]["num_warps"], 4) / 1024)
    assert got.loc["before", "bound"] == "compute" and got.loc["after", "bound"] == "bandwidth"
    assert got.loc["after", "busy_cus"] == 256 and got.loc["before", "busy_cus"] == 12


def test_projection_follows_the_report_it_is_given():
    """A changed ISA fact changes the projection: the same point on a report whose kernel launches 2
    programs of 2 waves and has no matrix instruction is held to 4 SIMDs of the vector rate."""
    pts = pd.DataFrame([{"name": "x after", "study": "s", "case": "x", "variant": "after", "bytes": 1e6,
                         "flops": 1e8}])  # 100 flop/byte: left of MI355X's ridge (2500 / 8)
    row = {"target": "gfx950", "case": "k.one", "kernel": "m._k", "ok": True, "grid": [2, 1, 1],
           "num_warps": 2, "occupancy": 8, "vgprs": 40, "spills": 0, "matrix": {}}
    cases = {("s", "x"): {"after": ir.IsaCase("k.one", "_k", {})}}
    got = ir.project(pts, report={"rows": [row]}, cases=cases).iloc[0]
    rate = ir.VECTOR_TFLOPS * 4 / 1024
    floor = max(1e6 / (ir.BANDWIDTH_TBS * 1e6), 1e8 / (rate * 1e6))
    assert got["why_not"] is None and got["floor_us"] == pytest.approx(floor)
    assert got["need_tflops"] == pytest.approx(1e8 / floor / 1e6) and got["busy_cus"] == 2
    mfma = copy.deepcopy(row) | {"grid": [512], "num_warps": 4, "matrix": {"v_mfma_f32_16x16x32_bf16": 8}}
    fast = ir.project(pts, report={"rows": [mfma]}, cases=cases).iloc[0]
    assert fast["bound"] == "bandwidth"
    assert fast["floor_us"] == pytest.approx(1e6 / (ir.BANDWIDTH_TBS * 1e6))
    odd = copy.deepcopy(row) | {"matrix": {"v_mfma_f64_16x16x4_f64": 1}}
    assert "f64" in ir.project(pts, report={"rows": [odd]}, cases=cases).iloc[0]["why_not"]
    broken = copy.deepcopy(row) | {"ok": False}
    assert "did not compile" in ir.project(pts, report={"rows": [broken]}, cases=cases).iloc[0]["why_not"]


def test_bad_inputs_name_the_argument():
    pts = rl.points(bench.load_records("mla_padding", device=DEVICE), cases=["ctx32k"], modes=("graph",))
    with pytest.raises(ValueError, match="points"):
        ir.project(pts.to_dict("records"))
    with pytest.raises(ValueError, match="points"):
        ir.project(pts.drop(columns=["study"]))
    with pytest.raises(ValueError, match="report"):
        ir.project(pts, report={"targets": {}})
    with pytest.raises(ValueError, match="row"):
        ir.launch_rate({"ok": False})
    with pytest.raises(ValueError, match="row"):
        ir.launch_rate({"ok": True, "grid": [1], "num_warps": 4, "occupancy": 0, "matrix": {}, "kernel": "k"})
    facts = ir.project(pts)
    with pytest.raises(ValueError, match="isa"):
        plots.roofline(pts, peak=rl.ceilings(DEVICE), isa=facts.iloc[:1])
    with pytest.raises(ValueError, match="isa"):
        plots.roofline(pts, peak=rl.ceilings(DEVICE), isa=[1, 2])


def test_every_pairing_matches_the_committed_records_and_the_report():
    """Each CASES entry names committed H200 records of that case and variant whose shape holds the
    entry's shape, and gfx950 report rows that compiled, with the named bytes kernel among them."""
    for (study, case), variants in ir.CASES.items():
        recs = [r for r in bench.load_records(study, device=DEVICE) if r.case == case]
        for variant, entry in variants.items():
            mine = [r for r in recs if r.variant == variant]
            assert mine, f"{study} {case} {variant}: no committed record"
            for r in mine:
                assert entry.shape.items() <= r.shape.items(), (study, case, variant, r.shape)
            rows = _rows(entry.isa_case)
            assert rows and all(r["ok"] for r in rows), entry.isa_case
            if entry.kernel:
                assert entry.kernel in {r["kernel"].rsplit(".", 1)[-1] for r in rows}, entry
