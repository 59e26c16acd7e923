"""Tables and figures of the decode_step study (notebook 08, the report's first page), read from its
records: the waterfall (all on, each switch off alone, all off), where the time goes, the floors and
the headroom, the MLA padding's whole-step effect and the fused ops' shares beside the seed's figures
(labelled as the seed's), launches per step and what the per-op records predict (Amdahl)."""

from __future__ import annotations

from k3lab import bench

from . import measure
from .measure import ATTRIBUTION, GLUE, NAME, PROBE

NOT_MEASURED = "not measured"  # a table's cell for a variant with no record yet (never NaN or None)
# the all-on step at each of its settings, in the order `precision_rows` lists them
SETTING_ROWS = ("all_on", "all_on_gemv", "all_on_default", "all_on_fp8", "all_on_article")

DEVICE = "nvidia-h200"
SEED = {
    "mla_1k_ms": (22.9, 22.8), "mla_32k_ms": (43.8, 23.6),  # ms per output token, before -> after
    "attn_res_gain": 0.142,  # +14.2% output throughput at 100K input
    "moe_tail_gain": (0.0305, 0.0491),  # +3.05-4.91% output throughput
}
# Per-op records (graph replay, B = 1, TP8 shapes) and how often the op runs in one step.
PER_OP = {
    "kda_decode": ("kda_decode", "B1_H12", 69, "fused KDA decode (69 KDA layers)"),
    "attn_res": ("copy_removal", "attn_res_t1_s5_graph", 187, "AttnRes + RMSNorm, 5 sources (187 per step)"),
    "pack": ("copy_removal", "pack_copy_graph", 69, "the needless pack copy (69 per step)"),
}
MLA_CASE = {"b1_1k": "ctx1k", "b1_32k": "ctx32k", "b1_128k": "ctx128k", "b64_8k": "b64_8k"}


# ------------------------------------------------------------------ reading the records
def load(records=None, device: str = DEVICE) -> list:
    """The whole-step records: `records` if given (a live run), else the committed ones for `device`;
    without the bounds probes (`probes`), the glue kernels' records and the attributions
    (`attributions`)."""
    recs = list(records) if records is not None else bench.load_records(NAME, device=device)
    return [r for r in recs if not r.case.startswith((PROBE, GLUE, ATTRIBUTION))]


def attributions(records=None, device: str = DEVICE) -> list:
    """The step attribution records (`attribution`: cases attribution.<case>.<variant>, the per-part
    table in extra['parts']): `records` if given, else the committed ones for `device`."""
    recs = list(records) if records is not None else bench.load_records(NAME, device=device)
    return [r for r in recs if r.case.startswith(ATTRIBUTION)]


def probes(device: str = DEVICE) -> list:
    """The committed bounds probes (`bounds`: cases probe.gemv.<projection>,
    probe.small_kernel)."""
    return [r for r in bench.load_records(NAME, device=device) if r.case.startswith(PROBE)]


def where_time_goes(records, case: str = "b1_1k", probe_records=None) -> list[dict]:
    """The all-on graph step of `case` split by its profile (`bounds.split`): weight streaming
    (GEMMs and the grouped experts) and the rest, each with kernels, kernel time, and what the bounds
    say it costs at least: the streamed weights' bytes over the copy bandwidth and, from the probes, the
    projections alone in a graph; the rest's kernels at the probed per-kernel cost of a do-nothing
    kernel. Last row: the graph replay against the sum of its kernels. [] without a profiled record."""
    from . import bounds

    r = _index(records).get((case, "all_on", "graph"))
    prof = r and r.extra.get("profile_graph")
    if not prof or "top_kernels" not in prof:
        return []
    sp = bounds.split(prof)
    recs = probes() if probe_records is None else probe_records
    b, bw = r.extra["bytes"], r.extra["bandwidth_tbs"]
    proj_alone = sum(p.median_us * p.extra["calls_per_step"] for p in recs
                     if p.case.startswith(PROBE + "gemv.") and p.variant == "cublas")
    sk = next((p for p in recs if p.case == PROBE + "small_kernel"), None)
    rows = [{"part": "weight streaming (GEMMs, grouped experts)", "kernels": sp["stream_kernels"],
             "kernel_ms": sp["stream_us"] / 1e3,
             "floor_ms": (b["weights_dense"] + b["weights_experts"]) / (bw * 1e9),
             "probe_ms": proj_alone / 1e3 if proj_alone else None,
             "probe": "the dense projections alone, one graph each (the experts not included)"},
            {"part": "the rest (norms, gates, routing, copies, attention, recurrences)",
             "kernels": sp["rest_kernels"],
             "kernel_ms": sp["rest_us"] / 1e3,
             "floor_ms": (b["mla_cache"] + b["kda_state"] + b["kda_conv"]) / (bw * 1e9),
             "probe_ms": sk.median_us * sp["rest_kernels"] / 1e3 if sk else None,
             "probe": f"{sp['rest_kernels']} kernels x {sk.median_us:.2f} us (a do-nothing kernel in a graph)"
             if sk else "no small-kernel probe committed"},
            ]
    # "alone": the eager step's kernels, each on an idle GPU between host launches
    alone = (r.extra.get("profile_eager") or prof)["kernel_sum_us"]
    rows.append({"part": "graph replay vs the sum of its kernels run alone (eager profile)",
                 "kernels": prof["launches"], "kernel_ms": alone / 1e3, "floor_ms": r.floor_us / 1e3,
                 "probe_ms": r.median_us / 1e3,
                 "probe": f"the graph step: {r.median_us / alone:.2f}x that sum"})
    return rows


