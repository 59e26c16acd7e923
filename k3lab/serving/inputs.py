"""The serving model's inputs read from committed records: the measured steps as `StepPoint`s and their fits,
and the per-op figures the node model takes (k3lab.serving.node.Inputs), each with the record it came from.

Steps: the decode_step study's graph-replayed whole steps (b1_1k, b1_32k, b1_128k, b64_8k; all_on and each
no_<switch>) and, once imported, the serving study's grid (grid.b{B}_{ctx}.{variant}); a grid step and a
decode_step step at the same point and variant are both kept (two measurements).

It reads records (bench.load_records) and runs no study, so it lives with the model that reads it
(`validate`, `predict`); the serving study (k3lab.studies.serving) writes the grid and imports this.
"""

from __future__ import annotations

import statistics

from k3lab import bench
from k3lab.serving import hardware, node, stepmodel

DEVICE = "nvidia-h200"


def routing_pool(device: str = DEVICE, root=None) -> tuple[float, str]:
    """The effective expert pool of the measured steps' random router (stepmodel.routing_pool), the median
    over the decode_step records that counted the experts they read (`extra.experts_read`) at two or more
    tokens, and those records. LookupError when there is none."""
    c = node.tp_config()
    pools, used = [], []
    for r in bench.load_records("decode_step", device=device, root=root):
        tokens = int(r.shape.get("batch", 1)) * int(r.shape.get("q_len", 1))
        if r.mode == "graph" and r.extra.get("experts_read") and tokens >= 2:
            per_layer = r.extra["experts_read"] / c.num_moe_layers
            pools.append(stepmodel.routing_pool(per_layer, tokens, c.num_experts_per_token, c.num_experts))
            used.append(r.case)
    if not pools:
        raise LookupError(f"no decode_step record of {device} counted the experts it read at B > 1")
    points = ", ".join(sorted({case.split(".")[0] for case in used}))
    src = f"experts_read of {len(used)} records at {points}, profiles/{device}/decode_step/"
    return statistics.median(pools), src


def step_routing_pool(device: str = DEVICE, root=None) -> tuple[float, str]:
    """`routing_pool` of `device`, or of the H200's records where `device` has no decode_step record that
    counted its experts (the pool is a property of the steps' seeded random router weights, which every
    device draws alike, not of the device); the source says which."""
    try:
        return routing_pool(device, root)
    except LookupError:
        if device == DEVICE:
            raise
        pool, src = routing_pool(DEVICE, root)
        return pool, f"{src} (no {device} record counted its experts: the same seeded router)"


def step_points(device: str = DEVICE, root=None) -> list[stepmodel.StepPoint]:
    """Every graph-replayed whole step of one TP8 rank on `device` (decode_step and serving grid records).
    The routed experts' bytes are the ones the step read: counted where the record counted them, else
    expected from the measured routing pool (`routing_pool`) instead of the record's uniform estimate."""
    c = node.tp_config()
    pool = None
    units = hardware.named(device.replace("-", " ")).compute_units
    out = []
    for study in ("decode_step", "serving"):
        for r in bench.load_records(study, device=device, root=root):
            parts = r.case.split(".")
            if r.mode != "graph" or "bytes" not in r.extra or r.shape.get("tp") != 8:
                continue
            variant = parts[2] if study == "serving" and parts[0] == "grid" else parts[1]
            if study == "serving" and parts[0] != "grid":
                continue
            if variant not in ("all_on", "base") and not (
                variant.startswith("no_") and variant[3:] in node.SWITCH_ORDER
            ):
                continue
            B, ctx = int(r.shape["batch"]), int(r.shape["context_len"])
            tokens = B * int(r.shape.get("q_len", 1))
            by = dict(r.extra["bytes"])
            if not r.extra.get("experts_read") and tokens > 1:
                pool = pool or step_routing_pool(device, root)[0]
                k, E = c.num_experts_per_token, c.num_experts
                by["weights_experts"] *= stepmodel.distinct_experts(tokens, pool, k) / (
                    stepmodel.distinct_experts(tokens, E, k)
                )
            out.append(
                stepmodel.StepPoint(
                    variant,
                    B,
                    ctx,
                    tokens,
                    by,
                    float(r.extra["bandwidth_tbs"]),
                    float(r.median_us),
                    f"profiles/{device}/{study}/{r.case}__{r.variant}.json",
                    stepmodel.waves(tokens, c.num_attention_heads, units),
                )
            )
    return out


