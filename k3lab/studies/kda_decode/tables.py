"""Tables of the kda_decode study: the text `k3lab bench kda_decode` prints after its records (per batch
and mode: before, after, fla, the floor and the ratios). It reads records and launches nothing."""

from __future__ import annotations

import math

from k3lab import bench


def summary_text(records: list[bench.Record]) -> str:
    """What `k3lab bench kda_decode` prints after its records: per batch and mode, before / after / fla,
    the floor, the ratios and the state's achieved TB/s."""
    rows = {}
    for r in records:
        rows.setdefault((r.case, r.mode), {})[r.variant] = r
    lines = [(f"{'case':>10} {'mode':>6} {'before':>9} {'after':>9} {'fla':>9} {'floor':>7} "
              f"{'bef/aft':>8} {'fla/aft':>8} {'state TB/s':>10}")]
    for (case, mode), v in sorted(rows.items(), key=lambda kv: (int(kv[0][0].split('_')[0][1:]), kv[0][1])):
        def us(name, v=v):
            return v[name].median_us if name in v else math.nan
        a = us("after")
        lines.append(f"{case:>10} {mode:>6} {us('before'):9.2f} {a:9.2f} {us('fla'):9.2f} "
                     f"{v['after'].floor_us:7.2f} {us('before') / a:8.2f} {us('fla') / a:8.2f} "
                     f"{v['after'].extra['state_tbs']:10.2f}")
    return "\n".join(lines)