def _index(records) -> dict[tuple[str, str, str], bench.Record]:
    """(shape case, variant name, mode) -> record; mode 'graph' or 'eager' (cpu runs count as eager)."""
    out = {}
    for r in records:
        parts = r.case.split(".")
        mode = "graph" if parts[-1] == "graph" else "eager"
        out[(parts[0], parts[1], mode)] = r
    return out


def variant_precision(variant: str, record=None) -> str:
    """The precision a variant's record ran (extra['precision'], or its step's), else the one the study
    builds it at (`attribution.precision_of`); 'bf16' for a name the study no longer has."""
    from . import attribution

    extra = getattr(record, "extra", None) or {}
    got = extra.get("precision") or (extra.get("step") or {}).get("precision")
    if got:
        return got
    try:
        return attribution.precision_of(variant)
    except ValueError:
        return "bf16"


def _case_basis(case: str, records) -> tuple | None:
    """(config, (batch, context_len), bytes per value, (TB/s, how)) to predict a floor of shape case
    `case` from: the study's config and shape for the case, the dtype and the copy bandwidth of one of
    its `records` (measured in the same run). None without such a record."""
    import torch

    from k3lab.config import K3Config

    shape = measure.GPU_CASES.get(case) or measure.CPU_CASES.get(case)
    def of_case(r) -> bool:
        return r.case.split(".")[0] == case or r.case.startswith(f"{ATTRIBUTION}{case}.")

    r = next((r for r in records if of_case(r) and isinstance(r.extra.get("bandwidth_tbs"), (int, float))),
             None)
    if shape is None or r is None:
        return None
    config = K3Config.tp_slice(8) if case in measure.GPU_CASES else measure.CPU_CONFIG
    size = getattr(torch, str(r.dtype).replace("torch.", ""), torch.bfloat16).itemsize
    how = r.extra.get("bandwidth_how") or r.extra.get("how") or "the records' copy bandwidth"
    return config, shape, size, (float(r.extra["bandwidth_tbs"]), how)


def predicted_floor_us(case: str, precision: str, records) -> float | None:
    """The bytes floor of an all-on step of `case` at `precision` that has no record: `measure.case_floor`
    (part_bytes at that precision, the routed experts at uniform routing's expectation: at B = 1 the
    16 a token reads) at the bandwidth one of the case's `records` measured. None without one."""
    basis = _case_basis(case, records)
    if basis is None:
        return None
    config, shape, size, bw = basis
    return measure.case_floor(config, shape, size, bw, precision)["floor_us"]


def best_us(idx, case: str, variant: str) -> tuple[float | None, str]:
    """(median us, mode) of a variant: the graph replay where it was captured, else eager."""
    for mode in ("graph", "eager"):
        r = idx.get((case, variant, mode))
        if r is not None:
            return r.median_us, r.mode
    return None, ""