def fits(points: list[stepmodel.StepPoint]) -> dict[str, stepmodel.StepFit]:
    """One fit per variant with enough points (a variant measured at fewer than three points is left out)."""
    by: dict[str, list] = {}
    for p in points:
        by.setdefault(p.variant, []).append(p)
    return {v: stepmodel.fit(pts) for v, pts in by.items() if len(pts) >= 3}


def _graph(records, case: str, variant: str = "after") -> float | None:
    for r in records:
        if r.case == case and r.variant == variant and r.mode == "graph":
            return float(r.median_us)
    return None


def node_inputs(device: str = DEVICE, root=None) -> node.Inputs:
    """node.Inputs from the committed records of `device` (module docstring). LookupError naming what is
    missing when the records needed are not there."""
    pts = step_points(device, root)
    pool, pool_src = routing_pool(device, root)
    f = fits(pts)
    if "all_on" not in f:
        raise LookupError(f"no all_on whole-step records of {device} to fit (profiles/{device}/decode_step)")
    ds = [
        r
        for r in bench.load_records("decode_step", device=device, root=root)
        if r.mode == "graph" and r.case.split(".")[1:2] == ["all_on"] and "collectives" in r.extra
    ]
    by_tokens = sorted(ds, key=lambda r: r.shape["batch"])
    one, many = by_tokens[0], by_tokens[-1]
    col = one.extra["collectives"]
    n0, n1 = one.shape["batch"], many.shape["batch"]
    s0, s1 = one.extra["collectives"]["standin_us"], many.extra["collectives"]["standin_us"]
    slope = (s1 - s0) / (n1 - n0) if n1 > n0 else 0.0
    dcp = bench.load_records("dcp", device=device, root=root)
    ratios = []
    for r in dcp:
        if r.case.startswith("local_dcp8_"):
            tp = _graph(dcp, r.case.replace("dcp8", "tp8"))
            if tp:
                ratios.append(r.median_us / tp)
    m0, m64 = _graph(dcp, "merge_N8_B1"), _graph(dcp, "merge_N8_B64")
    kv = bench.load_records("kda_verify", device=device, root=root)
    mla = bench.load_records("mla_padding", device=device, root=root)

    def extra(records, fmt, base_case, ns, variant="after"):
        base = _graph(records, base_case, variant)
        table = {1: 0.0}
        for n in ns:
            t = _graph(records, fmt.format(n), variant)
            if t is not None and base is not None:
                table[n] = max(0.0, t - base)
        return table

    scan = bench.load_records("kda_scan", device=device, root=root)
    eager = {r.variant: r.median_us for r in scan if r.case == "h12_b1_t16384"}
    missing = [
        name
        for name, v in (("dcp ratios", ratios), ("dcp merge", m0 and m64), ("kda_scan h12_b1_t16384", eager))
        if not v
    ]
    if missing:
        raise LookupError(f"records missing for the node model on {device}: {missing}")
    return node.Inputs(
        fits=f,
        dense_bytes=float(one.extra["bytes"]["weights_dense"]),
        bandwidth_tbs=statistics.median(p.bandwidth_tbs for p in pts),
        coll_calls=int(col["count"]),
        coll_bytes_per_token=col["bytes"] / n0,
        standin_us=(s0, slope),
        dcp_ratio=statistics.median(ratios),
        merge_us=(m0, (m64 - m0) / 63),
        verify_extra={
            "kda_after": extra(kv, "b1_t{}", "b1_t1", (2, 4, 8)),
            "kda_before": extra(kv, "b1_t{}", "b1_t1", (2, 4, 8), "before"),
            "mla": extra(mla, "verify{}_32k", "ctx32k", range(2, 9)),
        },
        kda_prefill_us={"after": eager["after"] / 16384, "before": eager["before"] / 16384},
        sources={
            "steps": f"profiles/{device}/decode_step/ and profiles/{device}/serving/grid.*",
            "routing": f"the measured steps' random router picks from about {pool:.0f} of "
            f"{node.tp_config().num_experts} experts ({pool_src}); the served step routes uniformly over all",
            "collectives": f"profiles/{device}/decode_step/ (extra.collectives: calls, bytes, stand-ins)",
            "dcp": f"profiles/{device}/dcp/ (local_dcp8 / local_tp8, merge_N8)",
            "verify": f"profiles/{device}/kda_verify/b1_t*, profiles/{device}/mla_padding/verify*_32k",
            "prefill": f"profiles/{device}/kda_scan/h12_b1_t16384 (per token and layer)",
        },
    )
