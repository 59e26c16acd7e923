"""The README's "Results on the H200" table, generated from the committed records.

`ROWS` holds each row as text with every figure written as a token `<<SOURCE|SPEC>>`: SOURCE is a
binding as the notebooks' prose uses (`k3lab.workshop.figures.resolve`: `[PATH:KEYS]` into a record under
profiles/nvidia-h200/, arithmetic on such fields, or a `k3lab.` name) and SPEC a Python format spec for the
printed value. `markdown()` renders the table; `python -m k3lab.studies.h200_table --write` rewrites it in
README.md between `TABLE_BEGIN` and `TABLE_END`; tests/test_h200_table.py checks the README's text is the
rendered one and that no figure in a row is typed outside a token (so a number can only change with its
record).
"""

from __future__ import annotations

import re
from pathlib import Path

from k3lab.studies.runs import between, section_main, write_between
from k3lab.workshop import figures as F

REPO = Path(__file__).resolve().parents[2]
TABLE_BEGIN = "<!-- H200 results: python -m k3lab.studies.h200_table --write -->"
TABLE_END = "<!-- end of H200 results -->"
TOKEN = re.compile(r"<<([^|<>]+)\|([^<>]*)>>")
HEADER = ("optimization", "case", "before", "after", "peer", "floor")


def _g(path: str, key: str = "median_us", mode: str = "graph") -> str:
    """The source of one field of one record list, picked by mode."""
    return f"[{path}:mode={mode}/{key}]"


def _us(path: str, spec: str, mode: str = "graph", key: str = "median_us") -> str:
    return f"<<{_g(path, key, mode)}|{spec}>>"


def _ms(path: str, spec: str, mode: str = "graph", key: str = "median_us") -> str:
    return f"<<{_g(path, key, mode)} / 1000|{spec}>>"


def _pct(num: str, den: str) -> str:
    return f"<<100 * {num} / {den}|.0f>>"


_KD, _CR, _MLA, _DS = "kda_decode/", "copy_removal/attn_res_", "mla_padding/", "decode_step/"
_CONV = "k3lab.config.K3Config.full().conversation_bytes_per_gpu(k3lab.studies.dcp.CONVERSATION"