def waterfall(records, case: str):
    """One row per variant of `case` with a record: variant, label, precision (the number formats it
    ran), eager_ms, graph_ms, step_ms (graph where captured), vs_all_on (step time / all-on step time - 1:
    what switching that one off costs), floor_ms (at its precision). `precision_rows` lists the all-on
    settings with a row for each, measured or not."""
    import pandas as pd

    idx = _index(records)
    rows = []
    for name in measure.variants():
        eager, graph = idx.get((case, name, "eager")), idx.get((case, name, "graph"))
        if eager is None:
            continue
        t, mode = best_us(idx, case, name)
        rows.append({"variant": name, "label": eager.extra.get("step", {}).get("label", name),
                     "precision": variant_precision(name, eager), "eager_ms": eager.median_us / 1e3,
                     "graph_ms": graph.median_us / 1e3 if graph else None,
                     "step_ms": t / 1e3, "step_mode": mode, "floor_ms": (eager.floor_us or 0) / 1e3})
    df = pd.DataFrame(rows)
    if len(df) and "all_on" in set(df["variant"]):
        on = float(df.loc[df["variant"] == "all_on", "step_ms"].iloc[0])
        df["vs_all_on"] = df["step_ms"] / on - 1.0
    return df


def precision_rows(records, case: str = "b1_1k") -> list[dict]:
    """The all-on step of `case` at each of its settings (SETTING_ROWS: the matrix library's and the
    one-row GEMV's bf16 projections, the step's own default, FP8 projections, the article's precisions),
    one row each whether measured or not: variant, precision, projections, step_ms, step_mode, floor_ms
    (the record's, at the precision it ran), floor_from, of_floor (floor / step). A variant without a
    record reads NOT_MEASURED in step_ms, step_mode and of_floor, and its floor is predicted
    (`predicted_floor_us`, said in floor_from) where a record of the case gives the bandwidth, else
    NOT_MEASURED too: no cell is NaN or None."""
    idx = _index(records)
    rows = []
    for name in SETTING_ROWS:
        rec = idx.get((case, name, "graph")) or idx.get((case, name, "eager"))
        prec = variant_precision(name, rec)
        settings = measure.step_settings(name)
        proj = ((rec.extra.get("step") or {}).get("projections") if rec else None) or (
            settings.get("projections") or ("fp8" if prec != "bf16" else "the step's default"))
        row = {"variant": name, "precision": prec, "projections": proj}
        if rec is not None:
            t, mode = best_us(idx, case, name)
            floor = rec.floor_us
            row.update(step_ms=t / 1e3, step_mode=mode,
                       floor_ms=floor / 1e3 if floor else NOT_MEASURED,
                       floor_from=f"the record ({prec}, experts as read)" if floor else "no floor recorded",
                       of_floor=floor / t if floor else NOT_MEASURED)
        else:
            floor = predicted_floor_us(case, prec, records)
            basis = _case_basis(case, records)
            row.update(step_ms=NOT_MEASURED, step_mode=NOT_MEASURED,
                       floor_ms=NOT_MEASURED if floor is None else floor / 1e3,
                       floor_from=f"no record of {case} to take a bandwidth from" if basis is None else
                       f"predicted: part_bytes at {prec} over {basis[3][0]:.2f} TB/s ({case}'s records)",
                       of_floor=NOT_MEASURED)
        rows.append(row)
    return rows


UNCHECKED = ("not a check: compared with all off, whose MoE tail differs under the stand-in collectives; "
             "re-measure")


def checks(records) -> list[dict]:
    """Per record, its logits check (`measure`): case, variant, mode, reference, rel_l2, max_abs,
    graph_vs_eager (rel_l2 of one graph replay against the eager check, graph records), state (the
    checksum of the caches it started from) and note. Records made before the check compared like with
    like (error['logits_vs_all_off']) keep their figure and say that it is not a check (UNCHECKED)."""
    rows = []
    for r in records:
        case, variant = r.case.split(".")[:2]
        e = r.error or {}
        row = {"case": case, "variant": variant, "mode": r.mode, "reference": None, "rel_l2": None,
               "max_abs": None, "graph_vs_eager": (e.get("graph_vs_eager") or {}).get("rel_l2"),
               "state": e.get("state"), "note": ""}
        chk = e.get("logits_vs_reference", e.get("logits_vs_all_off"))
        if isinstance(chk, dict):
            row.update(reference=chk.get("reference", "all_off"), rel_l2=chk["rel_l2"],
                       max_abs=chk["max_abs"])
            if "logits_vs_all_off" in e:
                row["note"] = UNCHECKED
        else:
            row["note"] = "the reference" if chk else "no check recorded"
        rows.append(row)
    return rows


