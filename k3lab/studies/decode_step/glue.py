"""The step's glue kernels, each against its torch path at the step's shapes: the fused router + expert
sort (k3lab.ops.moe_router, K3's E = 896, top_k = 16, N = 1 and 64 tokens) and SiTU-GLU
(k3lab.ops.situ_glu at the TP8 widths, N = 1 and 64 rows). The `glue_fused` switch turns both on in
the whole step; here each is timed alone. Beside them, one token's routed experts alone
(`expert_records`): bf16 against MXFP4, and the MXFP4 one-token launches' block choices (`EXPERT_SWEEP`),
the part of the article-precision step that its targets miss on (docs/decode_step.md). The router's
two Triton forms are also timed against each other at every size (`launch_records`): one launch
(route and sort in one program) against two (a top-k program per token, then the sort), both forced,
so the records show where route_and_sort's bound (moe_router.FUSED_PAIRS) should sit and which top-k
width (warps) is quickest.

    k3lab bench decode_step --cases glue --json F      (GPU; records of study decode_step, cases glue.*)

Each case is checked before it is timed: the router's two paths must pick the same experts in the
same order, weights within 1e-5 relative, and the same ExpertSort; SiTU-GLU's Triton path must match
the fp64 reference and the torch path within bf16 bounds. Then each path is timed under a CUDA graph
(k3lab.bench.time_fn, graph=True: the cost of a call inside a long graph, as the step replays it).
Records: variant 'before' = the torch path, 'after' = the Triton path; cases
glue.moe_router.N<n> and glue.situ_glu.<width>_N<n>; and glue.moe_router.launches.N<n>.w<warps>:
'before' = the two launches, 'after' = the one launch, the top-k at <warps> warps, each checked
against the torch path first. `router_table` prints the router's records as one table. GPU only: on a
CPU nothing is measured.
"""

from __future__ import annotations

import torch

from k3lab import bench
from k3lab.ops.moe_experts.inputs import default_block_m
from k3lab.ops.moe_router import route_and_sort
from k3lab.ops.moe_router import triton as router
from k3lab.ops.situ_glu import situ_glu_stacked, widths

from .measure import NAME

PREFIX = "glue."  # case prefix of these records
E, TOP_K, SCALING = 896, 16, 2.5
SORT_FIELDS = ("pair_of_row", "tile_expert", "n_tiles", "counts")
VARIANTS = (("before", "torch"), ("after", "triton"))
LAUNCH_SIZES = (1, 2, 4, 8, 64)  # tokens: both sides of FUSED_PAIRS at top-16, and B = 64
# top-k widths tried at these sizes (elsewhere router.default_topk_warps())
SWEEP_SIZES, SWEEP_WARPS = (1, 8), (4, 8, 16)


def _router_inputs(n_tokens: int, seed: int, device: str):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n_tokens, E, device=device, generator=gen) * 2
    bias = torch.randn(E, device=device, generator=gen) * 0.05
    return logits, bias, default_block_m(n_tokens, TOP_K, E)


def _compare(ref, got) -> dict:
    """The check dict of one router result `got` against the torch path's `ref` (weights, idx, sort)."""
    (w0, i0, s0), (w1, i1, s1) = ref, got
    chk = {"idx_equal": bool(torch.equal(i0, i1)),
           "weights_max_rel": float(((w1 - w0).abs() / w0.abs()).max()),
           "sort_equal": {f: bool(torch.equal(getattr(s0, f), getattr(s1, f))) for f in SORT_FIELDS}}
    chk["ok"] = chk["idx_equal"] and chk["weights_max_rel"] <= 1e-5 and all(chk["sort_equal"].values())
    return chk


def router_check(n_tokens: int, seed: int = 0, device: str = "cuda") -> tuple[dict, tuple]:
    """(check dict, call arguments) for one batch: both paths run once on the same fresh logits. The
    check's 'ok' is False when the experts, their order, the weights or the sort differ."""
    logits, bias, m = _router_inputs(n_tokens, seed, device)
    out = {b: route_and_sort(logits, bias, TOP_K, scaling=SCALING, block_m=m, backend=b) for _, b in VARIANTS}
    return _compare(out["torch"], out["triton"]), (logits, bias, m)