ROWS: tuple[tuple[str, ...], ...] = (
    (
        "fused KDA decode (12 heads)",
        "B = 1, graph replay",
        _us(_KD + "B1_H12__before.json", ".2f") + " us",
        _us(_KD + "B1_H12__after.json", ".2f") + " us",
        "fla " + _us(_KD + "B1_H12__fla.json", ".1f") + " us",
        _us(_KD + "B1_H12__after.json", ".2f", key="floor_us") + " us",
    ),
    (
        "fused KDA decode",
        "B = 128, graph replay",
        _us(_KD + "B128_H12__before.json", ".1f") + " us",
        _us(_KD + "B128_H12__after.json", ".1f")
        + " us ("
        + _pct(_g(_KD + "B128_H12__after.json", "floor_us"), _g(_KD + "B128_H12__after.json"))
        + "% of floor)",
        "fla " + _us(_KD + "B128_H12__fla.json", ".0f") + " us",
        _us(_KD + "B128_H12__after.json", ".1f", key="floor_us") + " us",
    ),
    (
        "AttnRes + RMSNorm, 9 sources",
        "1 token, graph",
        _us(_CR + "t1_s9_graph__before.json", ".1f") + " us",
        _us(_CR + "t1_s9_graph__after.json", ".2f") + " us",
        "",
        _us(_CR + "t1_s9_graph__after.json", ".2f", key="floor_us") + " us",
    ),
    (
        "AttnRes + RMSNorm",
        "64 tokens, graph",
        _us(_CR + "t64_s9_graph__before.json", ".0f") + " us",
        _us(_CR + "t64_s9_graph__after.json", ".2f") + " us",
        "",
        _us(_CR + "t64_s9_graph__after.json", ".1f", key="floor_us") + " us",
    ),
    (
        "AttnRes + RMSNorm",
        "8192 tokens, graph",
        _ms(_CR + "t8192_s9_graph__before.json", ".1f") + " ms",
        _ms(_CR + "t8192_s9_graph__after.json", ".3f")
        + " ms ("
        + _pct(_g(_CR + "t8192_s9_graph__after.json", "floor_us"), _g(_CR + "t8192_s9_graph__after.json"))
        + "% of floor)",
        "",
        _ms(_CR + "t8192_s9_graph__after.json", ".2f", key="floor_us") + " ms",
    ),
    ("packing only where read", "decode step, 93 layers", "69 more copies", "no unused copy", "", ""),
    (
        "MLA head padding (12 heads, bf16)",
        "B = 1, 1K context, graph",
        _us(_MLA + "ctx1k__before.json", ".1f") + " us",
        _us(_MLA + "ctx1k__after.json", ".2f") + " us",
        "FlashMLA " + _us(_MLA + "ctx1k__flashmla.json", ".1f") + " us",
        _us(_MLA + "ctx1k__after.json", ".2f", key="floor_us") + " us",
    ),
    (
        "MLA head padding",
        "B = 1, 32K context, graph",
        _us(_MLA + "ctx32k__before.json", ".0f") + " us",
        _us(_MLA + "ctx32k__after.json", ".1f") + " us",
        "FlashMLA " + _us(_MLA + "ctx32k__flashmla.json", ".1f") + " us",
        _us(_MLA + "ctx32k__after.json", ".1f", key="floor_us") + " us",
    ),
    (
        "MLA head padding",
        "B = 1, 128K context, graph",
        _ms(_MLA + "ctx128k__before.json", ".2f") + " ms",
        _us(_MLA + "ctx128k__after.json", ".1f") + " us",
        "FlashMLA " + _us(_MLA + "ctx128k__flashmla.json", ".1f") + " us",
        _us(_MLA + "ctx128k__after.json", ".1f", key="floor_us") + " us",
    ),
    (
        "MLA head padding",
        "B = 64, 8K context, graph",
        _ms(_MLA + "b64_8k__before.json", ".2f") + " ms",
        _us(_MLA + "b64_8k__after.json", ".0f") + " us",
        "FlashMLA " + _us(_MLA + "b64_8k__flashmla.json", ".0f") + " us",
        _us(_MLA + "b64_8k__after.json", ".0f", key="floor_us") + " us",
    ),
    (
        "MLA head padding",
        "32K, verifying 2 / 4 positions, graph",
        _us(_MLA + "verify2_32k__before.json", ".0f")
        + " / "
        + _us(_MLA + "verify4_32k__before.json", ".0f")
        + " us",
        _us(_MLA + "verify2_32k__after.json", ".1f")
        + " / "
        + _us(_MLA + "verify4_32k__after.json", ".1f")
        + " us",
        "FlashMLA "
        + _us(_MLA + "verify2_32k__flashmla.json", ".1f")
        + " / "
        + _us(_MLA + "verify4_32k__flashmla.json", ".1f")
        + " us",
        _us(_MLA + "verify4_32k__after.json", ".1f", key="floor_us") + " us",
    ),
    (
        "KDA verification (12 heads)",
        "B = 1, 4 positions, graph",
        _us("kda_verify/b1_t4__before.json", ".1f") + " us",
        _us("kda_verify/b1_t4__after.json", ".2f") + " us",
        "fla " + _us("kda_verify/b1_t4__fla.json", ".2f") + " us",
        _us("kda_verify/b1_t4__after.json", ".2f", key="floor_us") + " us",
    ),
    (
        "KDA chunk scan (12 heads, bf16)",
        "B = 1, 16K tokens",
        _ms("kda_scan/h12_b1_t16384__before.json", ".2f", mode="eager") + " ms",
        _ms("kda_scan/h12_b1_t16384__after.json", ".2f", mode="eager") + " ms",
        "fla " + _ms("kda_scan/h12_b1_t16384__fla.json", ".2f", mode="eager") + " ms",
        _ms("kda_scan/h12_b1_t16384__after.json", ".2f", mode="eager", key="floor_us") + " ms",
    ),
    (
        "DCP8 local attention (96 heads, 1/8 of the history) vs TP8 (12 heads, all of it)",
        "128K, B = 1, graph",
        "TP8 " + _us("dcp/local_tp8_B1_L131072__after.json", ".1f") + " us (CUDA)",
        "DCP8 "
        + _us("dcp/local_dcp8_B1_L131072__after.json", ".1f")
        + " us (Triton); "
        + f"<<{_g('dcp/local_dcp8_B1_L131072__after.json')} / "
        f"{_g('dcp/local_tp8_B1_L131072.triton__after.json')}|.2f>>x TP8 on the same Triton kernel",
        "",
        _us("dcp/local_tp8_B1_L131072__after.json", ".1f", key="floor_us")
        + " / "
        + _us("dcp/local_dcp8_B1_L131072__after.json", ".1f", key="floor_us")
        + " us",
    ),
    (
        "DCP merge of 8 partial results",
        "B = 1 / 64, graph",
        "torch "
        + _us("dcp/merge_N8_B1__before.json", ".1f")
        + " / "
        + _us("dcp/merge_N8_B64__before.json", ".1f")
        + " us",
        "Triton "
        + _us("dcp/merge_N8_B1__after.json", ".2f")
        + " / "
        + _us("dcp/merge_N8_B64__after.json", ".1f")
        + " us",
        "",
        "",
    ),
    (
        "DCP cache of a 142K-token conversation",
        "per GPU, FP8",
        f"TP8 <<{_CONV}) / 1e6|.0f>> MB",
        f"DCP8 <<{_CONV}, 8) / 1e6|.0f>> MB (the formula, which `dcp.measure_shard_bytes` checks)",
        "",
        "",
    ),
    (
        "MoE tail (norm + up_proj), replicated vs sharded",
        "8 tokens, graph",
        _us("moe_sharding/tail_N8__before.json", ".1f") + " us (7168 rows)",
        _us("moe_sharding/tail_N8__after.json", ".1f") + " us (896 rows)",
        "",
        _us("moe_sharding/tail_N8__before.json", ".1f", key="floor_us")
        + " / "
        + _us("moe_sharding/tail_N8__after.json", ".2f", key="floor_us")
        + " us",
    ),
    (
        "routed experts, 16 of 896 per token",
        "1 / 64 tokens, graph",
        "loop "
        + _ms("moe_sharding/experts_N1__before.json", ".1f", mode="eager")
        + " / "
        + _ms("moe_sharding/experts_N64__before.json", ".0f", mode="eager")
        + " ms (eager)",
        "grouped "
        + _us("moe_sharding/experts_N1__after.json", ".0f")
        + " / "
        + _us("moe_sharding/experts_N64__after.json", ".0f")
        + " us",
        "",
        _us("moe_sharding/experts_N1__after.json", ".0f", key="floor_us")
        + " / "
        + _us("moe_sharding/experts_N64__after.json", ".0f", key="floor_us")
        + " us",
    ),
    (
        "host -> device copy",
        "<<[agent_cache/h2d_64MiB__after.json:mode=eager/shape/bytes] / 1048576|.0f>> MiB, "
        "pinned vs pageable",
        _us("agent_cache/h2d_64MiB__before.json", ".1f", mode="eager", key="extra/gb_per_s")
        + " GB/s pageable",
        _us("agent_cache/h2d_64MiB__after.json", ".1f", mode="eager", key="extra/gb_per_s") + " GB/s pinned",
        "",
        "",
    ),
    (
        "whole decode step, one TP8 rank, 93 layers",
        "B = 1, 32K, graph",
        _ms(_DS + "b1_32k.no_mla_padded.graph__after.json", ".1f") + " ms (MLA unpadded)",
        _ms(_DS + "b1_32k.all_on.graph__after.json", ".1f") + " ms (all on)",
        "",
        _ms(_DS + "b1_32k.all_on.graph__after.json", ".2f", key="floor_us") + " ms",
    ),
    (
        "whole decode step: router, expert sort, SiTU-GLU fused",
        "B = 1, 1K, graph",
        _ms(_DS + "b1_1k.no_glue_fused.graph__after.json", ".1f") + " ms",
        _ms(_DS + "b1_1k.all_on.graph__after.json", ".1f")
        + " ms, "
        + _us(_DS + "b1_1k.all_on.graph__after.json", ",.0f", key="extra/profile_graph/launches")
        + " kernels",
        "",
        _ms(_DS + "b1_1k.all_on.graph__after.json", ".2f", key="floor_us") + " ms",
    ),
    (
        "whole decode step: one-row projections, cuBLAS vs k3lab.ops.gemv (MoE input products stacked, "
        "MLA glue fused)",
        "B = 1, 1K, graph (the attribution runs)",
        _ms(_DS + "attribution.b1_1k.all_on__after.json", ".1f", mode="eager")
        + " ms, "
        + _us(_DS + "attribution.b1_1k.all_on__after.json", ",.0f", mode="eager", key="extra/launches")
        + " kernels",
        _ms(_DS + "attribution.b1_1k.all_on_gemv__after.json", ".1f", mode="eager")
        + " ms, "
        + _us(_DS + "attribution.b1_1k.all_on_gemv__after.json", ",.0f", mode="eager", key="extra/launches")
        + " kernels ("
        + _pct(
            _g(_DS + "attribution.b1_1k.all_on_gemv__after.json", "floor_us", "eager"),
            _g(_DS + "attribution.b1_1k.all_on_gemv__after.json", mode="eager"),
        )
        + "% of floor)",
        "",
        _ms(_DS + "attribution.b1_1k.all_on_gemv__after.json", ".2f", mode="eager", key="floor_us") + " ms",
    ),
    (
        "whole decode step: FP8 weights (W8A16 one-row GEMV) vs bf16",
        "B = 1, 1K, graph (the attribution runs)",
        "bf16 " + _ms(_DS + "attribution.b1_1k.all_on_gemv__after.json", ".1f", mode="eager") + " ms",
        "FP8 " + _ms(_DS + "attribution.b1_1k.all_on_fp8__after.json", ".1f", mode="eager") + " ms",
        "",
        _ms(_DS + "attribution.b1_1k.all_on_fp8__after.json", ".2f", mode="eager", key="floor_us") + " ms",
    ),
    (
        "launch overhead",
        "a 1,792-byte copy",
        _us("launch_overhead/copy_1792B__before.json", ".1f", mode="eager") + " us eager",
        _us("launch_overhead/copy_1792B__after.json", ".2f") + " us in a graph",
        "",
        "",
    ),
)