def waterfall_figure(df, title: str):
    """Horizontal bars of the step time per variant (graph replay where captured, hatched where eager)."""
    import plotly.graph_objects as go

    d = df.iloc[::-1]
    fig = go.Figure(go.Bar(x=d["step_ms"], y=d["variant"], orientation="h",
                           marker_pattern_shape=["" if m == "graph" else "/" for m in d["step_mode"]],
                           text=[f"{v:.2f} ms ({m})" for v, m in zip(d["step_ms"], d["step_mode"])],
                           textposition="outside"))
    if len(df) and df["floor_ms"].max() > 0:
        fig.add_vline(x=float(df["floor_ms"].iloc[0]), line_dash="dot", annotation_text="bytes floor")
    fig.update_layout(title=title, xaxis_title="ms per step", height=80 + 32 * len(df), margin={"l": 170})
    return fig


def gemv_rows(probe_records=None) -> list[dict]:
    """Per projection shape of the bounds probe: calls per step, MB, cuBLAS and k3lab.ops.gemv us and
    TB/s, each alone in a graph (records probe.gemv.<name>, variants cublas / triton)."""
    recs = probes() if probe_records is None else probe_records
    by = {}
    for p in recs:
        if p.case.startswith(PROBE + "gemv."):
            by.setdefault(p.case[len(PROBE + "gemv."):], {})[p.variant] = p
    rows = []
    for name, v in by.items():
        c, t = v.get("cublas"), v.get("triton")
        ref = c or t
        rows.append({"projection": name, "calls": ref.extra["calls_per_step"], "MB": ref.extra["bytes"] / 1e6,
                     "cublas_us": c.median_us if c else None, "cublas_tbs": c.extra["tbs"] if c else None,
                     "gemv_us": t.median_us if t else None, "gemv_tbs": t.extra["tbs"] if t else None})
    return rows


def where_figure(rows: list[dict], title: str):
    """Grouped bars per part of `where_time_goes`: its kernels' time, its bytes floor and its probe."""
    import plotly.graph_objects as go

    parts = [r["part"].split(" (")[0] for r in rows]
    fig = go.Figure([go.Bar(name=label, x=parts, y=[r[key] for r in rows]) for key, label in
                     (("kernel_ms", "kernel time (profile)"), ("floor_ms", "bytes floor"),
                      ("probe_ms", "probe / graph step"))])
    fig.update_layout(barmode="group", title=title, yaxis_title="ms per step", height=380)
    return fig


def _part_bytes(r, variant: str, precision: str) -> dict:
    """An attribution record's per-part bytes: extra['part_bytes'] where it holds them, else (records made
    before they were kept) `attribution.part_floors` at its shape and precision, at TP8 in bf16 as every
    GPU attribution ran, with the variant's MoE tail."""
    from k3lab.config import K3Config

    from . import attribution

    if isinstance(r.extra.get("part_bytes"), dict):
        return r.extra["part_bytes"]
    tail = "sharded" if measure.variants().get(variant, {}).get("moe_tail_sharded", True) else "replicated"
    return attribution.part_floors(K3Config.tp_slice(8), int(r.shape["batch"]), int(r.shape["context_len"]),
                                   precision=precision, tail=tail)


