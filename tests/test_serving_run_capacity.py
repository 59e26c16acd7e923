"""The serving run's plan (k3lab.serving.plan, serving_run.plan) and the capacity form: the plan's bytes
against the pool's own, its turns per session against the H100's committed quick-form runs, the capacity
form's design (several turns a session; capacity binds at DCP1 and holds at DCP8), the form's CPU path
run through the CLI (the host tier restores, DCP8 keeps what DCP1 drops), the other forms unchanged, and
bad inputs by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine.prefill import SlotCaches
from k3lab.serving.plan import Layout, costs_from_records, plan_run
from k3lab.serving.pool import PrefixPool
from k3lab.serving.run import CacheBudget
from k3lab.studies import serving_run as sr
from k3lab.studies.serving_run import measure as sr_measure

from cpu_child import on_a_cpu

TINY = K3Config.tiny()


@pytest.mark.parametrize("dcp", [1, 8])
@pytest.mark.parametrize("n_in,interval", [(200, 0), (192, 0), (300, 128)])
def test_layout_bytes_are_the_pools(dcp, n_in, interval):
    """Layout's page and checkpoint bytes are PrefixPool's, and a session's bytes are the pages the pool
    uses after storing its prompt (full blocks, grid checkpoints, the end checkpoint with its tail)."""
    sc = SlotCaches(TINY, 2, 400, staging=2, dcp=dcp, device="cpu", dtype=torch.float32)
    pool = PrefixPool(sc, 40e6, 0.0, block_size=64, checkpoint_interval=interval)
    lay = Layout.of(TINY, 4)
    assert lay.page_bytes(dcp) == pool.page_bytes and lay.kda_bytes == pool.kda_bytes
    ids = np.arange(n_in // 64, dtype=np.int64)
    for pos in range(interval, n_in, interval) if interval else ():  # the grid checkpoints a prefill keeps
        pool.store(ids, 0, pos // 64, stage=0, checkpoint=(pos, None))
    tail_of = 999 if n_in % 64 else None
    pool.store(ids, 0, len(ids), stage=0, checkpoint=(n_in, tail_of))
    assert pool.used_pages("gpu") * pool.page_bytes == lay.session_bytes(n_in, dcp, interval)
    assert lay.running_bytes(n_in, dcp) == pool.kda_bytes + -(-n_in // dcp) * lay.row_bytes()


def _sessions_started_at_zero(rec) -> list[int]:
    """Turns of the `concurrency` sessions a run started first (by first arrival)."""
    by: dict[int, list[float]] = {}
    for r in rec.extra["requests"]:
        by.setdefault(r["session"], []).append(r["arrival"])
    first = sorted(by, key=lambda s: (min(by[s]), s))[:int(rec.shape["concurrency"])]
    return [len(by[s]) for s in first]


def test_plan_predicts_the_h100_quick_runs():
    """From the H100's committed quick-form records: the plan's turns per session are the runs' within
    0.35 turns or 15% at every concurrency (c1 ran 9 turns, c16 about one), and where it says capacity
    binds the run evicted (to the host tier or dropped), where it says it holds nothing was evicted."""
    recs = sr.measured(device=sr.PLAN_DEVICE)
    assert len(recs) >= 5, "the H100 quick-form records are committed"
    for rec in recs:
        p = sr.plan(rec.case, "quick", kind="gpu")
        got = float(np.mean(_sessions_started_at_zero(rec)))
        assert abs(p["turns_per_session"] - got) <= max(0.35, 0.15 * got), (rec.case, p, got)
        c = rec.extra["summary"]["cache"]
        evicted = c["to_host_blocks"] + c["dropped_blocks"]
        if p["binds"]:
            assert evicted > 0 and p["need_bytes"] > p["budget_bytes"], (rec.case, c)
        elif rec.shape["concurrency"] <= 8:
            assert evicted == 0 and p["need_bytes"] <= p["budget_bytes"], (rec.case, c)
    costs = costs_from_records(recs)
    assert "tokens/s" in costs.source and costs.prefill_us(8192, 0) > costs.prefill_us(64, 0) > 0


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_capacity_form_binds_at_dcp1_and_holds_at_dcp8(kind):
    """The capacity form's design on each kind: at least 3 turns per session expected in every case; at
    the top concurrency capacity binds at DCP1 (the host tier holds the rest), not at DCP8, and the
    low-concurrency case does not bind; the quick form at c16 gives about one turn (why the form is)."""
    cases = sr.CAPACITY if kind == "gpu" else sr.CPU_CAPACITY
    plans = {c.removeprefix(sr.FORM_PREFIX): sr.plan(c, "capacity", kind=kind) for c in cases}
    top = max(p["concurrency"] for p in plans.values())
    for case, p in plans.items():
        assert p["turns_per_session"] >= 3, (case, p)
    g, h, d = (plans[f"c{top}.{x}"] for x in ("dcp1.gpu_only", "dcp1.host", "dcp8.host"))
    assert g["binds"] and not g["host_holds"] and not g["later_turns_hit"], g
    assert h["binds"] and h["host_holds"] and h["later_turns_hit"], h
    assert not d["binds"] and d["need_bytes"] < 0.8 * d["budget_bytes"] < g["need_bytes"], (d, g)
    low = [p for c, p in plans.items() if p["concurrency"] < top]
    assert low and not any(p["binds"] for p in low), low
    if kind == "gpu":
        assert sr.plan("c16.dcp1.host", "quick", kind="gpu")["turns_per_session"] < 1.5


def test_other_forms_keep_their_setup():
    """The quick, brief and full forms' set-up is what their records were made with."""
    for form in ("quick", "brief", "full"):
        g = sr.form_setup(form, "gpu")
        assert g["checkpoint_interval"] == 2048 and g["cache"] == sr.budget(1 / 16)
        assert (g["limits"]["duration_s"], g["limits"]["drain_s"]) == sr.RUN_S[form]
        assert (g["scale"].context, g["scale"].output, g["scale"].time) == (1 / 16, 1 / 8, 1 / 8)
        assert g["sessions"](16) == 24 and g["overrides"] == {}
        c = sr.form_setup(form, "cpu")
        assert c["limits"] == {"max_requests": 8} and c["cases"] == sr.CPU_CASES and c["sessions"](3) == 2
        assert (c["cache"].gpu_bytes, c["cache"].host_bytes) == sr.CPU_BUDGET
        assert c["checkpoint_interval"] == 128 and c["overrides"] == {"median_turns": 4}
    assert sr.FORM_CASES["quick"] == sr.QUICK and sr.RUN_S["quick"] == (15.0, 10.0)


