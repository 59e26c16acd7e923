"""Bytes and flops of the problems the moe_sharding study times: the formulas its floors are made of.

`measure` floors each record on them and writes both into the record (extra['bytes'], extra['flops']);
`work_of(record)` gives the same numbers from a record's shape, which is how records saved before the
study wrote them are placed on a roofline (profiling.roofline's `work` reads the record's figures, else
these; its points say which).

  tail     k3lab.parallel.moe_tail.tail_cost: up_proj's rows and the norm weight read once, the fp32
           latent read, the output columns read and written; 2 flops per weight and token, 4 per latent
           element for the norm (the tail records have carried these since they were first measured)
  experts  the chosen experts' three projections read once (weight_bytes), the tokens' latents, each
           (token, expert) pair's gate/up output in the weights' dtype read and written, and its fp32
           latent-wide partial read and written; flops: 2 per weight each (token, expert) pair uses
           (top-k pairs, three F x latent projections)
"""

from __future__ import annotations

import dataclasses

from k3lab.config import K3Config
from k3lab.ops import int_arg
from k3lab.parallel import moe_tail as mt

PARTIAL_BYTES = 4  # the experts' latent-wide partials are fp32


def experts_work(tokens: int, top_k: int, intermediate: int, latent: int, chosen: int,
                 elem: int) -> dict[str, int]:
    """{'bytes', 'flops', 'weight_bytes'} of the routed experts for `tokens` tokens routed to `top_k`
    experts each, `chosen` distinct experts read (intermediate x latent per projection, elements of
    `elem` bytes)."""
    n, k, f, lat, c, e = (int_arg(name, v, low=1) for name, v in (
        ("tokens", tokens), ("top_k", top_k), ("intermediate", intermediate), ("latent", latent),
        ("chosen", chosen), ("elem", elem)))
    weight = c * 3 * f * lat * e
    act = n * lat * e + n * k * (f * e * 2 + lat * PARTIAL_BYTES * 2)
    return {"bytes": weight + act, "flops": 2 * n * k * 3 * f * lat, "weight_bytes": weight}


def tail_work(tokens: int, rows: int, latent: int, hidden: int, tp: int, dtype) -> dict[str, int]:
    """{'bytes', 'flops'} of one rank's tail (moe_tail.tail_cost) at `tokens` tokens: `rows` rows of
    up_proj, which is hidden (replicated) or hidden / tp (sharded)."""
    h, t = int_arg("hidden", hidden, low=1), int_arg("tp", tp, low=1)
    if rows not in (h, h // t):
        raise ValueError(f"rows must be hidden={h} (replicated) or hidden / tp={h // t} (sharded), "
                         f"got {rows!r}")
    lat = int_arg("latent", latent, low=1)
    cfg = dataclasses.replace(K3Config.full(), hidden_size=h, routed_expert_hidden_size=lat)
    cost = mt.tail_cost(cfg, t, "replicated" if rows == h else "sharded", int_arg("tokens", tokens), dtype)
    return {"bytes": int(cost["bytes"]), "flops": int(cost["flops"])}


def work_of(record) -> dict[str, int] | None:
    """{'bytes', 'flops'} of a moe_sharding record's problem from its case parameters (shape and dtype);
    None for a record whose shape is neither a tail's nor the experts'."""
    s = record.shape or {}
    if {"tokens", "top_k", "intermediate", "latent", "experts_chosen"} <= set(s):
        w = experts_work(s["tokens"], s["top_k"], s["intermediate"], s["latent"], s["experts_chosen"],
                         mt.dtype_bytes(str(record.dtype)))
        return {"bytes": w["bytes"], "flops": w["flops"]}
    if {"tokens", "rows", "latent", "hidden", "tp"} <= set(s):
        return tail_work(s["tokens"], s["rows"], s["latent"], s["hidden"], s["tp"], str(record.dtype))
    return None