def attribution_rows(case: str = "b1_1k", variant: str = "all_on", records=None) -> tuple[list[dict], dict]:
    """(rows, summary) of the step attribution record `attribution.<case>.<variant>` (`attributions`):
    one row per part in ms (kernels, kernel_ms, gap_ms, total_ms, floor_ms, kernel_vs_floor), the
    precision the step ran and the part's bytes at it in MB (`attribution.BYTES_COLUMNS`: dense_MB,
    experts_MB, cache_MB, state_MB; None for a part without a floor), and the summary: precision,
    step_ms (the graph step timed apart), span_ms (the replay's first kernel to its last), kernels,
    matched (share of the replay's kernels aligned to the labelled eager run), floor_ms, commit.
    ([], {}) when no such record exists."""
    from . import attribution

    r = next((r for r in attributions(records) if r.case == f"{ATTRIBUTION}{case}.{variant}"), None)
    if r is None:
        return [], {}
    def num(x):  # a part without a floor: None (a record may hold it as NaN, written 'nan')
        x = None if x is None else float(x)
        return None if x is None or x != x else x

    prec = variant_precision(variant, r)
    kinds = _part_bytes(r, variant, prec)
    rows = [{"part": p["part"], "kernels": p["kernels"], "kernel_ms": p["kernel_us"] / 1e3,
             "gap_ms": p["gap_us"] / 1e3, "total_ms": p["total_us"] / 1e3,
             "floor_ms": None if num(p.get("floor_us")) is None else num(p.get("floor_us")) / 1e3,
             "kernel_vs_floor": num(p.get("kernel_vs_floor")), "precision": prec,
             **attribution.bytes_columns(kinds.get(p["part"]))} for p in r.extra["parts"]]
    rows.sort(key=lambda row: -row["total_ms"])
    return rows, {"precision": prec, "step_ms": r.median_us / 1e3, "span_ms": r.extra["span_us"] / 1e3,
                  "kernels": r.extra["launches"], "matched": r.extra["matched"],
                  "floor_ms": (r.floor_us or 0) / 1e3, "commit": r.commit}


def floor_rows(records=None) -> list[dict]:
    """One row per attribution record (`attributions`), B = 1 cases first: case, variant, precision,
    step_ms (the graph step timed apart), floor_ms (at its precision), of_floor (floor / step: the share
    of the bytes floor the step reaches), kernels (launches per step in the replay) and commit. A case
    with a record also lists each precision's variant (`attribution.VARIANT_OF`) it lacks: NOT_MEASURED
    in step_ms, of_floor, kernels and commit, the floor predicted at the bandwidth the case's records
    measured (`predicted_floor_us`)."""
    from . import attribution

    recs = attributions(records)
    rows, seen = [], set()
    for r in recs:
        case, variant = r.case[len(ATTRIBUTION):].split(".", 1)
        seen.add((case, variant))
        rows.append({"case": case, "variant": variant, "precision": variant_precision(variant, r),
                     "step_ms": r.median_us / 1e3, "floor_ms": (r.floor_us or 0) / 1e3,
                     "of_floor": (r.floor_us or 0) / r.median_us, "kernels": r.extra["launches"],
                     "commit": r.commit})
    for case in dict.fromkeys(c for c, _ in seen):
        for prec, variant in attribution.VARIANT_OF.items():
            if (case, variant) in seen:
                continue
            floor = predicted_floor_us(case, prec, recs)
            rows.append({"case": case, "variant": variant, "precision": prec, "step_ms": NOT_MEASURED,
                         "floor_ms": NOT_MEASURED if floor is None else floor / 1e3,
                         "of_floor": NOT_MEASURED, "kernels": NOT_MEASURED, "commit": NOT_MEASURED})
    order = {c: i for i, c in enumerate(measure.GPU_CASES)}
    return sorted(rows, key=lambda row: (order.get(row["case"], len(order)), row["variant"]))


def headroom(rows: list[dict]) -> list[dict]:
    """What each part of an attribution table (`attribution_rows`' rows) would give back at its bytes floor:
    one row per part that has a floor, largest first, with headroom_ms = total_ms - floor_ms (its kernels
    and the gaps before them, against what its bytes take at the copy bandwidth). A part without a floor
    (floor_ms None: the mixes, the collectives' stand-ins, the embedding) is left out: the table cannot say
    how far it could go. The first row is the part to work on first and what the step would save."""
    out = []
    for r in rows:
        if r.get("floor_ms") is None:
            continue
        out.append({"part": r["part"], "total_ms": r["total_ms"], "floor_ms": r["floor_ms"],
                    "headroom_ms": r["total_ms"] - r["floor_ms"]})
    return sorted(out, key=lambda row: -row["headroom_ms"])


