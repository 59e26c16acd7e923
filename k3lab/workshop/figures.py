"""Figures in a lesson's prose, each tied to the one value it prints.

A markdown cell that prints figures (a time, a bandwidth, a percentage, a ratio, a byte count, a serving
rate in tokens/s or a count of sequences, requests or users) lists them, in the order they appear, in its
metadata:

    "metadata": {"k3lab": {"figures": [
        ["16.5 µs", "[mla_padding/ctx32k__after.json:mode=graph/median_us]"],
        ["91%",     "100 * [mla_padding/b64_8k__after.json:mode=graph/extra/copy_bw_fraction]"],
        ["44x",     "[mla_padding/ctx32k__before.json:mode=graph/median_us]"
                    " / [mla_padding/ctx32k__after.json:mode=graph/median_us]"],
        ["98%",     "k3lab.workshop.figures.expert_share()"],
        ["7 to 25 us", "QUOTED['nccl_small_call_us']"]]}}

The source is an arithmetic expression (numbers, + - * /, a tuple for a range) whose value is in the
printed unit. Its operands are:

    [PATH:KEY/KEY/...]   one field of a committed record: PATH under profiles/<RECORDS_DEVICE>/, then the
                         keys into the JSON document; in a list, KEY=VALUE picks the element whose KEY
                         field is VALUE (a record file holds one record per mode: mode=graph), a number
                         picks by index. A key holding '/' or ']' is written with '\\/' or '\\]'.
    k3lab.MODULE.NAME... a value the library computes or holds (the config, a study's quoted seed
                         figures): a dotted name, attribute access, subscripts and calls
    QUOTED['name']       a figure someone else published (the seed article, a datasheet, NCCL's
                         numbers), kept in QUOTED below with where it comes from
    NOTED['name']        a figure k3lab measured that only a study's doc keeps (an Nsight Compute
                         counter, a probe build), kept in NOTED below with the doc

`check(markdown, figures)` says what is wrong: a printed figure with no binding, a binding for a figure
not printed, or a bound value that, rounded to the printed number of decimals, is not the printed number
(a range compares both ends). `FIGURE` is what counts as a figure.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_NUM = r"\d[\d,]*(?:\.\d+)?"
# a ratio's x is not a product's ("128 x 128", "24 x L"); a byte count needs a space before B or bytes
# ("105B" is a parameter count) and is not an adjective ("a 32-byte sector" names the hardware's unit)
BYTES = r"\s?(?:TB|GB|MB|KB|kB|GiB|MiB|KiB)(?![\w/])|\s(?:B)(?![\w/])|\sbytes?(?!\w)"
# a serving rate (tokens/s, per GPU or per user), a ratio written out ("3 times") and a count of the
# requests a server holds at once ("at 24 sequences") are figures too
RATES = r"tokens/s/GPU|tokens/s/user|tokens/s|tok/s|\s(?:times|sequences|requests|users)(?!\w)"
UNIT = r"(?:µs|us|ns|ms|TB/s|GB/s|MB/s|" + RATES + r"|%|[x×](?!\s*\d)(?!\s+[A-Z]\b)|" + BYTES + ")"
FIGURE = re.compile(r"(?<![\w.^/-])(" + _NUM + r")(?:\s*(?:-|–|to|->|→)\s*(" + _NUM + r"))?\s?(" + UNIT
                    + r")(?![\w/])")

# figures published by others that no module of the library holds, with where each comes from
QUOTED: dict[str, float | tuple[float, ...]] = {
    # NCCL's small-message latency within one node and NVLink 4's bandwidth (NVIDIA's published figures)
    "nccl_small_call_us": (7, 25),
    "nvlink4_gbs_per_direction": 450,
    "nvlink4_gbs_both": 900,
    # the seed article's figures that no study keeps as data
    "seed_pack_copy_us": 4.8,                  # section 3: one 1,792-byte pack copy on an MI355X
    "seed_kda_scan_prefill_gain_pct": (5.3, 5.6),  # section 5: input throughput at 4K and 16K, 8 MI355X
    "seed_kda_verify_us": (16.20, 5.61),       # section 5: before -> after per layer, one MI355X
    "seed_moe_rows_gain_low_pct": 1,           # section 2: "under 1%" at concurrency 32 and 48
    # the H200's boost clock and an SM's four warp schedulers (NVIDIA's Hopper figures)
    "h200_boost_clock_ghz": 1.98,
    "warp_schedulers_per_sm": 4,
    # an H200's L2 and the shared memory one block may ask for (NVIDIA's Hopper tuning guide)
    "h200_l2_mb": 60,
    "h200_smem_per_block_kib": 227,
    # the sizes of number formats, and PyTorch's CUDA caching allocator's large-block granularity
    "fp32_bytes": 4,
    "bf16_bytes": 2,
    "cuda_allocator_page_mib": 2,
}


# figures k3lab measured that only a study's doc keeps (Nsight Compute counters, probe builds): the value,
# the doc, and the doc's phrase that prints it (a test checks the doc holds the phrase)
NOTED: dict[str, tuple[float, str, str]] = {
    "kda_prologue_ncu_smem_busy_pct": (69, "docs/kda_scan.md", "the L1/shared pipe 69% busy"),
    "kda_prologue_ncu_dram_busy_pct": (31, "docs/kda_scan.md", "DRAM 31%"),
    "kda_prologue_mb": (467, "docs/kda_scan.md", "its 467 MB at copy bandwidth"),
    "mla_probe_before_request_us": (2, "docs/mla_padding.md", "~2 us of it before the first request"),
    "kda_prologue_h200_kib": (40, "docs/mi355x.md", "on the H200 the same 40 KiB of 228 KB"),
}


@dataclass(frozen=True)
class Figure:
    text: str                  # as printed, runs of white space as one space
    values: tuple[float, ...]  # one, or the two ends of a range
    decimals: tuple[int, ...]
    unit: str


def _strip_code(markdown: str) -> str:
    # code spans and LaTeX hold formulas and names, not figures; blank them keeping the offsets
    # (an escaped dollar, \$1.50 as a price, opens none)
    return re.sub(r"`[^`]*`|(?<!\\)\$(?:[^$\\]|\\.)*(?<!\\)\$", lambda m: " " * len(m.group(0)), markdown)


def figures(markdown: str) -> list[Figure]:
    """Every figure printed in a markdown cell's source, in order."""
    if not isinstance(markdown, str):
        raise TypeError(f"markdown must be a str, got {type(markdown).__name__}")
    out = []
    for m in FIGURE.finditer(_strip_code(markdown)):
        raws = [g.replace(",", "") for g in (m.group(1), m.group(2)) if g]
        out.append(Figure(" ".join(m.group(0).split()), tuple(float(r) for r in raws),
                          tuple(len(r.split(".")[1]) if "." in r else 0 for r in raws),
                          m.group(3).strip().lstrip("-")))
    return out