def router_records(sizes=(1, 64), device: str = "cuda", repeats: int = 100) -> list[bench.Record]:
    """Two records per batch size (torch 'before', triton 'after'), after `router_check`; a failed check
    is a bench.CheckFailed naming the batch, before anything is timed."""
    out = []
    for n in sizes:
        chk, (logits, bias, m) = router_check(n, device=device)
        if not chk["ok"]:
            raise bench.CheckFailed(f"moe_router at N = {n}: the triton path differs from torch: {chk}")
        for variant, b in VARIANTS:
            t = bench.time_fn(lambda b=b: route_and_sort(logits, bias, TOP_K, scaling=SCALING, block_m=m,
                                                         backend=b),
                              graph=device != "cpu", device=device, repeats=repeats, warmup=2)
            out.append(bench.make_record(NAME, f"{PREFIX}moe_router.N{n}", variant, t,
                                         shape={"tokens": n, "experts": E, "top_k": TOP_K, "block_m": m},
                                         dtype=logits.dtype, error=chk, backend_used=b))
    return out


def launch_forms(logits, bias, m, warps: int) -> dict:
    """{'before': the two launches, 'after': the one launch} as calls, the top-k at `warps` warps."""
    def two():
        weights, idx = router.topk_weights(logits, bias, TOP_K, SCALING, True, topk_warps=warps)
        return weights, idx, router.sort_pairs(idx, E, m)

    return {"before": two,
            "after": lambda: router.route_sort(logits, bias, TOP_K, SCALING, True, m, topk_warps=warps)}


def launch_records(sizes=LAUNCH_SIZES, device: str = "cuda", repeats: int = 100) -> list[bench.Record]:
    """The router's one launch against its two, forced, per batch size (and per top-k width at
    SWEEP_SIZES): each form checked against the torch path on the same fresh logits (bench.CheckFailed
    naming the form and size, before anything is timed), then timed as `router_records` times."""
    out = []
    for n in sizes:
        logits, bias, m = _router_inputs(n, seed=n, device=device)
        ref = route_and_sort(logits, bias, TOP_K, scaling=SCALING, block_m=m, backend="torch")
        for w in SWEEP_WARPS if n in SWEEP_SIZES else (router.default_topk_warps(),):
            forms = launch_forms(logits, bias, m, w)
            checks = {v: _compare(ref, f()) for v, f in forms.items()}
            for v, chk in checks.items():
                if not chk["ok"]:
                    form = "one launch" if v == "after" else "two launches"
                    raise bench.CheckFailed(f"moe_router {form} at N = {n}, {w} warps: differs from torch: "
                                            f"{chk}")
            for v, f in forms.items():
                t = bench.time_fn(f, graph=device != "cpu", device=device, repeats=repeats, warmup=2)
                out.append(bench.make_record(
                    NAME, f"{PREFIX}moe_router.launches.N{n}.w{w}", v, t,
                    shape={"tokens": n, "experts": E, "top_k": TOP_K, "block_m": m, "topk_warps": w},
                    dtype=logits.dtype, error=checks[v], backend_used="triton",
                    launches=2 if v == "before" else 1, fused_pairs=router.FUSED_PAIRS))
    return out


def router_table(records) -> str:
    """The router's records as a text table: per batch size and top-k width, us per call of the torch
    path, the two launches and the one launch, and the form route_and_sort takes there."""
    got = {(r.case, r.variant): r.median_us for r in records}
    rows = sorted({(r.shape["tokens"], r.shape.get("topk_warps")) for r in records
                   if r.case.startswith(f"{PREFIX}moe_router.launches.")})
    lines = [f"{'N':>4} {'warps':>5} {'torch':>9} {'2 launches':>11} {'1 launch':>9}  route_and_sort takes"]
    for n, w in rows:
        case = f"{PREFIX}moe_router.launches.N{n}.w{w}"
        torch_us = got.get((f"{PREFIX}moe_router.N{n}", "before"))
        cells = [f"{x:9.2f}" if x is not None else f"{'':>9}" for x in
                 (torch_us, got.get((case, "before")), got.get((case, "after")))]
        takes = "1 launch" if n * TOP_K <= router.FUSED_PAIRS else "2 launches"
        lines.append(f"{n:>4} {w:>5} {cells[0]}   {cells[1]} {cells[2]}  {takes}")
    return "\n".join(lines)


