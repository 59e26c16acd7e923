"""Every Triton kernel of k3lab compiled for MI355X (gfx950) and MI300X (gfx942) on this CPU, by Triton's
own AMD backend, at the launch its op picks at TP8 shapes (k3lab.isa). Compiled only: nothing here
runs on AMD hardware or says anything about speed.

The report is held to k3lab/isa/known.py: every problem it finds (a kernel that does not compile,
spills, uses scratch or asks for more LDS than the target has) must be listed there with its cause,
and every listed one must still occur."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from k3lab.isa import asm, coverage, problems, report, targets
from k3lab.isa.known import KNOWN

pytest.importorskip("triton")
AMD = ("gfx950", "gfx942")


@pytest.fixture(scope="module")
def rep():
    return report(",".join(AMD), workers=2)


def rows(rep, case_prefix: str, kernel: str, target: str) -> list[dict]:
    out = [r for r in rep["rows"] if r["case"].startswith(case_prefix) and r["target"] == target
           and (r.get("kernel") or "").endswith("." + kernel)]
    assert out, f"no compile of {kernel} in {case_prefix}* for {target}"
    return out


def test_every_case_compiles_its_launches_on_both_targets(rep):
    """Both targets compile the same launches; the count that compiles is the total less the compile
    failures known.py lists for that target."""
    cases = {r["case"] for r in rep["rows"]}
    for target in AMD:
        listed = [r for r in rep["rows"] if r["target"] == target]
        assert {r["case"] for r in listed} == cases
        assert all(r.get("kernel") for r in listed), [r.get("error") for r in listed if not r.get("kernel")]
        failed = [p for p in problems(rep) if p["target"] == target and p["kind"] == "compile"]
        assert sum(r["ok"] for r in listed) == len(listed) - len(failed)
        assert all(p["known"] for p in failed), [p["text"] for p in failed]


def test_problems_are_exactly_the_known_ones(rep):
    found = problems(rep)
    unknown = [p["text"] for p in found if p["known"] is None]
    assert not unknown, "problems not in k3lab/isa/known.py:\n" + "\n".join(unknown)
    seen = {(p["case"], p["kernel"], p["target"], p["kind"]) for p in found}
    stale = [key for key in KNOWN
             if not any(c.startswith(key[0]) and (k, t, kd) == key[1:] for c, k, t, kd in seen)]
    assert not stale, f"fixed? remove from k3lab/isa/known.py: {stale}"


def test_every_jit_function_is_reached_by_a_compile_entry(rep):
    assert rep["uncovered"] == [], rep["uncovered"]
    graph = coverage.jit_functions()
    launched = {r["kernel"] for r in rep["rows"] if r.get("kernel")}
    assert launched <= set(graph)
    assert "k3lab.ops.mla_decode.triton._split_tile" in coverage.reached(launched, graph)  # a helper


def test_coverage_scan_finds_a_kernel_without_an_entry(tmp_path):
    pkg = tmp_path / "k3lab" / "ops"
    pkg.mkdir(parents=True)
    (pkg / "new_op.py").write_text(
        "import triton\nimport triton.language as tl\n\n"
        "@triton.jit\ndef _helper(x):\n    return x + 1\n\n"
        "@triton.jit(do_not_specialize=['n'])\ndef _kernel(p, n):\n    tl.store(p, _helper(n))\n\n"
        "def outer():\n    @triton.jit\n    def _inner(p):\n        tl.store(p, 1.0)\n    return _inner\n")
    root = tmp_path / "k3lab"
    graph = coverage.jit_functions(root)
    assert set(graph) == {"k3lab.ops.new_op._helper", "k3lab.ops.new_op._kernel",
                          "k3lab.ops.new_op.outer.<locals>._inner"}
    assert coverage.uncovered({"k3lab.ops.new_op._kernel"}, root) == [
        "k3lab.ops.new_op.outer.<locals>._inner"
    ]


def test_padded_mla_after_runs_on_mfma_on_gfx950(rep):
    for r in rows(rep, "mla_decode.after", "_split_kernel", "gfx950"):
        assert r["ok"] and r["matrix"].get("v_mfma_f32_16x16x32_bf16", 0) >= 16, r
        assert r["shared_ok"] and r["spills"] == 0 and r["scratch_bytes"] == 0
    (g942,) = rows(rep, "mla_decode.after_32k", "_split_kernel", "gfx942")
    assert g942["matrix"].get("v_mfma_f32_16x16x16_bf16", 0) >= 16 and g942["shared_ok"]


def test_twelve_head_before_stays_on_the_vector_units(rep):
    """The seed's argument: 12 rows cannot fill a 16-row matrix tile, so the before multiplies on the
    vector units. Triton can rewrite a broadcast-multiply-and-sum into an MFMA dot; for this kernel it
    does not on either target: no MFMA, only vector FMAs, no spills."""
    for target in AMD:
        (r,) = rows(rep, "mla_decode.before", "_before_kernel", target)
        assert r["ok"] and r["matrix_total"] == 0, r["matrix"]
        assert r["fma_lanes_ops"] > 100 and r["spills"] == 0 and r["shared_ok"]


def test_grouped_mxfp4_experts_run_on_the_scaled_mfma_on_gfx950(rep):
    """The issue's precision: for many tokens the MXFP4 experts' grouped tl.dot_scaled launches carry
    their products on gfx950's scaled MFMA only (no bf16 MFMA of an upcast), under whichever Triton
    compiles this report (.ci/triton_next.sh runs this file with the newest one)."""
    for kernel in ("_scaled_up_kernel", "_scaled_down_kernel"):
        (r,) = rows(rep, "moe_experts.mxfp4_t64", kernel, "gfx950")
        assert r["ok"] and r["matrix_total"] >= 1, r
        assert all(name.startswith("v_mfma_scale_") for name in r["matrix"]), r["matrix"]


def test_kda_inverse_keeps_fp32_inputs_on_fp32_mfma(rep):
    """The seed: the prologue's 64 x 64 inverse uses the native 16x16x4 fp32 MFMA (fp32 inputs kept)."""
    for target in AMD:
        for r in rows(rep, "kda_chunk.", "_inverse_kernel", target):
            assert r["ok"] and set(r["matrix"]) == {"v_mfma_f32_16x16x4_f32"}, r["matrix"]