def attribution_figure(rows: list[dict], title: str):
    """Stacked bars per part: its kernels' time and the idle gaps before them, beside its bytes floor."""
    import plotly.graph_objects as go

    parts = [r["part"] for r in rows]
    fig = go.Figure([go.Bar(name="kernels", x=parts, y=[r["kernel_ms"] for r in rows], offsetgroup="t"),
                     go.Bar(name="gaps before them", x=parts, y=[r["gap_ms"] for r in rows], offsetgroup="t",
                            base=[r["kernel_ms"] for r in rows]),
                     go.Bar(name="bytes floor", x=parts, y=[r["floor_ms"] for r in rows], offsetgroup="f")])
    fig.update_layout(title=title, yaxis_title="ms per step", height=380)
    return fig


def mla_rows(records) -> list[dict]:
    """The MLA padding's whole-step effect per B = 1 case: before (no_mla_padded) and after (all_on),
    beside the seed's per-token figures where the seed gives them (1K and 32K)."""
    idx = _index(records)
    rows = []
    for case, seed_key in (("b1_1k", "mla_1k_ms"), ("b1_32k", "mla_32k_ms"), ("b1_128k", None)):
        before, _ = best_us(idx, case, "no_mla_padded")
        after, mode = best_us(idx, case, "all_on")
        s = SEED.get(seed_key) if seed_key else None
        rows.append({"case": case, "before_ms": before and before / 1e3, "after_ms": after and after / 1e3,
                     "ratio": before / after if before and after else None, "mode": mode,
                     "seed_before_ms": s[0] if s else None, "seed_after_ms": s[1] if s else None,
                     "seed_ratio": s[0] / s[1] if s else None})
    return rows


def gain(records, case: str, switch: str) -> float | None:
    """Throughput gain of turning `switch` on with the rest on: t(no_switch) / t(all_on) - 1."""
    idx = _index(records)
    off, _ = best_us(idx, case, f"no_{switch}")
    on, _ = best_us(idx, case, "all_on")
    return off / on - 1.0 if off and on else None


def launches(records, case: str) -> list[dict]:
    """Launches per step from the profiler: all off and all on, eager (kernels and API launches) and,
    where captured, in the graph (the kernels it holds, one API launch)."""
    idx = _index(records)
    rows = []
    for name in ("all_off", "all_on"):
        for mode in ("eager", "graph"):
            r = idx.get((case, name, mode))
            prof = r and r.extra.get(f"profile_{mode}")
            if prof:
                rows.append({"variant": name, "mode": mode, "kernels": prof["launches"],
                             "api_launches": prof["api_launches"], "kernel_sum_ms": prof["kernel_sum_us"]
                             / 1e3,
                             "step_ms": r.median_us / 1e3})
    return rows


def amdahl(context: str = "ctx32k", device: str = DEVICE) -> list[dict]:
    """What the per-op records predict for one B = 1 step at `context` (ctx1k, ctx32k, ctx128k): per op,
    its per-call graph time before and after, times calls per step, and the time saved per step."""
    rows = []
    ops = dict(PER_OP, mla=("mla_padding", context, 24, f"MLA decode at {context} (24 MLA layers)"))
    for key, (study, case, calls, what) in ops.items():
        recs = {r.variant: r for r in bench.load_records(study, device=device) if r.case == case and r.mode
                == "graph"}
        before, after = recs.get("before"), recs.get("after")
        if before is None:
            continue
        b = before.median_us * calls / 1e3
        a = after.median_us * calls / 1e3 if after is not None else 0.0
        rows.append(
            {
                "op": key,
                "what": what,
                "calls": calls,
                "before_ms": b,
                "after_ms": a,
                "saved_ms": b - a,
                "record": f"profiles/{device}/{study}/{case}__before.json",
            }
        )
    return rows


def seed_headline() -> dict:
    """The seed's headline arithmetic (tokens per dollar, MI355X against HGX B300): the seed's figures."""
    from k3lab import agentx

    return agentx.compare(agentx.SEED["mi355x"], agentx.SEED["b300"])


def _fmt_pair(a, b, unit="ms") -> str:
    return f"{a:.2f} -> {b:.2f} {unit}" if a is not None and b is not None else "no GPU record yet"


def _against_floor(t: float | None, mode: str, r) -> str:
    """'<step> ms (<mode>), floor <floor> ms (<share>)' of a record timed `t` us, or 'no GPU record yet'."""
    if not (t and r and r.floor_us):
        return "no GPU record yet"
    return f"{t / 1e3:.2f} ms ({mode}), floor {r.floor_us / 1e3:.2f} ms ({r.floor_us / t:.0%})"


