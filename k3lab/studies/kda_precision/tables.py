"""Tables of the kda_precision study (notebooks 05 and 05b): its records as one row per case and
precision, and the on-chip bytes of the chunk inverse's tiles against each GPU's LDS / shared memory.
They launch nothing."""

from __future__ import annotations

CHUNK = 64
BLOCK = 16


def summary(records) -> "pandas.DataFrame":  # noqa: F821
    """One row per (case, variant): precision, errors of o, state and the inverse."""
    import pandas as pd

    rows = []
    for r in records:
        rows.append({"case": r.case, "variant": r.variant, "precision": r.extra.get("precision"),
                     "inverse_rounded_to_bf16": r.extra.get("inverse_rounded_to_bf16"),
                     "o_max_rel": r.error["o"]["max_rel"], "o_rel_l2": r.error["o"]["rel_l2"],
                     "state_max_rel": r.error["state"]["max_rel"], "state_rel_l2": r.error["state"]["rel_l2"],
                     "inverse_rel_l2": r.error["inverse"]["rel_l2"], "condition": r.error["condition"]})
    return pd.DataFrame(rows)


SEED_PROLOGUE_KIB = 79.5  # the seed's chunk prologue asks for 79.5 KiB of LDS per workgroup


ONCHIP_KIB = {"MI355X": 160.0, "H200": 228_000 / 1024}  # LDS per CU; shared memory per SM (228 KB)


def inverse_tile_bytes(chunk: int = CHUNK, block: int = BLOCK) -> list[dict]:
    """Bytes of the inverse's tiles, from their shapes: the strictly lower input A kept whole or as
    its occupied block x block tiles only (the diagonal tiles and those below: 10 of 16 for 64 / 16),
    in fp32 (the seed's choice) or bf16, and the finished inverse R in bf16."""
    nb = chunk // block
    occupied = nb * (nb + 1) // 2
    rows = []
    for what, tiles in (("A, whole 64 x 64", nb * nb),
                        (f"A, {occupied} occupied {block} x {block} tiles", occupied)):
        for dtype, size in (("fp32", 4), ("bf16", 2)):
            rows.append({"buffer": what, "dtype": dtype, "tiles": tiles,
                         "bytes": tiles * block * block * size})
    rows.append({"buffer": f"R (finished inverse), {occupied} tiles", "dtype": "bf16", "tiles": occupied,
                 "bytes": occupied * block * block * 2})
    for r in rows:
        r["KiB"] = r["bytes"] / 1024
    return rows


def workgroups_per_unit(request_kib: float, unit: str) -> int:
    """How many workgroups asking `request_kib` of on-chip memory fit on one CU / SM of `unit`
    (a key of ONCHIP_KIB), by memory alone."""
    if unit not in ONCHIP_KIB:
        raise ValueError(f"unit must be one of {list(ONCHIP_KIB)}, got {unit!r}")
    if request_kib <= 0:
        raise ValueError(f"request_kib must be > 0, got {request_kib}")
    return int(ONCHIP_KIB[unit] // request_kib)


def onchip_table(extra_kib: tuple[float, ...] = (0.0, 0.5, 1.0, 5.0)) -> list[dict]:
    """The seed's 79.5 KiB prologue, and the same plus `extra_kib` (e.g. the 5 KiB that fp32 instead
    of bf16 costs for the occupied tiles of A), against 160 KiB LDS per MI355X CU and 228 KB shared
    memory per H200 SM: workgroups per unit."""
    rows = []
    for extra in extra_kib:
        req = SEED_PROLOGUE_KIB + extra
        rows.append(
            {"request_KiB": req, **{f"per {u} unit": workgroups_per_unit(req, u) for u in ONCHIP_KIB}}
        )
    return rows