def test_figures_are_read_from_gcn_text():
    text = ("\tv_mfma_f32_16x16x32_bf16 a[0:3], v[0:3], v[4:7], 0\n\tv_pk_fma_f32 v[0:1], v[2:3], v[4:5], "
            "v[6:7]\n\tv_fmac_f32_e32 v1, v2, v3\n; NumVgprs: 130\n; NumAgprs: 4\n; TotalNumSgprs: 40\n"
            "; ScratchSize: 16\n; Occupancy: 3\n    .vgpr_spill_count: 2\n    .sgpr_spill_count: 0\n")
    f = asm.amd_figures(text, 70000, 4, targets.TARGETS["gfx942"])
    assert f["matrix"] == {"v_mfma_f32_16x16x32_bf16": 1} and f["fma_lanes_ops"] == 3
    assert (f["vgprs"], f["agprs"], f["sgprs"], f["scratch_bytes"], f["spills"]) == (130, 4, 40, 16, 2)
    assert f["shared_ok"] is False and f["occupancy"] == 0  # 70000 B of LDS: no workgroup fits in 64 KiB
    assert targets.amd_waves_per_simd(targets.TARGETS["gfx950"], 128, 0, 0, 4) == 4
    assert targets.nvidia_blocks_per_sm(targets.TARGETS["sm90"], 128, 0, 4) == 4


def test_a_hung_worker_becomes_an_error_row_not_a_crash():
    from k3lab.isa.runner import compile_all

    out = compile_all(["gfx950"], ["launch_overhead.empty_triton"], workers=1, timeout_s=0.01,
                      use_cache=False)
    assert len(out) == 1 and out[0]["ok"] is False and "no answer within" in out[0]["error"]


def test_workers_see_no_gpu_and_refuse_one(monkeypatch):
    """The report compiles for the target, not this machine: its workers start with every device
    hidden, and a worker that still sees a GPU refuses to start (its ops would run their GPU-only
    steps and pick this machine's launches)."""
    import torch

    from k3lab.isa import runner, worker

    env = runner.worker_env()
    assert {env[k] for k in runner.HIDE_DEVICES} == {""} and env["TRITON_INTERPRET"] == "0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a visible GPU")
    with pytest.raises(RuntimeError, match="sees a GPU"):
        worker.Worker("gfx950")


