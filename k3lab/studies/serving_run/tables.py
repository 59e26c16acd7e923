"""Tables of the serving_run study (notebook 09, `k3lab report`): its records, fresh or committed under
profiles/<device>/serving_run/, as one row per run (`curve_rows`), the report's table with the step model
beside each run (`report_table`), the curve's figure and the lines `k3lab bench` prints. The case names'
grammar (`parse_case`) lives here too, since the records are sorted and kept apart by it. They launch
nothing."""

from __future__ import annotations

import math
import os
from pathlib import Path

from k3lab import bench

NAME = "serving_run"
FORM_PREFIX = "capacity."  # the capacity form's cases and records carry its name (a scaled workload)


def parse_case(case: str) -> dict:
    """'c8.dcp1.host' -> {'concurrency': 8, 'dcp': 1, 'host': True}; a capacity-form case
    ('capacity.c16.dcp8.host') gives the same with 'form': 'capacity'; ValueError otherwise."""
    if not isinstance(case, str):
        raise ValueError(f"case must be a string like 'c8.dcp1.host', got {case!r}")
    form = "capacity" if case.startswith(FORM_PREFIX) else None
    parts = case.removeprefix(FORM_PREFIX).split(".")
    try:
        c, d, h = parts
        if not (c.startswith("c") and d.startswith("dcp") and h in ("host", "gpu_only")):
            raise ValueError
        out = {"concurrency": int(c[1:]), "dcp": int(d[3:]), "host": h == "host"}
    except ValueError:
        raise ValueError(f"case must look like 'c8.dcp1.host' or 'c16.dcp8.gpu_only', got {case!r}") from None
    if out["concurrency"] < 1 or out["dcp"] not in (1, 2, 4, 8):
        raise ValueError(f"case {case!r}: concurrency >= 1 and DCP 1, 2, 4 or 8 expected")
    return {**out, "form": form} if form else out



def report_records() -> Path | None:
    """Inside a `k3lab report` (its notebooks see k3lab.report.RECORDS_ENV), the folder where its studies
    saved this run's records; None elsewhere (an older report's records could be another commit's)."""
    from k3lab.report import RECORDS_ENV

    here = os.environ.get(RECORDS_ENV)
    return Path(here) if here else None


def measured(root=None, device: str | None = None, form: str = "quick") -> list[bench.Record]:
    """This machine's committed serving-run records (`device`: a slug or name, default this machine's;
    `root`: default the tree's profiles/; `report_records()` holds a report's fresh ones), ordered by DCP,
    host tier and concurrency; [] when none. form='capacity': the capacity form's records (a workload
    of their own, kept apart from the curve's); any other form: the rest."""
    slug = device if device is not None else bench.device_slug()
    recs = [r for r in bench.load_records(study=NAME, device=slug, root=root)
            if bool(parse_case(r.case).get("form")) == (form == "capacity")]
    return sorted(recs, key=lambda r: (r.shape.get("dcp", 1), not r.shape.get("host_tier", True),
                                       r.shape.get("concurrency", 0)))


def _step_at(steps: dict, running: float) -> tuple[int, float]:
    """The decode step (batch size, ms) measured at the size nearest the batch a run held on average."""
    sizes = sorted((int(b), float(ms)) for b, ms in steps.items())
    if not sizes:
        return 0, math.nan
    return min(sizes, key=lambda bm: (abs(bm[0] - running), -bm[0]))