def render(cell: str) -> str:
    """A cell with each token replaced by its source's value printed with its spec. ValueError naming the
    token whose source fails or gives more than one value."""

    def sub(m: re.Match) -> str:
        source, spec = m.group(1).strip(), m.group(2)
        try:
            values = F.resolve(source)
        except Exception as exc:  # noqa: BLE001 - reported with the token that failed
            raise ValueError(f"token {m.group(0)!r}: {type(exc).__name__}: {exc}") from exc
        if len(values) != 1:
            raise ValueError(f"token {m.group(0)!r} gives {len(values)} values, expected one")
        return format(values[0], spec)

    return TOKEN.sub(sub, cell)


def typed_figures(rows=ROWS) -> list[str]:
    """Figures (numbers with a unit) written in a row's text outside a token: each is a number that does not
    follow its record. [] when every figure is a token."""
    out = []
    for row in rows:
        for cell in row:
            bare = TOKEN.sub("0", cell)  # a token stands for a number; the unit after it is not a figure
            bare = re.sub(r"\b0(?=\s*(?:us|ms|MB|MiB|GB/s|x|kernels)\b|%)", "", bare)
            out += [f"{row[0]!r}: {fig.text!r}" for fig in F.figures(bare)]
    return out


def markdown(rows=ROWS) -> str:
    """The table (markdown, ending in a newline)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        if len(row) != len(HEADER):
            raise ValueError(f"row {row[0]!r} has {len(row)} cells, expected {len(HEADER)}")
        lines.append(
            ("| " + " | ".join(render(c) for c in row) + " |").replace("|  |", "| |").replace("|  |", "| |")
        )
    return "\n".join(lines) + "\n"


def readme_table(readme: str) -> str:
    """The README's generated results table ('' when the markers are absent)."""
    return between(readme, TABLE_BEGIN, TABLE_END)


def write_readme(path: Path = REPO / "README.md") -> bool:
    """Rewrite the results table between the markers; True when the file changed (ValueError without them)."""
    return write_between(path, TABLE_BEGIN, TABLE_END, markdown())


def main(argv: list[str] | None = None) -> int:
    section_main(argv, prog="python -m k3lab.studies.h200_table", doc=__doc__, what="table",
                 markdown=markdown, write=write_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