@on_a_cpu
def test_capacity_form_on_a_cpu(tmp_path):
    """The capacity form's CPU path through the CLI (seconds): four records named and labelled as the
    form's scaled workload; twelve turns over the three sessions at c3, each with later turns; without the
    host tier DCP1 drops blocks and hits little, with it blocks go to the host and come back (restored
    bytes, hits from host-tier blocks); DCP8 evicts nothing and hits as often as DCP1 with the host tier;
    the records stay apart from the curve's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "records.json"
        assert sr.main(["--form", "capacity", "--json", str(out), "--save-dir", str(tmp_path / "p")]) == 0
    finally:
        torch.set_num_threads(threads)
    recs = {r.case: r for r in (bench.Record.from_dict(d) for d in json.loads(out.read_text()))}
    assert list(recs) == list(sr.CPU_CAPACITY)
    for case, r in recs.items():
        assert r.extra["form"] == "capacity" and "capacity form" in r.extra["workload"]
        assert "prompts x" in r.extra["workload"] and "capacity form" in r.extra["describe"]["cache_budget"][
            "source"]
        assert r.shape["checkpoint_interval"] == 0 and r.extra["summary"]["requests"] == 12
        if r.shape["concurrency"] == 3:
            # the twelve requests fall to the three sessions in the order their turns complete (the
            # clock orders them: under load one session may take five and another three), each with
            # later turns that can hit its prefix
            turns = _sessions_started_at_zero(r)
            assert sum(turns) == 12 and min(turns) >= 2, (case, turns)
    cache = {c.removeprefix(sr.FORM_PREFIX): (r.extra["summary"]["cache"], r.extra["summary"]["hit_rate"])
             for c, r in recs.items()}
    (g, g_hit), (h, h_hit), (d, d_hit) = (cache[c] for c in ("c3.dcp1.gpu_only", "c3.dcp1.host",
                                                             "c3.dcp8.host"))
    assert g["dropped_blocks"] > 0 and g["to_host_blocks"] == 0 and g_hit < 0.3, g
    assert h["to_host_blocks"] > 0 and h["restored_host_bytes"] > 0 and h["host_hit_tokens"] > 0, h
    assert h["dropped_blocks"] == 0 and h_hit > g_hit + 0.3, (h, h_hit, g_hit)
    assert d["dropped_blocks"] == 0 and d["to_host_blocks"] == 0 and d_hit > g_hit + 0.3, (d, d_hit, g_hit)
    assert d_hit >= h_hit - 0.05, (d_hit, h_hit)  # what DCP1 needs the host tier for, DCP8 holds on device
    back = sr.measured(root=tmp_path / "p", device="cpu", form="capacity")
    assert sorted(r.case for r in back) == sorted(sr.CPU_CAPACITY)
    assert sr.measured(root=tmp_path / "p", device="cpu") == []  # not the curve's records


def test_bad_inputs_by_name():
    assert sr.parse_case("capacity.c16.dcp8.host") == {"concurrency": 16, "dcp": 8, "host": True,
                                                       "form": "capacity"}
    assert "form" not in sr.parse_case("c16.dcp8.host")
    with pytest.raises(ValueError, match="case must look like"):
        sr.parse_case("capacity.c16.dcp8")
    with pytest.raises(ValueError, match="case must be a string"):
        sr.parse_case(16)
    with pytest.raises(ValueError, match="capacity form's: run them with form='capacity'"):
        sr_measure._form_cases("quick", ["capacity.c4.dcp1.host"])
    assert sr_measure._form_cases("capacity", ["c4.dcp1.host"]) == ["capacity.c4.dcp1.host"]
    with pytest.raises(ValueError, match="form must be one of"):
        sr.form_setup("huge", "gpu")
    with pytest.raises(ValueError, match="kind must be"):
        sr.form_setup("quick", "tpu")
    ss = sr_measure._sessions(["c2.dcp1.host"], sr.form_setup("quick", "cpu"))
    lay, budget = Layout.of(TINY, 4), CacheBudget(6e6, 0.0)
    from k3lab.serving.predict import fixed_clock

    with pytest.raises(ValueError, match="exactly one of clock_s"):
        plan_run(ss, lay, budget, concurrency=2, dcp=1, host=False, costs=fixed_clock((1, 0, 0)))
    with pytest.raises(ValueError, match="dcp 1, 2, 4 or 8"):
        plan_run(ss, lay, budget, concurrency=2, dcp=3, host=False, costs=fixed_clock((1, 0, 0)), clock_s=1.0)
    with pytest.raises(ValueError, match="elsize"):
        Layout.of(TINY, 8)
    with pytest.raises(ValueError, match="at least two serving-run summaries"):
        costs_from_records([])


def _capacity_records():
    return sr.measured(device="nvidia-h100-80gb-hbm3", form="capacity")


def test_the_capacity_table_is_the_committed_records():
    """docs/serving_run.md's capacity table is capacity_markdown of the committed H100 capacity runs, every
    figure recomputed here from the records; where capacity binds (the reference drops blocks), the host
    tier and DCP8 each raise the hit rate and the total tokens/s/GPU, and only the host tier restores."""
    from pathlib import Path

    from k3lab.studies.runs import between
    from k3lab.studies.serving import held_out
    from k3lab.studies.serving_run import tables

    recs = _capacity_records()
    if not recs:
        pytest.skip("no committed capacity-form run of the H100")
    page = (Path(__file__).resolve().parents[1] / "docs" / "serving_run.md").read_text()
    assert between(page, tables.CAPACITY_BEGIN, tables.CAPACITY_END) == held_out.capacity()
    rows = {r["case"]: r for r in tables.capacity_rows(recs)}
    for rec in recs:
        s, row = rec.extra["summary"], rows[rec.case.removeprefix("capacity.")]
        assert row["total_tok_s_gpu"] == s["total_tokens_per_s_gpu"] and row["hit_rate"] == s["hit_rate"]
        assert row["restored_host_gb"] == s["cache"]["restored_host_bytes"] / 1e9
        model = rec.extra.get("model", {})
        assert row["model_term"] == model.get("wrong_term")
        assert row["model ttft_p50_ms err"] == model.get("ttft_p50_ms err")
    ref = rows[tables.CAPACITY_REFERENCE]
    assert ref["dropped_blocks"] > 0 and ref["total_over_reference"] == 1.0
    for case in ("c16.dcp1.host", "c16.dcp8.host"):
        if case in rows:
            r = rows[case]
            assert r["hit_rate"] > ref["hit_rate"] and r["total_over_reference"] > 1.0
            assert r["total_over_reference"] == pytest.approx(r["total_tok_s_gpu"] / ref["total_tok_s_gpu"])
    if "c16.dcp1.host" in rows:
        assert rows["c16.dcp1.host"]["restored_host_gb"] > 0


def test_the_capacity_table_refuses_another_forms_records_and_plants_a_ratio():
    """A quick-form record is refused by name; a capacity record whose total tokens are planted at twice
    the reference's reads 2.00x."""
    import copy

    from k3lab.studies.serving_run import tables

    recs = _capacity_records()
    quick = sr.measured(device="nvidia-h100-80gb-hbm3")
    if not recs or not quick:
        pytest.skip("no committed H100 serving runs")
    with pytest.raises(ValueError, match="capacity-form records"):
        tables.capacity_rows(quick[:1])
    ref = next(r for r in recs if r.case == "capacity." + tables.CAPACITY_REFERENCE)
    other = copy.deepcopy(next(r for r in recs if r is not ref))
    other.extra["summary"]["total_tokens_per_s_gpu"] = 2 * ref.extra["summary"]["total_tokens_per_s_gpu"]
    rows = tables.capacity_rows([ref, other])
    assert rows[1]["total_over_reference"] == pytest.approx(2.0)
    assert "| 2.00x |" in tables.capacity_markdown([ref, other], "nvidia-h100-80gb-hbm3")