def curve_rows(records) -> list[dict]:
    """One row per serving-run record: its case; TTFT, TPOT and ITL P50 / P90 (ms); the decode step
    measured at the batch size nearest the batch the run held on average (`step_ms`, at `step_batch`)
    and TPOT P90 over it (what the prefill chunks a decode step waited behind added, with the other
    iterations' admission work); the share of iterations that ran a prefill chunk besides decoding;
    output and total tokens/s/GPU, tokens/s/user (P50 over users), the prefix hit rate; requests done
    and cut at the drain limit. ValueError for a record of another study."""
    rows = []
    for r in records:
        if getattr(r, "study", None) != NAME:
            got = getattr(r, "study", type(r).__name__)
            raise ValueError(f"records must be {NAME!r} records, got {got!r}")
        s = r.extra.get("summary", {})
        ttft, tpot, itl = s.get("ttft_ms", {}), s.get("tpot_ms", {}), s.get("itl_ms", {})
        batch, step = _step_at(s.get("decode_step_ms", {}), float(s.get("mean_running", 0.0)))
        iters = s.get("iterations") or 0
        p90 = tpot.get("p90", math.nan)
        rows.append({
            "case": r.case, "concurrency": r.shape.get("concurrency"), "dcp": r.shape.get("dcp"),
            "host_tier": r.shape.get("host_tier"), "requests": s.get("requests"),
            "incomplete": s.get("incomplete"),
            "ttft_p50_ms": ttft.get("p50"), "ttft_p90_ms": ttft.get("p90"),
            "tpot_p50_ms": tpot.get("p50"), "tpot_p90_ms": tpot.get("p90"),
            "itl_p50_ms": itl.get("p50"), "itl_p90_ms": itl.get("p90"),
            "step_batch": batch, "step_ms": step,
            "tpot_p90_over_step": p90 / step if step and math.isfinite(step) else math.nan,
            "prefill_iterations": (s.get("iterations_with_prefill_and_decode", 0) / iters if iters
                                   else math.nan),
            "output_tok_s_gpu": s.get("output_tokens_per_s_gpu"),
            "total_tok_s_gpu": s.get("total_tokens_per_s_gpu"),
            "tok_s_user": (s.get("tokens_per_s_user") or {}).get("p50"), "hit_rate": s.get("hit_rate"),
        })
    return rows


REPORT_COLUMNS = {"case": "case", "requests": "requests", "ttft_p50_ms": "TTFT P50 (ms)",
                  "ttft_p90_ms": "TTFT P90 (ms)", "tpot_p50_ms": "TPOT P50 (ms)",
                  "tpot_p90_ms": "TPOT P90 (ms)",
                  "step_ms": "decode step (ms)", "itl_p90_ms": "ITL P90 (ms)",
                  "output_tok_s_gpu": "output tok/s/GPU", "total_tok_s_gpu": "total tok/s/GPU",
                  "tok_s_user": "tok/s/user P50", "hit_rate": "hit rate"}
REPORT_NOTE = {
    "cpu": "The tiny preset on this CPU, eight requests a run in a scaled-down budget: a check that the "
           "whole run works (chunked prefill, the pool, continuous batching) and the shape of its curve, "
           "not a speed.",
    "gpu": "Measured on this GPU: one TP8 rank of K3 at bf16 with random weights, collectives as stand-ins "
           "(no communication time), the workload scaled (prompts x 1/16, outputs and think times x 1/8) and "
           "the cache budget of an MI355X rank scaled alike (docs/serving_run.md).",
}


MODEL_COLUMNS = {"ttft_p50_ms": "model vs measured: TTFT P50 (%)", "tpot_p50_ms": "TPOT P50 (%)",
                 "tpot_p90_ms": "TPOT P90 (%)", "output_tokens_per_s_gpu": "output tok/s (%)"}


def report_table(records):
    """`k3lab report`'s table of this study's records: `curve_rows` in REPORT_COLUMNS, then the step
    model beside each run (extra['model']): predicted / measured - 1 in percent per MODEL_COLUMNS, and
    the term it names when one is off by more than predict.TOLERANCE."""
    import pandas as pd

    table = pd.DataFrame(curve_rows(records), columns=list(REPORT_COLUMNS)).rename(columns=REPORT_COLUMNS)
    for key, name in MODEL_COLUMNS.items():
        errs = [r.extra.get("model", {}).get(f"{key} err") for r in records]
        table[name] = [100 * e if isinstance(e, (int, float)) else math.nan for e in errs]
    table["model's wrong term"] = [r.extra.get("model", {}).get("wrong_term") or "" for r in records]
    return table