def situ_glu_records(rows=(1, 64), dtype=torch.bfloat16) -> list[bench.Record]:
    """Two records per (TP8 width, row count): torch 'before', triton 'after', each a call as the step
    makes it (no out=: the result allocated from the graph's pool), after checking the Triton path
    against the fp64 reference and the torch path. Inputs stay hot in L2, as the matmul that produces gu
    in the step leaves them."""
    out = []
    for what, f in widths().items():
        for n in rows:
            gu = torch.randn(n, 2 * f, device="cuda", dtype=dtype) * 8
            ref = situ_glu_stacked(gu.double(), backend="torch")
            fast = situ_glu_stacked(gu, backend="triton")
            torch.testing.assert_close(fast.double(), ref, rtol=2 ** -8, atol=1e-6)
            torch.testing.assert_close(fast, situ_glu_stacked(gu, backend="torch"), rtol=2 ** -7, atol=1e-6)
            err = {"max_abs_vs_fp64": float((fast.double() - ref).abs().max()),
                   "bounds": "rtol 2^-8 against fp64, 2^-7 against the torch path; atol 1e-6"}
            for variant, b in VARIANTS:
                t = bench.time_fn(lambda b=b: situ_glu_stacked(gu, backend=b), graph=True)
                out.append(bench.make_record(NAME, f"{PREFIX}situ_glu.{what}_N{n}", variant, t,
                                             shape={"rows": n, "F": f, "width": what}, dtype=dtype, error=err,
                                             backend_used=b))
    return out


# The one-token MXFP4 expert launches' block choices timed at K3's widths: (up, down, down form), the
# blocks (columns, values per step, warps); the first is mxfp4_kernels' default, the second the former
# default it replaced, then each launch varied around the default with the other at its default (the two
# launches are independent, so their times add), then the down launch's flat form (mxfp4_kernels.
# DOWN_FORMS) at the default up blocks: its steps may span pairs, so wider steps are tried too. The
# choices the default was picked from, and their times, are in docs/decode_step.md's experts table.
_UP = (8, 256, 4)
EXPERT_SWEEP = ((_UP, (4, 128, 4), "pairs"), ((32, 256, 4), (16, 256, 4), "pairs"),
                ((4, 256, 4), (4, 128, 4), "pairs"), ((8, 256, 2), (4, 128, 4), "pairs"),
                ((8, 512, 4), (4, 128, 4), "pairs"), ((16, 256, 4), (4, 128, 4), "pairs"),
                (_UP, (2, 128, 4), "pairs"), (_UP, (4, 128, 2), "pairs"), (_UP, (4, 256, 4), "pairs"),
                (_UP, (8, 128, 4), "pairs"), (_UP, (4, 64, 2), "pairs"),
                (_UP, (4, 128, 4), "flat"), (_UP, (2, 128, 4), "flat"), (_UP, (8, 128, 4), "flat"),
                (_UP, (4, 256, 4), "flat"), (_UP, (4, 512, 4), "flat"), (_UP, (8, 256, 4), "flat"),
                (_UP, (4, 128, 2), "flat"))


def _choice_name(up, down, form="pairs") -> str:
    """A choice as its records name it: up<n>x<k>w<w>.down<n>x<k>w<w> (the pairs form of the down
    launch), up<n>x<k>w<w>.flat<n>x<k>w<w> (its flat form)."""
    return "up{}x{}w{}.".format(*up) + ("down" if form == "pairs" else form) + "{}x{}w{}".format(*down)


def _sliced(w, experts):
    """The Mxfp4Weight of the chosen experts only (the reference dequantizes those, not all E)."""
    from k3lab.ops.moe_experts.mxfp4 import Mxfp4Weight

    return Mxfp4Weight(w.packed[experts], w.scale_exp[experts])


