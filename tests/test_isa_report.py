"""The committed ISA report (profiles/isa/report.json, a full run of `python -m k3lab.isa`) against the
compile entries of today's tree: every entry has its launches compiled for every target the report names,
the report holds no rows of an entry that is gone, it found no problem, and the issue's precisions show
there (the grouped MXFP4 experts on gfx950's scaled MFMA; the FP8-cache and MXFP4 kernels free of spills
on gfx950 and gfx942). Reads JSON only: nothing is compiled here (tests/test_isa.py recompiles)."""

from __future__ import annotations

import copy

import pytest

from k3lab.isa import case_names, problems
from k3lab.isa.coverage import uncovered
from k3lab.profiling.trend import committed_isa_report

AMD = ("gfx950", "gfx942")
NEW_PRECISIONS = ("mla_decode.fp8_cache_", "moe_experts.mxfp4_")


def missing(report: dict) -> list[str]:
    """'<target> <case>' for every compile entry of k3lab.isa.cases with no row for a target the report
    names, and '<target> <case> (no such entry)' for rows of an entry cases.py no longer has."""
    have = {(r["target"], r["case"]) for r in report["rows"]}
    names = case_names()
    out = [f"{t} {c}" for t in report["targets"] for c in names if (t, c) not in have]
    out += sorted({f"{t} {c} (no such entry)" for t, c in have if c not in names})
    return out


@pytest.fixture(scope="module")
def report():
    return committed_isa_report()


def test_every_compile_entry_has_rows_for_every_target(report):
    assert set(report["targets"]) == {"gfx950", "gfx942", "sm90"}
    assert missing(report) == [], ("rerun `python -m k3lab.isa --json profiles/isa/report.json`: "
                                   f"{missing(report)}")


def test_the_committed_report_reaches_every_jit_function_of_the_tree(report):
    """Every @triton.jit function of today's source is compiled in some committed row, itself or inside a
    kernel that calls it: a launch added to an existing entry after the report was written shows here,
    where the entry check above cannot see it."""
    gone = uncovered({r["kernel"] for r in report["rows"]})
    assert gone == [], f"rerun `python -m k3lab.isa --json profiles/isa/report.json`: {gone}"
    assert uncovered(set()) != [] and "k3lab.ops.mla_decode.fp8_cache._write_kernel" in uncovered(
        {r["kernel"] for r in report["rows"] if not r["kernel"].endswith("._write_kernel")})


def test_the_coverage_check_finds_a_dropped_entry(report):
    planted = copy.deepcopy(report)
    planted["rows"] = [r for r in planted["rows"]
                       if not (r["target"] == "gfx942" and r["case"] == "mla_decode.fp8_cache_32k")]
    planted["rows"].append(dict(planted["rows"][0], case="gone.case"))
    assert missing(planted) == ["gfx942 mla_decode.fp8_cache_32k", f"{planted['rows'][0]['target']} "
                                "gone.case (no such entry)"]


def test_the_committed_report_is_clean(report):
    assert report["uncovered"] == [] and report["problems"] == []
    assert problems(report) == []  # recomputed from the rows, not only the stored list
    assert all(r["ok"] for r in report["rows"]), [r["error"] for r in report["rows"] if not r["ok"]]


def test_the_new_precisions_are_free_of_spills_on_amd(report):
    new = [r for r in report["rows"] if r["target"] in AMD and r["case"].startswith(NEW_PRECISIONS)]
    assert {(r["target"], r["case"]) for r in new} == {
        (t, c) for t in AMD for c in case_names() if c.startswith(NEW_PRECISIONS)}
    for r in new:
        assert r["spills"] == 0 and r["scratch_bytes"] == 0 and r["shared_ok"] and r["occupancy"] >= 1, r


def test_grouped_mxfp4_rows_show_the_scaled_mfma_on_gfx950(report):
    grouped = {r["kernel"].rsplit(".", 1)[-1]: r for r in report["rows"]
               if r["target"] == "gfx950" and r["case"] == "moe_experts.mxfp4_t64"}
    assert set(grouped) == {"_scaled_up_kernel", "_scaled_down_kernel"}
    for r in grouped.values():
        assert r["matrix_total"] >= 1 and all(n.startswith("v_mfma_scale_") for n in r["matrix"]), r
    # gfx942 has no scaled MFMA: the case launches the GEMV form there, on the vector units
    gemv = [r for r in report["rows"] if r["target"] == "gfx942" and r["case"] == "moe_experts.mxfp4_t64"]
    assert {r["kernel"].rsplit(".", 1)[-1] for r in gemv} == {"_up_kernel", "_down_kernel"}
    assert all(r["matrix_total"] == 0 for r in gemv)
