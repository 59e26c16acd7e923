"""Bytes and flops of the problems the dcp study times: the formulas its floors are made of.

`measure` floors each record on `local_work` / `merge_work`'s bytes and writes both figures into the
record (extra['bytes'], extra['flops']); `work_of(record)` gives the same numbers from a record's shape,
which is how records saved before the study wrote them are placed on a roofline (profiling.roofline's
`work` reads the record's figures, else these; its points say which).

  local attention  the MLA op's after for one decode token at TP8's or DCP8's per-GPU shape:
                   bytes = the latent cache read once (batch x rows x 576 elements; the floor's),
                   flops = the MLA op's count, k3lab.ops.mla_decode.decode_flops (per head and
                   cached row the score over the 576-wide latent and the 512-wide value sum)
  merge            N partials of `heads` heads merged by their log-sum-exps:
                   bytes = each partial's value_dim elements and its fp32 lse read once (the floor's),
                   flops = the weighted sum, 2 per partial value element (the few exp/max per row
                   left out)
"""

from __future__ import annotations

from k3lab.ops import int_arg
from k3lab.ops.mla_decode.inputs import LATENT_DIM, decode_flops
from k3lab.parallel.moe_tail import dtype_bytes

LSE_BYTES = 4  # the merge's log-sum-exps are fp32


def local_work(batch: int, rows: int, heads: int, elem: int) -> dict[str, int]:
    """{'bytes', 'flops'} of the local attention over `rows` cached positions of `batch` sequences,
    `heads` query heads, cache elements of `elem` bytes."""
    b, n, h = (int_arg(k, v, low=1) for k, v in (("batch", batch), ("rows", rows), ("heads", heads)))
    e = int_arg("elem", elem, low=1)
    return {"bytes": b * n * LATENT_DIM * e, "flops": decode_flops(b * n, h)}


def merge_work(pieces: int, batch: int, heads: int, value_dim: int, elem: int) -> dict[str, int]:
    """{'bytes', 'flops'} of merging `pieces` partials [batch, heads, value_dim] (elements of `elem`
    bytes) with their fp32 log-sum-exps."""
    p, b, h, d = (int_arg(k, v, low=1) for k, v in (("pieces", pieces), ("batch", batch), ("heads", heads),
                                                    ("value_dim", value_dim)))
    e = int_arg("elem", elem, low=1)
    return {"bytes": p * b * h * (d * e + LSE_BYTES), "flops": 2 * p * b * h * d}


def work_of(record) -> dict[str, int] | None:
    """{'bytes', 'flops'} of a dcp record's problem from its case parameters (shape and dtype); None for
    a record whose shape is neither a local attention's nor a merge's."""
    s, elem = record.shape or {}, dtype_bytes(str(record.dtype))
    if {"batch", "rows", "heads"} <= set(s) and record.case.startswith("local_"):
        return local_work(s["batch"], s["rows"], s["heads"], elem)
    if {"pieces", "batch", "heads", "value_dim"} <= set(s):
        return merge_work(s["pieces"], s["batch"], s["heads"], s["value_dim"], elem)
    return None
