"""Tables of the copy_removal study from records: the AttnRes + RMSNorm floor traffic (`attn_res_bytes`,
which the measuring code also uses to set each record's floor) and the before / after / floor table of the
attn_res cases that notebook 03 shows. It reads records and launches nothing; by default it reads the
committed H200 records under profiles/.
"""

from __future__ import annotations

import math

from k3lab import bench
from k3lab.ops import int_arg

NAME = "copy_removal"
DEVICE = "nvidia-h200"  # the committed records a CPU reader sees
ATTN_RES_COLUMNS = ["case", "mode", "before_us", "after_us", "floor_us", "speedup", "floor_fraction"]
NOT_MEASURED = "not measured"  # a table cell whose record (or the floor it needs) is absent


def attn_res_bytes(tokens: int, sources: int, hidden: int, elem: int = 2) -> int:
    """Floor traffic of one AttnRes + RMSNorm step: read the stored blocks, the partial and the delta once;
    write the partial and the normed output (the weights are negligible). `sources` counts the stored
    blocks plus the partial; `elem` is the activations' bytes per element."""
    for name, value in (("tokens", tokens), ("sources", sources), ("hidden", hidden), ("elem", elem)):
        int_arg(name, value, low=1, what="a positive int")
    return tokens * hidden * elem * ((sources - 1) + 2 + 2)


def load(device: str = DEVICE, root=None) -> list[bench.Record]:
    """This study's records for `device` (a slug such as 'nvidia-h200' or 'cpu') under `root` (default
    profiles/): the committed ones unless told otherwise."""
    if not isinstance(device, str) or not device:
        raise TypeError(f"device must be a device slug such as {DEVICE!r}, got {device!r}")
    return bench.load_records(study=NAME, device=device, root=root)


def attn_res_records(records) -> list[bench.Record]:
    """The library's attn_res cases among `records` (sweep points and replaced kernels, named with a dot,
    are left out)."""
    records = list(records)
    bad = [r for r in records if not isinstance(r, bench.Record)]
    if bad:
        raise TypeError(f"records must be bench.Record objects, got {type(bad[0]).__name__}")
    return [r for r in records if r.study == NAME and r.case.startswith("attn_res") and "." not in r.case]


def attn_res_table(records=None, device: str = DEVICE, root=None):
    """One row per attn_res case and timing mode: before (the PyTorch sequence), after (the fused kernel),
    the floor (`attn_res_bytes` at the copy bandwidth), speedup = before / after and floor_fraction =
    floor / after. `records` defaults to `load(device, root)`. A cell whose record is absent (or a floor
    the record does not carry, as on a CPU) reads NOT_MEASURED, never a bare NaN."""
    source = load(device, root) if records is None else records
    attn = attn_res_records(source)
    if not attn:
        where = (f"under {root or bench.PROFILES}/{device}/{NAME}" if records is None
                 else "among the records given")
        raise ValueError(f"no attn_res records of {NAME} {where}")
    table = bench.compare(attn)[ATTN_RES_COLUMNS]
    values = ATTN_RES_COLUMNS[2:]
    if table[values].isna().to_numpy().any():
        table = table.astype(object)
        for col in values:
            table[col] = [NOT_MEASURED if isinstance(v, float) and math.isnan(v) else v for v in table[col]]
    return table