def expert_records(sweep=EXPERT_SWEEP, *, experts: int = E, top_k: int = TOP_K, latent: int | None = None,
                   intermediate: int | None = None, sets: int = 8, repeats: int = 50, device: str = "cuda",
                   dtype=torch.bfloat16, seed: int = 0, log=print) -> list[bench.Record]:
    """One token's routed experts at a rank's widths (latent, intermediate: default a TP8 rank's,
    K3Config.tp_slice(8)'s routed_expert_hidden_size and moe_intermediate_size), each call reading another
    draw of `top_k` of `experts` (`sets` draws rotated, so the weights are not timed hot in L2): the bf16
    stacks through routed_experts' Triton form ('before'), the MXFP4 stacks through the one-token kernels
    at each (up, down, down form) choice of `sweep` ('after'; the first is the default); `dtype`: the dense
    stacks' and the token's (bf16 as the step runs; fp32 for Triton's CPU interpreter, which has no bf16
    arithmetic). Each MXFP4 choice is
    checked first against the fp64 product of the dequantized chosen experts (mxfp4_kernels.reference;
    2e-5 of the output's largest value, fp32 accumulation) and the bf16 path against the fp64 product of
    its own weights (1e-2 relative, bf16 inputs); a failed check is a bench.CheckFailed naming the choice,
    before anything is timed. floor_us: the streamed bytes (mxfp4_kernels.expert_bytes: 4.25 bits a
    weight, or 2 bytes) over the copy bandwidth measured in the run (measure.measured_bandwidth_tbs; the
    env peak on a CPU, where the times are not speeds). Cases glue.experts.N1.bf16 and
    glue.experts.N1.mxfp4.<_choice_name>; then the grouped form at the same token
    (`_grouped_record`, case glue.experts.N1.mxfp4_grouped.m<m>n<n>k<k>w<w>) where it runs. Run on an
    H100 (k3lab.studies.runs, part 'decode_step_experts'). Not yet run on an H200. The down launch's flat
    form (the sweep's 'flat' rows): not yet run on a GPU (part 'mxfp4_flat_down')."""
    from k3lab.ops import moe_experts
    from k3lab.ops.moe_experts import mxfp4_kernels as mk

    from .measure import measured_bandwidth_tbs

    from k3lab.config import K3Config

    rank = K3Config.tp_slice(8)
    L = rank.routed_expert_hidden_size if latent is None else latent
    F = rank.moe_intermediate_size if intermediate is None else intermediate
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used: GBs at K3's widths
    bf16, mx = [], []
    for shape_ in ((experts, F, L), (experts, F, L), (experts, L, F)):  # one fp32 stack alive at a time
        w = torch.randn(shape_, generator=gen, device=device) * 0.05
        bf16.append(w.to(dtype))
        mx.append(mk.quantize_experts(w))
        del w
    z = torch.randn(1, L, generator=gen, device=device).to(dtype)
    draws = []
    for _ in range(sets):
        idx = torch.randperm(experts, generator=gen, device=device)[:top_k].to(torch.int32).reshape(1, top_k)
        w = torch.rand(1, top_k, generator=gen, device=device)
        draws.append((idx, w / w.sum()))
    graph = device != "cpu"
    out = []
    idx0, w0 = draws[0]
    chosen = idx0.reshape(-1).long()
    local = torch.arange(top_k, dtype=torch.int32, device=device).reshape(1, top_k)
    ref = mk.reference(z, w0, local, *(_sliced(w, chosen) for w in mx))
    got = moe_experts.routed_experts(z, w0, idx0, *bf16, backend="triton")
    ref16 = moe_experts.expert_loop(z.double(), w0.double(), local, *(w[chosen].double() for w in bf16))
    err16 = float((got.double() - ref16).abs().max() / ref16.abs().max())
    if not err16 <= 1e-2:
        raise bench.CheckFailed(f"routed_experts (bf16, triton) at one token: {err16:.3g} of the largest "
                                f"output from the fp64 product, more than 1e-2")
    tol, errs = 2e-5 * max(1.0, float(ref.abs().max())), {}
    for up, down, form in sweep:  # every choice checked before anything is timed
        y = mk.mxfp4_experts(z, w0, idx0, *mx, up_blocks=up, down_blocks=down, down_form=form)
        errs[up, down, form] = err = float((y.double() - ref).abs().max())
        if not err <= tol:
            raise bench.CheckFailed(f"mxfp4_experts {_choice_name(up, down, form)}: {err:.3g} from the "
                                    f"fp64 product, more than {tol:.3g}")
    bw, how = measured_bandwidth_tbs()  # timed: after every check
    rotate = [(i, w) for i, w in draws]
    nbytes = {"bf16": mk.expert_bytes(1, top_k, L, F, bf16[0].element_size()),
              "mxfp4": mk.expert_bytes(1, top_k, L, F)}
    shape = {"tokens": 1, "experts": experts, "top_k": top_k, "latent": L, "intermediate": F, "sets": sets}
    t = bench.time_fn(lambda i, w: moe_experts.routed_experts(z, w, i, *bf16, backend="triton",
                                                              check_values=False),
                      rotate=rotate, graph=graph, device=device, repeats=repeats, warmup=2)
    out.append(bench.make_record(NAME, f"{PREFIX}experts.N1.bf16", "before", t, shape=shape,
                                 dtype=dtype, floor_us=nbytes["bf16"] / (bw * 1e6),
                                 error={"max_rel_vs_fp64": err16}, bytes=nbytes["bf16"], bandwidth_tbs=bw,
                                 bandwidth_how=how, backend_used="triton"))
    for up, down, form in sweep:
        name = _choice_name(up, down, form)
        blocks = {"up_blocks": up, "down_blocks": down, "down_form": form}
        t = bench.time_fn(lambda i, w, b=blocks: mk.mxfp4_experts(z, w, i, *mx, check_values=False, **b),
                          rotate=rotate, graph=graph, device=device, repeats=repeats, warmup=2)
        rec = bench.make_record(NAME, f"{PREFIX}experts.N1.mxfp4.{name}", "after", t, shape=shape,
                                dtype=dtype, floor_us=nbytes["mxfp4"] / (bw * 1e6),
                                error={"max_abs_vs_fp64": errs[up, down, form], "tolerance": tol},
                                bytes=nbytes["mxfp4"], bandwidth_tbs=bw, bandwidth_how=how,
                                up_blocks=list(up), down_blocks=list(down), down_form=form,
                                default=(up, down, form) == (mk.UP_BLOCKS, mk.DOWN_BLOCKS, mk.DOWN_FORM))
        out.append(rec)
        log(f"decode_step glue: experts mxfp4 {name}: {rec.median_us:.1f} us, floor {rec.floor_us:.1f} us")
    return out + _grouped_record(z, draws, mx, ref_args=(w0, local, chosen), shape=shape,
                                 nbytes=nbytes["mxfp4"], bw=(bw, how), graph=graph, device=device,
                                 repeats=repeats, dtype=dtype, log=log)