def front_page_rows(records=None, device: str = DEVICE) -> list[dict]:
    """Rows for the report's first page, one per whole-step result: what, k3lab (this device's
    whole-step records, or 'no GPU record yet'), seed (the seed's figure, labelled), record."""
    recs = load(records, device)
    where = f"profiles/{device}/{NAME}/"
    mla = {r["case"]: r for r in mla_rows(recs)}
    rows = []
    for case in ("b1_1k", "b1_32k"):
        m = mla[case]
        rows.append({"what": f"MLA padded to 16 heads, whole step, B = 1, {case[3:]} context",
                     "k3lab": _fmt_pair(m["before_ms"], m["after_ms"])
                     + (f" ({m['ratio']:.2f}x)" if m["ratio"] else ""),
                     "seed": f"{m['seed_before_ms']} -> {m['seed_after_ms']} ms per token (seed, MI355X)",
                     "record": where})
    for switch, case, seed in (("attn_res_fused", "b1_128k", "+14.2% output throughput at 100K input (seed)"),
                               ("moe_tail_sharded", "b64_8k", "+3.05-4.91% output throughput (seed)"),
                               ("kda_fused", "b1_1k", "3 kernels + 2 copies -> 1 launch (seed)"),
                               ("glue_fused", "b1_1k",
                                "not in the seed: k3lab's router, expert sort and SiTU-GLU kernels")):
        g = gain(recs, case, switch)
        rows.append({"what": f"{switch}: step time with it off / on - 1, {case}",
                     "k3lab": f"{100 * g:+.1f}%" if g is not None else "no GPU record yet", "seed": seed,
                     "record": where})
    lrows = {(r["variant"], r["mode"]): r for r in launches(recs, "b1_1k")}
    off, on = lrows.get(("all_off", "eager")), lrows.get(("all_on", "eager"))
    rows.append({"what": "kernels per step, all off -> all on (B = 1, 1K)",
                 "k3lab": f"{off['kernels']} -> {on['kernels']}" if off and on else "no GPU record yet",
                 "seed": "69 needless copies per step removed (seed)", "record": where})
    idx = _index(recs)
    fp8, _ = best_us(idx, "b1_1k", "all_on_fp8")
    bf16, _ = best_us(idx, "b1_1k", "all_on")
    rows.append({"what": "all on, B = 1, 1K: bf16 -> FP8 dense projections",
                 "k3lab": _fmt_pair(bf16 and bf16 / 1e3, fp8 and fp8 / 1e3),
                 "seed": "not in the seed (its experts are MXFP4)",
                 "record": where})
    gv, _ = best_us(idx, "b1_1k", "all_on_gemv")
    rg = idx.get(("b1_1k", "all_on_gemv", "eager"))
    rows.append({"what": "all on, B = 1, 1K: cuBLAS -> k3lab's one-row projections (k3lab.ops.gemv)",
                 "k3lab": _fmt_pair(bf16 and bf16 / 1e3, gv and gv / 1e3)
                 + (f", {rg.floor_us / gv:.0%} of the bytes floor" if gv and rg and rg.floor_us else ""),
                 "seed": "not in the seed", "record": where})
    t, mode = best_us(idx, "b1_1k", "all_on")
    r = idx.get(("b1_1k", "all_on", "eager"))
    rows.append({"what": "all on, B = 1, 1K: step time against its bytes floor",
                 "k3lab": _against_floor(t, mode, r),
                 "seed": "22.8 ms per token at 1K (seed, whole serving stack)", "record": where})
    for variant, what, seed in (
            ("all_on_default", "the step's own projections (the one-row GEMV at one row)", "not in the seed"),
            ("all_on_article", "the article's precisions (MXFP4 experts, FP8 projections and MLA cache)",
             "FP4 weights and FP8 KV (the article's serving notes)")):
        t, mode = best_us(idx, "b1_1k", variant)
        r = idx.get(("b1_1k", variant, "graph")) or idx.get(("b1_1k", variant, "eager"))
        prec = variant_precision(variant, r)
        rows.append({"what": f"all on, B = 1, 1K, {what}: step time against its {prec} bytes floor",
                     "k3lab": _against_floor(t, mode, r), "seed": seed, "record": where})
    return rows