def test_bad_targets_and_cases_are_refused_by_name():
    with pytest.raises(ValueError, match="gfx950"):
        targets.parse_targets("gfx90a")
    with pytest.raises(ValueError, match="cases must name"):
        report("gfx950", "no_such_op")


# ---------------------------------------------------------------------------------------------- AITER

PROFILES = Path(__file__).resolve().parents[1] / "profiles" / "isa"
EXPECTED_POSITIONAL = ["q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                       "max_seqlen_q"]


def _aiter_call():
    """k3lab's call of mla_decode_fwd in peers.aiter_decode, read with ast: (positional count, keyword
    names always passed, keyword names passed only when `"name" in params`)."""
    src = (Path(__file__).resolve().parents[1] / "k3lab" / "ops" / "mla_decode" / "peers.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name
              == "aiter_decode")
    (call,) = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "mla_decode_fwd"]
    always = {k.arg for k in call.keywords if k.arg}
    for node in ast.walk(fn):  # kwargs = dict(sm_scale=...), splatted into the call
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "kwargs":
            always |= {k.arg for k in node.value.keywords}
    gated = set()
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Constant)
        ):
            gated.add(node.test.left.value)
    return len(call.args), always, gated


def test_aiter_inventory_has_no_twelve_head_decode():
    """Why 12 heads missed AITER's assembly decode and 16 reach it: its dispatcher takes 16 or 128 query
    heads per cache head, and every gfx950 decode code object is built for one of those."""
    inv = json.loads((PROFILES / "aiter_mla_inventory.json").read_text())
    prov = inv["provenance"]
    assert prov["version"] == "0.1.7.post2.dev18" and len(prov["sha256"]) == 64
    assert inv["dispatch_query_heads_per_kv_head"] == [16, 128]
    dec = [k for k in inv["kernels"] if k["arch"] == "gfx950" and k["family"] == "decode"]
    assert dec and {k["query_heads"] for k in dec} == {16, 128}
    (one,) = [k for k in dec if k["file"] == "mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co"]
    assert (one["lds_bytes"], one["vgprs"], one["wave"], one["workgroup_threads"]) == (65536, 512, 64, 256)
    assert all(k["lds_bytes"] <= 160 * 1024 and k["scratch_bytes"] == 0 for k in dec)


def test_k3lab_aiter_call_matches_the_wheel_signature():
    sig = json.loads((PROFILES / "aiter_mla_signature.json").read_text())
    names = [p["name"] for p in sig["params"]]
    npos, always, gated = _aiter_call()
    assert npos == len(EXPECTED_POSITIONAL) and names[:npos] == EXPECTED_POSITIONAL
    assert all(p["default"] is None for p in sig["params"][:npos])  # required, in this order
    assert always <= set(names), always - set(names)
    assert gated == {"page_size"}  # passed only where the installed version has it
    assert "page_size" not in names and "return_lse" not in names  # this version has neither


def test_aiter_lse_fact_for_the_non_persistent_decode():
    """In this version mla_decode_fwd returns (logits, final_lse) and only mla_reduce_v1 (the persistent
    path, taken when work_meta_data is given) writes final_lse; k3lab's call passes no work list, so
    the second value it reads back is not the decode's log-sum-exp (docs/mi355x.md)."""
    sig = json.loads((PROFILES / "aiter_mla_signature.json").read_text())
    assert "(logits, final_lse)" in sig["returns"]
    assert sig["final_lse_passed_to"] == ["aiter.mla_reduce_v1"]
    assert "work_meta_data" not in _aiter_call()[1]
    # so k3lab's AITER path returns no lse: every return of aiter_decode is (o, None)
    src = (Path(__file__).resolve().parents[1] / "k3lab" / "ops" / "mla_decode" / "peers.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name
              == "aiter_decode")
    rets = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)]
    assert rets and all(isinstance(r, ast.Tuple) and ast.unparse(r.elts[1]) == "None" for r in rets)
