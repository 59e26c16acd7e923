"""docs/mi355x.md's per-op table, generated from the committed ISA report (profiles/isa/report.json).

`ROWS` holds each row as text with every compile figure written as a token `<<SELECTION|SPEC>>`:
SELECTION is `TARGET CASES INDEX FIELD`, the report's rows of compile target TARGET (gfx950, gfx942,
sm90), of the cases CASES (comma-separated ISA-report case names, each optionally `case:kernel`, the
kernel function's name), launch INDEX (a number, or `*` for every launch of the case), and FIELD a row's
field (`vgprs`, `agprs`, `occupancy`, `num_warps`, `num_stages`, `fma_lanes_ops`, `matrix_total`...),
`matrix.INSTRUCTION`, `kib` (shared memory in KiB) or `grid0` (programs along the grid's first axis).
SPEC formats the value: a Python format spec when every selected row agrees on one value, `range`
('lo-hi'), `yes` ('yes' when every selected launch compiled, else 'no'), `spills` ('no spills' or the
count). `markdown()` renders the table and the count under it; `python -m k3lab.studies.mi355x_table
--write` rewrites it in docs/mi355x.md between `TABLE_BEGIN` and `TABLE_END`; tests/test_mi355x_table.py
checks the doc's text is the rendered one and that no figure in a row is typed outside a token, except
`TYPED_FIGURES` (each with why no committed record holds it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from k3lab.studies.runs import between, section_main, write_between

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "profiles" / "isa" / "report.json"
DOC = REPO / "docs" / "mi355x.md"
TABLE_BEGIN = "<!-- MI355X table: python -m k3lab.studies.mi355x_table --write -->"
TABLE_END = "<!-- end of MI355X table -->"
TOKEN = re.compile(r"<<([^|<>]+)\|([^<>]*)>>")
HEADER = ("op", "runs on MI355X", "compiled for gfx950", "notes")
# Figures no committed record holds, typed, each with why: the HIP C++ kernels' (scripts/compile_hip.sh's
# output is not committed) and a form the report no longer compiles
_DECODE_HIP, _VERIFY_HIP = "6 configs, ≤ 160 VGPRs, ≤ 11.6 KiB LDS", "32 configs, ≤ 158 VGPRs"
TYPED_FIGURES: dict[str, str] = {
    _DECODE_HIP: "kernels/kda_decode.cu compiled by scripts/compile_hip.sh",
    _VERIFY_HIP: "kernels/kda_verify.cu compiled by scripts/compile_hip.sh",
    "128 spilled 192 registers": "the sort's 128-pair form, which sort_block_cap keeps from being compiled",
}


def _t(selection: str, spec: str = "d") -> str:
    return f"<<{selection}|{spec}>>"


_MLA_B, _MLA_A = "gfx950 mla_decode.before 0 ", "gfx950 mla_decode.after_32k 0 "
_KDA = "gfx950 kda_chunk.after_16k 0 "
_DOWN = "moe_experts.grouped_t1:_down_row_kernel,moe_experts.tail_t1"
_GEMV = "gemv.router,gemv.fp8_o_proj,gemv.stack_moe,gemv.glu_shared_down"
_MOE = "moe_experts.grouped_t1,moe_experts.grouped_t64,moe_experts.tail_t1,moe_experts.tail_t256"
_VA, _VB = "gfx950 kda_verify.after_b1_t4 0 ", "gfx950 kda_verify.before_b1_t4 0 "
_FP8 = "mla_decode.fp8_cache_1k,mla_decode.fp8_cache_32k,mla_decode.fp8_cache_verify_4"
_FP8_SPLIT = ",".join(f"{c}:_fp8_split_kernel" for c in _FP8.split(","))
_FP8_WRITE = ",".join(f"{c}:_write_kernel" for c in _FP8.split(","))
_FP8_32K = "gfx950 mla_decode.fp8_cache_32k:_fp8_split_kernel * "
_MX = "moe_experts.mxfp4_t1,moe_experts.mxfp4_t1_flat,moe_experts.mxfp4_t64"
_MX_UP, _MX_DOWN = ("gfx950 moe_experts.mxfp4_t64:_scaled_up_kernel * ",
                    "gfx950 moe_experts.mxfp4_t64:_scaled_down_kernel * ")
_MX_GEMV = "moe_experts.mxfp4_t1,moe_experts.mxfp4_t1_flat"
_SCALED_MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"

ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("MLA decode, before",
     f"Triton `_before_kernel` ({_t(_MLA_B + 'grid0')} programs at B = 1)",
     f"{_t('gfx950 mla_decode.before * ok', 'yes')}: {_t(_MLA_B + 'matrix_total')} MFMA, "
     f"{_t(_MLA_B + 'fma_lanes_ops')} vector FMAs, {_t(_MLA_B + 'vgprs')} VGPRs, "
     f"{_t(_MLA_B + 'kib', 'kib')} KiB LDS, {_t(_MLA_B + 'occupancy')} waves/SIMD",
     "`mla_decode_before.cu` has a HIP build (gfx942 and gfx950 compile) that the dispatch does not use on "
     "ROCm"),
    ("MLA decode, after",
     "Triton `_split_kernel` + `_merge_kernel`; AITER's assembly decode when forced "
     "(`K3LAB_MLA_DECODE_BACKEND=aiter`; no lse, below)",
     f"{_t('gfx950 mla_decode.after_1k,mla_decode.after_32k,mla_decode.after_128k * ok', 'yes')}: "
     f"{_t(_MLA_A + 'matrix.v_mfma_f32_16x16x32_bf16')} `v_mfma_f32_16x16x32_bf16`, "
     f"{_t(_MLA_A + 'kib', 'kib')} KiB LDS ({_t(_MLA_A + 'num_stages')} stages), "
     f"{_t(_MLA_A + 'vgprs')} + {_t(_MLA_A + 'agprs')} VGPR/AGPR, "
     f"{_t(_MLA_A + 'occupancy')} wave/SIMD, {_t(_MLA_A + 'grid0')} programs at 32K",
     "verify groups: one token per program on AMD (below). `mla_decode.cu` is a HIP stub"),
    ("MLA decode, FP8 latent cache (`fp8_cache.plan_fp8`)",
     "Triton `_fp8_split_kernel` (E4M3 tiles converted in the load, one scale per cache tensor); the step's "
     "new rows rounded and written by `_write_kernel` (one launch), a split history's partials merged by "
     "the bf16 decode's `_merge_kernel`",
     f"{_t(f'gfx950 {_FP8} * ok', 'yes')}: "
     f"{_t(_FP8_32K + 'matrix.v_mfma_f32_16x16x32_bf16')} `v_mfma_f32_16x16x32_bf16`, "
     f"{_t(_FP8_32K + 'kib', 'kib')} KiB LDS, {_t(_FP8_32K + 'vgprs')} + {_t(_FP8_32K + 'agprs')} VGPR/AGPR, "
     f"{_t(_FP8_32K + 'occupancy')} wave/SIMD, {_t(_FP8_32K + 'grid0')} programs at 32K; the writer "
     f"{_t(f'gfx950 {_FP8_WRITE} * vgprs', 'range')} VGPRs; {_t(f'gfx950 {_FP8} * spills', 'spills')}",
     f"gfx942: the split kernel {_t(f'gfx942 {_FP8_SPLIT} * vgprs', 'range')} + "
     f"{_t(f'gfx942 {_FP8_SPLIT} * agprs', 'range')} VGPR/AGPR, "
     f"{_t(f'gfx942 {_FP8} * spills', 'spills')}; verify groups: one token per program on AMD"),
    ("MLA decode, DCP merge", "torch, or Triton `merge._merge_kernel`",
     _t("gfx950 mla_decode.dcp_merge * ok", "yes"), ""),
    ("KDA prefill (chunk)",
     "Triton prologue (`_a_kernel`, `_inverse_kernel`, `_wu_kernel`), walks (`_walk_kernel`, "
     "`_summary_kernel`), `_scan_kernel`",
     f"{_t('gfx950 kda_chunk.after_16k * ok', 'yes')}, with exact fp32 products where NVIDIA and gfx942 "
     "take tf32: "
     f"the prologue's main pass on {_t(_KDA + 'matrix.v_mfma_f32_16x16x4_f32')} `v_mfma_f32_16x16x4_f32`, "
     f"{_t(_KDA + 'kib', 'kib')} KiB LDS; its fix-up pass (`_fixup_kernel`) has no loop over rows and "
     f"{_t('gfx950 kda_chunk.after_16k:_fixup_kernel * spills', 'spills')} (below)",
     "`kda_chunk_prologue.cu` and `kda_chunk_walk.cu` are HIP stubs"),
    ("KDA decode, after", "HIP `kda_decode.cu` (built by `_build` with hipcc for the device)",
     f"gfx950 through retargeted IR: {_DECODE_HIP}, no scratch; gfx942 code object the same", ""),
    ("KDA decode, before",
     "Triton `_conv_silu_kernel`, `_norm_gates_recurrence_kernel`, `_gated_rms_norm_kernel`",
     f"{_t('gfx950 kda_decode.before_b1,kda_decode.before_b128 * ok', 'yes')} (the conv kernel in its "
     "per-input-branch form on AMD, below)", ""),
    ("KDA verify",
     "Triton `verify_narrow_kernel` / `verify_stream_kernel` (the CUDA kernel runs on CUDA devices only)",
     f"{_t('gfx950 kda_verify.after_b1_t4,kda_verify.before_b1_t4 * ok', 'yes')} "
     f"({_t(_VA + 'vgprs')} / {_t(_VB + 'vgprs')} VGPRs, "
     f"{_t(_VA + 'occupancy')} / {_t(_VB + 'occupancy')} waves/SIMD)",
     f"`kda_verify.cu` compiles for gfx942 and gfx950 ({_VERIFY_HIP}) but is not dispatched on ROCm"),
    ("AttnRes + RMSNorm", "Triton `_attn_res_norm_kernel` (the cluster kernel is NVIDIA-only)",
     f"{_t('gfx950 attn_res_norm.t1,attn_res_norm.t64,attn_res_norm.t8192 * ok', 'yes')}; "
     "the 1- and 64-token "
     f"config on {_t('gfx950 attn_res_norm.t1,attn_res_norm.t64 0 num_warps')} waves there (below): "
     f"{_t('gfx950 attn_res_norm.t1,attn_res_norm.t64 0 vgprs')} VGPRs, "
     f"{_t('gfx950 attn_res_norm.t1,attn_res_norm.t64 0 spills', 'spills')}",
     "`attn_res_norm.cu` is a HIP stub"),
    ("MoE routed experts, tail",
     "Triton `_up_kernel`, `_down_kernel` (one token: `_down_row_kernel`, a GEMV over the chosen experts' "
     "columns); the tail's `_norm_kernel` and a torch matmul (one token: `_tail_row_kernel`, one launch)",
     f"{_t(f'gfx950 {_MOE} * ok', 'yes')}: the expert kernels on `v_mfma_f32_16x16x32_bf16`; "
     "the one-token down and tail launches on vector units, "
     f"every autotuner shape {_t(f'gfx950 {_DOWN} * vgprs', 'range')} VGPRs, "
     f"{_t(f'gfx950 {_DOWN} * spills', 'spills')}", ""),
    ("MoE routed experts, MXFP4 (`mxfp4_kernels`)",
     "Triton `_up_kernel`, `_down_kernel` (GEMVs over the E2M1 codes and E8M0 block scales, dequantized in "
     "registers; `_down_flat_kernel` the down launch's flat form); for many tokens where the target has "
     "scaled matrix instructions, `_scaled_up_kernel`, "
     "`_scaled_down_kernel` on `tl.dot_scaled` (activations as MXFP8)",
     f"{_t(f'gfx950 {_MX} * ok', 'yes')}: the grouped form on the scaled MFMA, "
     f"{_t(f'{_MX_UP}matrix.{_SCALED_MFMA}')} / {_t(f'{_MX_DOWN}matrix.{_SCALED_MFMA}')} `{_SCALED_MFMA}` "
     f"and {_t(_MX_UP + 'vgprs')} / {_t(_MX_DOWN + 'vgprs')} VGPRs (up / down); the GEMV launches "
     f"{_t(f'gfx950 {_MX_GEMV} * vgprs', 'range')} VGPRs, {_t(f'gfx950 {_MX} * spills', 'spills')}",
     "gfx942 has no scaled MFMA and Triton 3.6.0 does not lower `tl.dot_scaled` there (\"Unsupported "
     "DotScaleOp\"): the GEMV form at every token count, "
     f"{_t(f'gfx942 {_MX} * vgprs', 'range')} VGPRs, {_t(f'gfx942 {_MX} * spills', 'spills')}"),
    ("MoE router + expert sort (decode step's `glue_fused`)",
     "Triton `_route_sort_kernel` (one launch, up to 32 pairs), else `_topk_kernel`, `_sort_kernel`",
     f"{_t('gfx950 moe_router.route_t1,moe_router.route_t2,moe_router.route_t64 * ok', 'yes')}: "
     f"{_t('gfx942 moe_router.route_t1 0 vgprs')} / {_t('gfx942 moe_router.route_t64 0 vgprs')} / "
     f"{_t('gfx942 moe_router.route_t64 1 vgprs')} VGPRs on gfx942, "
     f"{_t('gfx942 moe_router.route_t1,moe_router.route_t64 * spills', 'spills')}; "
     "the sort takes 32 pairs per pass on 64-lane waves (128 spilled 192 registers there; "
     "`moe_router.triton.sort_block_cap`)", ""),
    ("SiTU-GLU (decode step's `glue_fused`)", "Triton `_situ_glu_kernel`",
     f"{_t('gfx950 situ_glu.shared_expert * ok', 'yes')}: "
     f"{_t('gfx950 situ_glu.shared_expert 0 vgprs')} VGPRs",
     ""),
    ("one-row projections (decode step's `projections=\"gemv\"` / `\"fp8\"`)",
     "Triton `_gemv_kernel` (bf16, FP8 with row scales, SiTU-GLU in the load), `_stack_kernel` (a MoE "
     "layer's three input products in one launch), blocks autotuned on the device among `gemv.AMD_BLOCKS`",
     f"{_t(f'gfx950 {_GEMV} * ok', 'yes')}: the four AMD shapes, "
     f"{_t(f'gfx950 {_GEMV} * vgprs', 'range')} VGPRs, {_t(f'gfx950 {_GEMV} * spills', 'spills')} "
     "(wider tiles spill on gfx942 under Triton 3.9, below)",
     ""),
    ("MLA glue (decode step's `glue_fused`)",
     "Triton `_norms_kernel`, `_absorb_q_kernel`, `_out_gate_kernel` (k3lab.ops.mla_glue)",
     f"{_t('gfx950 mla_glue.norms,mla_glue.absorb_q,mla_glue.out_gate * ok', 'yes')}: "
     f"{_t('gfx950 mla_glue.norms 0 vgprs')} / {_t('gfx950 mla_glue.absorb_q 0 vgprs')} / "
     f"{_t('gfx950 mla_glue.out_gate 0 vgprs')} VGPRs, "
     f"{_t('gfx950 mla_glue.norms,mla_glue.absorb_q,mla_glue.out_gate * spills', 'spills')}", ""),
)
COUNT = ("Count: of <<count kernels|d>> Triton kernel functions launched by the ops and the workshop's "
         "solutions (<<count launches|d>> launches per AMD target), <<count compiled|d>> compile for gfx950, "
         "gfx942 and "
         "sm90 with Triton <<count triton|s>> (the committed report; `.ci/triton_next.sh` compiles them with "
         "3.9.0) and <<count partial|d>> are launched on some targets only and compile on each of them "
         "(the grouped form of the MXFP4 experts, which gfx942 does not launch); on both AMD targets "
         "<<count clean|d>> of the "
         "<<count launches|d>> launches are free of spills, scratch and LDS over budget.")
# The workshop's ladder puzzles are in the report but not in the count (docs/mi355x.md gives them a
# paragraph of their own)
UNCOUNTED = ("workshop.ladder",)


def load_report(path: Path = REPORT) -> dict:
    return json.loads(Path(path).read_text())


def _select(selection: str, report: dict) -> tuple[list[dict], str]:
    """The report's rows a selection names and its field; ValueError naming the selection when it is
    malformed or names no row."""
    parts = selection.split()
    if len(parts) != 4:
        raise ValueError(f"a selection is 'TARGET CASES INDEX FIELD', got {selection!r}")
    target, cases, index, field = parts
    if index != "*" and not index.isdigit():
        raise ValueError(f"index must be a number or '*' in {selection!r}")
    rows = []
    for spec in cases.split(","):
        case, _, kernel = spec.partition(":")
        found = [r for r in report["rows"] if r["target"] == target and r["case"] == case
                 and (index == "*" or r["index"] == int(index))
                 and (not kernel or r["kernel"].rsplit(".", 1)[-1] == kernel)]
        if not found:
            raise ValueError(f"no report row for {target} {spec} launch {index} (selection {selection!r})")
        rows += found
    return rows, field


def _field(row: dict, field: str, selection: str):
    if field == "kib":
        return row["shared_bytes"] / 1024
    if field == "grid0":
        return row["grid"][0]
    if field.startswith("matrix."):
        return row["matrix"].get(field.split(".", 1)[1], 0)
    if field not in row:
        raise ValueError(f"field {field!r} of {selection!r} is not a report field")
    return row[field]


def _count(what: str, report: dict):
    counted = [r for r in report["rows"] if r["case"] not in UNCOUNTED]
    amd = [r for r in counted if r["target"] in ("gfx950", "gfx942")]
    per_target = {t: [r for r in counted if r["target"] == t] for t in ("gfx950", "gfx942", "sm90")}
    if what == "triton":
        return report["triton"]
    if what == "kernels":
        return len({r["kernel"] for r in counted})
    if what == "compiled":
        ok = [{r["kernel"] for r in rows if r["ok"]} for rows in per_target.values()]
        return len(set.intersection(*ok))
    if what == "partial":  # launched on some targets only, and compiled wherever launched
        launched = [{r["kernel"] for r in rows} for rows in per_target.values()]
        some = set.union(*launched) - set.intersection(*launched)
        return len(some - {r["kernel"] for r in counted if not r["ok"]})
    launches = {len(per_target[t]) for t in ("gfx950", "gfx942")}
    if what == "launches":
        if len(launches) != 1:
            raise ValueError(f"the AMD targets differ in launches: {sorted(launches)}")
        return launches.pop()
    if what == "clean":
        clean = [r for r in amd if r["ok"] and not r["spills"] and not r["scratch_bytes"] and r["shared_ok"]]
        return min(sum(1 for r in clean if r["target"] == t) for t in ("gfx950", "gfx942"))
    raise ValueError(f"unknown count {what!r}")


def render_token(selection: str, spec: str, report: dict) -> str:
    """One token's text (the module docstring says the grammar)."""
    if selection.startswith("count "):
        return format(_count(selection.split(" ", 1)[1], report), spec)
    rows, field = _select(selection, report)
    if spec == "yes":
        return "yes" if all(r["ok"] for r in rows) else "no"
    values = [_field(r, field, selection) for r in rows]
    if spec == "spills":
        n = sum(values)
        return "no spills" if n == 0 else f"{n} spills"
    if spec == "range":
        lo, hi = min(values), max(values)
        return f"{lo}" if lo == hi else f"{lo}-{hi}"
    if len(set(values)) != 1:
        raise ValueError(f"{selection!r} selects several values {sorted(set(values))}: use 'range'")
    v = values[0]
    if spec == "kib":
        return f"{v:.0f}" if v == int(v) else f"{v:.1f}"
    return format(v, spec)


def render(text: str, report: dict) -> str:
    return TOKEN.sub(lambda m: render_token(m.group(1).strip(), m.group(2), report), text)


def markdown(report: dict | None = None) -> str:
    """The table and the count under it, as docs/mi355x.md shows them."""
    report = load_report() if report is None else report
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(render(cell, report) for cell in row) + " |" for row in ROWS]
    return "\n".join(lines) + "\n\n" + render(COUNT, report) + "\n"


def doc_table(text: str) -> str:
    """The doc's generated section ('' when the markers are absent)."""
    return between(text, TABLE_BEGIN, TABLE_END)


def write_doc(path: Path = DOC) -> bool:
    """Rewrite the table between the markers; True when the file changed."""
    return write_between(path, TABLE_BEGIN, TABLE_END, markdown())


def main(argv: list[str] | None = None) -> int:
    section_main(argv, prog="python -m k3lab.studies.mi355x_table", doc=__doc__, what="MI355X table",
                 markdown=markdown, write=write_doc, target="docs/mi355x.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
