"""The whole-step study's arithmetic and tables (k3lab.engine.bench, k3lab.studies.decode_step) on
records made here, without running the benchmark."""

from __future__ import annotations

import pytest

from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine import SWITCHES
from k3lab.engine import bench as sb
from k3lab.studies import decode_step as ds


def _rec(case: str, variant: str, ms: float, mode: str = "graph", **extra) -> bench.Record:
    t = bench.Timing(ms * 1e3, ms * 1e3, ms * 1e3, 3, mode, 0.0)
    suffix = ".graph" if mode == "graph" else ""
    return bench.make_record("decode_step", f"{case}.{variant}{suffix}", "before" if variant == "all_off" else "after",
                             t, shape={"batch": 1}, dtype="bfloat16", floor_us=8000.0, **extra)


def test_variants_cover_every_decode_switch_once():
    v = sb.variants(1)
    assert list(v)[:2] == ["all_off", "all_on"]
    assert {k[3:] for k in v if k.startswith("no_")} == set(SWITCHES) - {"kda_verify_tiles"}
    assert all(sum(not on for on in opts.values()) == 1 for k, opts in v.items() if k.startswith("no_"))
    assert "no_kda_verify_tiles" in sb.variants(3) and "no_kda_fused" not in sb.variants(3)


def test_step_bytes_parts_and_growth():
    tp8 = K3Config.tp_slice(8)
    b1, b128 = sb.step_bytes(tp8, 1, 1024), sb.step_bytes(tp8, 1, 131072)
    assert b1["total"] == pytest.approx(sum(v for k, v in b1.items() if k != "total"))
    # the MLA history: 24 layers x (context + 2 rows) x 576 x 2 bytes
    assert b128["mla_cache"] == 24 * (131072 + 2) * 576 * 2
    assert b128["weights_dense"] == b1["weights_dense"]
    # one token picks 16 experts per MoE layer: 92 x 16 x 3 x 384 x 3584 x 2 bytes
    assert b1["weights_experts"] == pytest.approx(92 * 16 * 3 * 384 * 3584 * 2)
    replicated = sb.step_bytes(tp8, 1, 1024, tail="replicated")
    # the sharded tail reads 7/8 fewer up_proj rows: 92 x 6272 x 3584 x 2 bytes
    assert replicated["weights_dense"] - b1["weights_dense"] == 92 * 6272 * 3584 * 2


def test_tables_from_records():
    recs = [_rec("b1_32k", "all_on", 10.0), _rec("b1_32k", "all_on", 12.0, mode="eager"),
            _rec("b1_32k", "no_mla_padded", 25.0), _rec("b1_32k", "no_mla_padded", 27.0, mode="eager"),
            _rec("b1_32k", "all_off", 60.0, mode="eager",
                 profile_eager={"launches": 9000, "api_launches": 9000, "kernel_sum_us": 50000.0})]
    wf = ds.waterfall(recs, "b1_32k")
    assert list(wf["variant"]) == ["all_off", "all_on", "no_mla_padded"]
    assert wf.set_index("variant").loc["no_mla_padded", "vs_all_on"] == pytest.approx(1.5)
    assert wf.set_index("variant").loc["all_off", "step_mode"] == "eager"
    m = {r["case"]: r for r in ds.mla_rows(recs)}["b1_32k"]
    assert m["ratio"] == pytest.approx(2.5) and m["seed_ratio"] == pytest.approx(43.8 / 23.6)
    assert ds.gain(recs, "b1_32k", "mla_padded") == pytest.approx(1.5)
    assert ds.gain(recs, "b1_32k", "attn_res_fused") is None
    assert ds.launches(recs, "b1_32k")[0]["kernels"] == 9000
    ds.waterfall_figure(wf, "test")


def test_front_page_rows_say_when_nothing_was_run():
    rows = ds.front_page_rows(records=[])
    assert len(rows) == 7 and all(r["k3lab"] == "not yet run on a GPU" for r in rows)
    assert "43.8 -> 23.6 ms per token (seed, MI355X)" in rows[1]["seed"]
    recs = [_rec("b1_32k", "all_on", 10.0), _rec("b1_32k", "no_mla_padded", 25.0)]
    assert ds.front_page_rows(records=recs)[1]["k3lab"] == "25.00 -> 10.00 ms (2.50x)"


def test_amdahl_reads_the_committed_per_op_records():
    rows = {r["op"]: r for r in ds.amdahl("ctx32k")}
    assert set(rows) >= {"mla", "kda_decode", "attn_res"}
    assert rows["mla"]["calls"] == 24 and rows["mla"]["before_ms"] > rows["mla"]["after_ms"] > 0


def test_study_interface_and_bad_cases():
    assert ds.NAME == "decode_step" and ds.case_names() == list(sb.cases())
    with pytest.raises(ValueError, match="cases must be among"):
        sb.run_cases(["b1_2k"])
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        sb.run_cases(None, repeats=0)