def curve_figure(rows: list[dict], title: str):
    """Two panels of `curve_rows` (one marker per run, labelled by concurrency): total and output
    tokens/s/GPU against tokens/s/user (P50), the article's axes; TTFT and TPOT P50 / P90 against
    concurrency (log scale)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s/GPU against tokens/s/user",
                                                        "TTFT and TPOT against concurrency"))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dcp"], r["host_tier"]), []).append(r)
    for (dcp, host), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        name = f"DCP{dcp}, {'host tier' if host else 'GPU only'}"
        text = [f"C={r['concurrency']}" for r in rs]
        for key, what, dash in (("total_tok_s_gpu", "total", None), ("output_tok_s_gpu", "output", "dot")):
            fig.add_trace(go.Scatter(x=[r["tok_s_user"] for r in rs], y=[r[key] for r in rs], text=text,
                                     mode="lines+markers+text", textposition="top center",
                                     line={"dash": dash}, name=f"{what} tokens, {name}"), row=1, col=1)
        for key, what, dash in (("ttft_p50_ms", "TTFT P50", None), ("ttft_p90_ms", "TTFT P90", "dot"),
                                ("tpot_p50_ms", "TPOT P50", "dash"), ("tpot_p90_ms", "TPOT P90", "dashdot")):
            fig.add_trace(go.Scatter(x=[r["concurrency"] for r in rs], y=[r[key] for r in rs],
                                     mode="lines+markers", line={"dash": dash}, name=f"{what}, {name}"),
                          row=1, col=2)
    fig.update_xaxes(title_text="tokens/s/user (P50 over users)", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s/GPU", type="log", row=1, col=1)
    fig.update_xaxes(title_text="concurrency (sessions at once)", type="log", row=1, col=2)
    fig.update_yaxes(title_text="ms", type="log", row=1, col=2)
    fig.update_layout(title=title, height=460)
    return fig



def summary_text(records) -> str:
    """One line per run: concurrency, DCP, host tier, TTFT and TPOT P50/P90, output and total tokens/s/GPU,
    hit rate."""
    lines = []
    for r in records:
        s = r.extra.get("summary", {})
        ttft, tpot = s.get("ttft_ms", {}), s.get("tpot_ms", {})
        lines.append(f"{r.case}: TTFT p50/p90 {ttft.get('p50', math.nan):.0f}/"
                     f"{ttft.get('p90', math.nan):.0f} ms, TPOT p50/p90 {tpot.get('p50', math.nan):.1f}/"
                     f"{tpot.get('p90', math.nan):.1f} ms, "
                     f"{s.get('output_tokens_per_s_gpu', math.nan):.1f} output and "
                     f"{s.get('total_tokens_per_s_gpu', math.nan):.0f} total tok/s/GPU, hit rate "
                     f"{s.get('hit_rate', math.nan):.2f}")
    return "\n".join(lines)



CAPACITY_BEGIN = ("<!-- capacity table: python -m k3lab.studies.serving.held_out --write "
                  "(k3lab/studies/serving_run/tables.py) -->")
CAPACITY_END = "<!-- end of capacity table -->"
CAPACITY_REFERENCE = "c16.dcp1.gpu_only"  # the capacity form's run where the cache binds and nothing helps


def capacity_rows(records) -> list[dict]:
    """One row per capacity-form record (ValueError for another form's or study's): its case, DCP
    degree, host tier, requests done, prefix hit rate, the cache's peak in device memory and in the host
    tier against the run's budget (GB), what it restored from the host (GB, seconds), the blocks it
    dropped (evicted with nowhere to go), TTFT and TPOT P50/P90 (ms), output and total tokens/s/GPU,
    total tokens/s/GPU over the reference run's (CAPACITY_REFERENCE, same device; None without it), and
    the step model's replay of the run (extra['model'], predict.check_run with the run's steps timed
    alone): predicted / measured - 1 per MODEL_COLUMNS key ('model <key> err') and the term it names."""
    rows = []
    for r in records:
        if getattr(r, "study", None) != NAME or parse_case(r.case).get("form") != "capacity":
            raise ValueError(f"records must be {NAME!r} capacity-form records, got {getattr(r, 'case', r)!r}")
        s = r.extra.get("summary", {})
        c, b = s.get("cache", {}), r.extra.get("describe", {}).get("cache_budget", {})
        ttft, tpot = s.get("ttft_ms", {}), s.get("tpot_ms", {})
        rows.append({
            "case": r.case.removeprefix(FORM_PREFIX), "device": r.device, "dcp": r.shape.get("dcp"),
            "host_tier": r.shape.get("host_tier"), "requests": s.get("requests"),
            "hit_rate": s.get("hit_rate"), "device_peak_gb": c.get("peak_device_bytes", 0) / 1e9,
            "device_budget_gb": b.get("gpu_bytes", math.nan) / 1e9,
            "host_peak_gb": c.get("peak_host_bytes", 0) / 1e9,
            "host_budget_gb": b.get("host_bytes", math.nan) / 1e9 if r.shape.get("host_tier") else 0.0,
            "restored_host_gb": c.get("restored_host_bytes", 0) / 1e9,
            "restore_host_s": c.get("restore_host_s", 0.0), "dropped_blocks": c.get("dropped_blocks"),
            "ttft_p50_ms": ttft.get("p50"), "ttft_p90_ms": ttft.get("p90"),
            "tpot_p50_ms": tpot.get("p50"), "tpot_p90_ms": tpot.get("p90"),
            "output_tok_s_gpu": s.get("output_tokens_per_s_gpu"),
            "total_tok_s_gpu": s.get("total_tokens_per_s_gpu"),
            **{f"model {k} err": r.extra.get("model", {}).get(f"{k} err") for k in MODEL_COLUMNS},
            "model_term": r.extra.get("model", {}).get("wrong_term"),
        })
    for row in rows:
        ref = next((x for x in rows if x["case"] == CAPACITY_REFERENCE and x["device"] == row["device"]),
                   None)
        row["total_over_reference"] = (row["total_tok_s_gpu"] / ref["total_tok_s_gpu"]
                                       if ref and ref["total_tok_s_gpu"] else None)
    return rows


def _errs(row: dict) -> str:
    keys = ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s_gpu")
    errs = [row.get(f"model {k} err") for k in keys]
    if all(e is None for e in errs):
        return "no replay recorded"
    return ", ".join("-" if e is None else f"{100 * e:+.0f}%" for e in errs)


def capacity_markdown(records, device: str) -> str:
    """docs/serving_run.md's capacity table: `capacity_rows` of `device`'s committed capacity-form runs,
    every figure from the records; a line saying none is committed when there are none."""
    rows = capacity_rows(records)
    if not rows:
        return f"No capacity-form run of {device} is committed."
    out = [f"Measured on {rows[0]['device']}, the capacity form (docs above; records "
           f"profiles/{device}/serving_run/capacity.*). The last column sets each run's total tokens/s/GPU "
           f"over {CAPACITY_REFERENCE}'s, the run where the cache binds and neither DCP8 nor the host tier "
           f"helps.", "",
           "| run | requests | hit rate | cache peak / budget in HBM (GB) | host tier peak / budget (GB) | "
           "restored from the host (GB in s) | blocks dropped | TTFT P50 / P90 (ms) | TPOT P50 / P90 (ms) | "
           "output tok/s/GPU | total tok/s/GPU | total over the reference | "
           "the model's replay: TTFT P50, TPOT P50, output tok/s (predicted / measured - 1) | "
           "the term it names |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["total_over_reference"] is None else f"{r['total_over_reference']:.2f}x"
        host = (f"{r['host_peak_gb']:.2f} / {r['host_budget_gb']:.2f}" if r["host_tier"] else "no host tier")
        out.append(f"| {r['case']} | {r['requests']} | {r['hit_rate']:.2f} | {r['device_peak_gb']:.2f} / "
                   f"{r['device_budget_gb']:.2f} | {host} | {r['restored_host_gb']:.2f} in "
                   f"{r['restore_host_s']:.2f} | {r['dropped_blocks']} | {r['ttft_p50_ms']:,.0f} / "
                   f"{r['ttft_p90_ms']:,.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p90_ms']:.1f} | "
                   f"{r['output_tok_s_gpu']:.1f} | {r['total_tok_s_gpu']:,.0f} | {ratio} | {_errs(r)} | "
                   f"{r['model_term'] or 'none'} |")
    return "\n".join(out)
