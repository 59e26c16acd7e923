"""The ceilings probe's records to figures and a table (the package docstring says what it measures);
nothing here runs on a device."""

from __future__ import annotations

import pandas as pd

NAME = "ceilings"  # records: profiles/<device>/ceilings/<case>__reference.json
VARIANT = "reference"
COPY_BYTES = 1 << 30
MATMUL_N = 8192
CASES = ("copy_1GiB", "matmul_bf16_8192")
TABLE_COLUMNS = ("device", "case", "figure", "unit", "median_us", "commit")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return float(value)


def bandwidth_tbs(nbytes, median_us) -> float:
    """TB/s of a copy of `nbytes`: each byte read once and written once, over the median time."""
    return 2 * _positive("nbytes", nbytes) / (_positive("median_us", median_us) * 1e-6) / 1e12


def matmul_tflops(n, median_us) -> float:
    """TFLOP/s of an n x n x n product: 2 n^3 flops over the median time."""
    return 2 * _positive("n", n) ** 3 / (_positive("median_us", median_us) * 1e-6) / 1e12


def table(records) -> pd.DataFrame:
    """One row per ceilings record (TABLE_COLUMNS): its device, case, the figure (TB/s or TFLOP/s), the
    median time and the commit it ran at; records of other studies are left out."""
    rows = []
    for r in records:
        if r.study != NAME:
            continue
        if "bandwidth_tbs" in r.extra:
            fig, unit = r.extra["bandwidth_tbs"], "TB/s"
        elif "matmul_tflops" in r.extra:
            fig, unit = r.extra["matmul_tflops"], "TFLOP/s"
        else:
            continue
        rows.append({"device": r.device, "case": r.case, "figure": float(fig), "unit": unit,
                     "median_us": r.median_us, "commit": r.commit})
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def summary_text(records) -> str:
    """The measured ceilings in one line per record ('' when the records hold none)."""
    df = table(records)
    return "\n".join(f"{r.device}: {r.case} {r.figure:.2f} {r.unit} (median {r.median_us:.1f} us)"
                     for r in df.itertuples())