def _grouped_record(z, draws, mx, *, ref_args, shape, nbytes, bw, graph, device, repeats, dtype, log):
    """The grouped tl.dot_scaled form (mxfp4_kernels.mxfp4_experts_grouped, its default blocks) at the
    same token and draws: the other way to run one token's MXFP4 experts (tensor-core tiles of which one
    row in 16 is real, E2M1 converted by Triton's own lowering) against the GEMV launches' register
    decode. Checked against the fp64 product with the activations rounded as MXFP8 (`reference(...,
    mx_activations=True)`, 5e-3 of the largest output, as its op test). Where it cannot run
    (`grouped_runs_here`: Triton's interpreter, gfx942) [] and the log says why."""
    from k3lab.ops.moe_experts import mxfp4_kernels as mk

    ok, why = mk.grouped_runs_here()
    if not ok:
        log(f"decode_step glue: experts mxfp4 grouped form not timed: {why}")
        return []
    w0, local, chosen = ref_args
    idx0 = draws[0][0]
    ref = mk.reference(z, w0, local, *(_sliced(w, chosen) for w in mx), mx_activations=True)
    err = float((mk.mxfp4_experts_grouped(z, w0, idx0, *mx).double() - ref).abs().max())
    tol = 5e-3 * float(ref.abs().max())
    if not err <= tol:
        raise bench.CheckFailed(f"mxfp4_experts_grouped at one token: {err:.3g} from the fp64 product (MXFP8 "
                                f"activations), more than {tol:.3g}")
    t = bench.time_fn(lambda i, w: mk.mxfp4_experts_grouped(z, w, i, *mx, check_values=False),
                      rotate=list(draws), graph=graph, device=device, repeats=repeats, warmup=2)
    name = "m{}n{}k{}w{}".format(*mk.GROUPED)
    rec = bench.make_record(NAME, f"{PREFIX}experts.N1.mxfp4_grouped.{name}", "after", t, shape=shape,
                            dtype=dtype, floor_us=nbytes / (bw[0] * 1e6),
                            error={"max_abs_vs_fp64_mx_activations": err, "tolerance": tol}, bytes=nbytes,
                            bandwidth_tbs=bw[0], bandwidth_how=bw[1], blocks=list(mk.GROUPED), default=False)
    log(f"decode_step glue: experts mxfp4 grouped {name}: {rec.median_us:.1f} us, "
        f"floor {rec.floor_us:.1f} us")
    return [rec]