@lru_cache(maxsize=None)
def _document(path: str):
    from k3lab.optimizations import RECORDS_DEVICE
    return json.loads((REPO / "profiles" / RECORDS_DEVICE / path).read_text())


def field(path: str, keys: str) -> float:
    """One number of a committed record (see the module docstring for PATH and KEYS)."""
    node = _document(path)
    for key in re.split(r"(?<!\\)/", keys):
        key = key.replace("\\/", "/").replace("\\]", "]")
        if isinstance(node, list):
            if "=" in key:
                k, v = key.split("=", 1)
                hits = [e for e in node if isinstance(e, dict) and str(e.get(k)) == v]
                if len(hits) != 1:
                    raise KeyError(f"{path}: {len(hits)} elements with {k}={v}, expected one")
                node = hits[0]
            else:
                node = node[int(key)]
        else:
            node = node[key]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise TypeError(f"{path}:{keys} is {type(node).__name__}, not a number")
    return float(node)


_REF = re.compile(r"\[([^\[\]:]+\.json):((?:[^\]\\]|\\.)+)\]")
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Attribute, ast.Subscript,
            ast.Call, ast.Tuple, ast.List, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub,
            ast.keyword)


def resolve(source: str) -> tuple[float, ...]:
    """The value(s) a binding's source gives, in the printed unit."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"a figure's source must be a non-empty string, got {source!r}")
    refs: list[tuple[str, str]] = []

    def sub(m):
        refs.append((m.group(1), m.group(2)))
        return f"_field({len(refs) - 1})"

    expr = _REF.sub(sub, source)
    tree = ast.parse(expr, mode="eval")
    bad = [type(n).__name__ for n in ast.walk(tree) if not isinstance(n, _ALLOWED)]
    bad += [n.id for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id not in ("k3lab", "QUOTED", "NOTED", "_field")]
    bad += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")]
    if bad:
        raise ValueError(f"source {source!r} uses {bad[0]}; only arithmetic on fields, k3lab names, "
                         "QUOTED and NOTED is allowed")
    for name in re.findall(r"\bk3lab(?:\.\w+)+", expr):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
    value = eval(compile(tree, source, "eval"),  # noqa: S307 - the AST is checked above
                 {"__builtins__": {}, "k3lab": importlib.import_module("k3lab"), "QUOTED": QUOTED,
                  "NOTED": {k: v[0] for k, v in NOTED.items()},
                  "_field": lambda i: field(*refs[i])})
    values = value if isinstance(value, tuple) else (value,)
    return tuple(float(v) for v in values)


def printed(value: float, decimals: int) -> str:
    return f"{value:.{decimals}f}"


def check(markdown: str, bindings) -> list[str]:
    """What is wrong with one cell's figures and their bindings ([] when each figure is bound and equal)."""
    found = figures(markdown)
    bindings = list(bindings or [])
    problems = []
    texts = [f.text for f in found]
    keys = [b[0] if isinstance(b, (list, tuple)) and len(b) == 2 else None for b in bindings]
    if texts != keys:
        missing = [t for t in texts if t not in keys]
        extra = [k for k in keys if k not in texts]
        return [f"figures printed {texts} but bound {keys}"
                + (f" (no binding: {missing})" if missing else "")
                + (f" (bound, not printed: {extra})" if extra else "")]
    for fig, (_, source) in zip(found, bindings):
        try:
            got = resolve(source)
        except Exception as e:  # a broken source is reported like a wrong figure
            problems.append(f"{fig.text!r}: source {source!r} fails: {type(e).__name__}: {e}")
            continue
        if len(got) != len(fig.values):
            problems.append(f"{fig.text!r}: source gives {len(got)} value(s), printed {len(fig.values)}")
            continue
        want = [printed(v, d) for v, d in zip(fig.values, fig.decimals)]
        have = [printed(v, d) for v, d in zip(got, fig.decimals)]
        if want != have:
            problems.append(f"{fig.text!r}: its source {source!r} gives {'-'.join(have)}")
    return problems


def expert_share() -> float:
    """The routed experts' share of K3's parameters, in percent."""
    from k3lab.config import K3Config
    c = K3Config.full()
    return 100 * c.num_moe_layers * c.num_experts * c.component_params()["expert"] / c.param_counts()[0]


def weight_bytes(tp: int = 1) -> float:
    """Bytes of K3's weights as released (MXFP4 experts, BF16 elsewhere): the whole model (tp=1) or one
    rank's share under tensor parallelism `tp`."""
    from k3lab.config import K3Config
    from k3lab.model import component_table
    config = K3Config.full() if tp == 1 else K3Config.tp_slice(tp)
    return float(sum(r["bytes"] for r in component_table(config)))


def normal_coverage(sigmas: float) -> float:
    """The percentage of a normal distribution within `sigmas` standard deviations of its mean."""
    import math
    return 100 * math.erf(sigmas / math.sqrt(2))


__all__ = ["FIGURE", "NOTED", "QUOTED", "Figure", "check", "expert_share", "field", "figures",
           "normal_coverage", "printed", "resolve", "weight_bytes"]