EXPERT_CASE = f"{PREFIX}experts.N1."
EXPERT_DOC_BEGIN = ("<!-- experts table: python -c \"from k3lab.studies.decode_step import glue; "
                    "glue.write_expert_doc()\" (k3lab/studies/decode_step/glue.py) -->")
EXPERT_DOC_END = "<!-- end of experts table -->"


def expert_markdown(root=None) -> str:
    """docs/decode_step.md's table of one token's routed experts alone (`expert_records`), one table per
    device with committed records (root: default the tree's profiles/): each form and block choice with
    its median, its floor (its own bytes over the run's copy bandwidth), the share of the floor, and its
    time over the bf16 experts' of the same run; mxfp4_kernels' default block choice marked (the code's,
    whatever it was when a record was taken). Every figure from the records."""
    from k3lab.ops.moe_experts import mxfp4_kernels as mk

    default = _choice_name(mk.UP_BLOCKS, mk.DOWN_BLOCKS, mk.DOWN_FORM)
    out, by_device = [], {}
    for r in bench.load_records(study=NAME, root=root):
        if r.case.startswith(EXPERT_CASE):
            by_device.setdefault(bench.device_slug(r.device, r.backend), []).append(r)
    for slug, recs in sorted(by_device.items()):
        recs.sort(key=lambda r: (r.variant != "before", r.median_us))
        bf16 = next((r for r in recs if r.variant == "before"), None)
        x = recs[0].extra or {}
        shape = recs[0].shape or {}
        out += [f"On {recs[0].device} (records under profiles/{slug}/{NAME}/, tree {recs[0].commit}; "
                f"copy bandwidth measured in the run {x.get('bandwidth_tbs', 0):.2f} TB/s): one token, "
                f"{shape.get('top_k')} of {shape.get('experts')} experts, latent {shape.get('latent')}, "
                f"expert width {shape.get('intermediate')}, graph replay, {shape.get('sets')} expert draws "
                "rotated.", "",
                "| form | blocks | us | floor us | % of floor | / bf16 |", "|---|---|---|---|---|---|"]
        for r in recs:
            form, _, blocks = r.case[len(EXPERT_CASE):].partition(".")
            blocks = (blocks or "-") + (" (default)" if form == "mxfp4" and blocks == default else "")
            ratio = f"{r.median_us / bf16.median_us:.2f}" if bf16 else "-"
            out.append(f"| {form} | {blocks} | {r.median_us:.1f} | {r.floor_us:.1f} | "
                       f"{100 * r.floor_us / r.median_us:.0f}% | {ratio} |")
        out.append("")
    return "\n".join(out) if out else "No one-token expert record is committed.\n"


def write_expert_doc(path=None) -> bool:
    """Put expert_markdown() between EXPERT_DOC_BEGIN and EXPERT_DOC_END in docs/decode_step.md; True if
    it changed."""
    from k3lab.studies.runs import REPO, write_between

    return write_between(path or REPO / "docs" / "decode_step.md", EXPERT_DOC_BEGIN, EXPERT_DOC_END,
                         expert_markdown())


def run(log=print, *, experts: bool = True) -> list[bench.Record]:
    """The glue kernels' records, then (experts) the one-token routed experts' (`expert_records`, at K3's
    widths: about 9 GB of expert stacks on the GPU); [] on a CPU (said in the log)."""
    if not torch.cuda.is_available():
        log("decode_step glue: the glue kernels are timed on a GPU; there is none here, so nothing is "
            "measured (tests/test_moe_router.py and tests/test_situ_glu_op.py check them on a CPU)")
        return []
    routes = router_records() + launch_records()
    log("decode_step glue: the MoE router, us per call in a CUDA graph\n" + router_table(routes))
    return routes + situ_glu_records() + (expert_records(log=log) if experts else [])
