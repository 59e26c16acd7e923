"""The map: each optimization of the seed article, and the whole decode step, to every name it goes by.

An optimization changes names on its way through the tree: the KDA prefill is the study `kda_scan`, the op
package `k3lab.ops.kda_chunk` and its kernels `kda_chunk_prologue.cu` / `kda_chunk_walk.cu`; the draft depth
lives in `k3lab.speculative`; copy removal is three switches, three op packages and the study module
`kda_decode`. One `Entry` per optimization holds them all:

    notebooks   globs under notebooks/ ("04_*.ipynb"), the lesson first
    studies     keys of k3lab.studies.STUDIES (`k3lab bench NAME`)
    switches    keys of k3lab.engine.SWITCHES: how the optimization is turned off in the whole step
    ops         module paths under k3lab.ops
    modules     other library modules that hold the optimization (parallel/, speculative/, cache/, engine/)
    kernels     files under kernels/ and Triton kernels as 'module.function' paths
    docs        pages under docs/
    records     folders of committed GPU records, profiles/nvidia-h200/<study>

`ENTRIES` is the model's anatomy (notebook 00) followed by `OPTIMIZATIONS`, in notebook order; the whole
step is the last optimization and lists only what it adds to the others (its own switch, ops, kernels).
`INFRASTRUCTURE` names what serves every entry and so belongs to none, each with its reason.
`problems()` lists every way the map and the tree disagree (a name that does not resolve, a study, switch,
op module, kernel, doc or records folder in no entry), so a renamed file or a new study fails a test
(tests/test_optimizations.py) rather than leaving a stale row. The report's first screen
(k3lab.report.front) and the README's notebook table (`readme_table`) are read from here.

    python -m k3lab.optimizations             the map, one block per entry
    python -m k3lab.optimizations --markdown  the README's "## Notebooks" table
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDS_DEVICE = "nvidia-h200"


@dataclass(frozen=True)
class Entry:
    """One optimization (or the model's anatomy) and every name it has in the tree (module docstring).

    name: a short key; title and does: the report's row; section: the optimization and the article's
    section number as the README states them; runs: what its notebooks run, in a line."""

    name: str
    title: str
    section: str
    does: str
    runs: str
    notebooks: tuple[str, ...]
    studies: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()
    docs: tuple[str, ...] = ()
    records: tuple[str, ...] = ()


def _rec(*studies: str) -> tuple[str, ...]:
    return tuple(f"profiles/{RECORDS_DEVICE}/{s}" for s in studies)


ANATOMY = Entry(
    "anatomy", "The model", "the model",
    "Kimi K3's layers, parameters, state and cache sizes, in plain PyTorch.",
    "K3's layer map, parameters, state and cache sizes, a tiny K3 generating tokens",
    ("00_*.ipynb",), modules=("k3lab.config", "k3lab.nn", "k3lab.model"), docs=("docs/k3.md",))

OPTIMIZATIONS: tuple[Entry, ...] = (
    Entry(
        "dcp", "Decode context parallelism (DCP)", "decode context parallelism (1)",
        "Each GPU keeps one eighth of a request's MLA history; partial attention results are merged "
        "by their log-sum-exp.",
        "the MLA history split across ranks, the log-sum-exp merge, gloo ranks on a CPU",
        ("01_*.ipynb",), studies=("dcp",), ops=("k3lab.ops.mla_decode",),
        modules=("k3lab.parallel.dcp", "k3lab.parallel.check"),
        kernels=("k3lab.ops.mla_decode.merge._merge_kernel",), docs=("docs/dcp.md",), records=_rec("dcp")),
    Entry(
        "moe_sharding", "MoE output sharding", "MoE output sharding (2)",
        "Each GPU computes only its slice of the routed experts' output projection and the existing "
        "all-reduce assembles it: no duplicated work, no new collective.",
        "each rank's slice of the output projection inside the existing all-reduce",
        ("02_*.ipynb",), studies=("moe_sharding",), switches=("moe_tail_sharded", "grouped_experts"),
        ops=("k3lab.ops.moe_experts",),
        modules=("k3lab.parallel.moe_tail",),
        kernels=("k3lab.ops.moe_experts.triton._up_kernel", "k3lab.ops.moe_experts.triton._down_kernel",
                 "k3lab.ops.moe_experts.triton._down_row_kernel",
                 "k3lab.ops.moe_experts.tail._norm_kernel", "k3lab.ops.moe_experts.tail._tail_row_kernel"),
        docs=("docs/moe_sharding.md",), records=_rec("moe_sharding")),
    Entry(
        "copy_removal", "Copy removal and fusion", "copies and fusion (3)",
        "The KDA decode step in one launch instead of five; AttnRes mixing fused with the next RMSNorm; "
        "inputs packed only where a kernel reads them.",
        "the fused KDA decode, AttnRes + RMSNorm in one kernel, packing only where read",
        ("03_*.ipynb",), studies=("copy_removal", "kda_decode", "launch_overhead"),
        switches=("kda_fused", "attn_res_fused", "pack_where_used"),
        ops=("k3lab.ops.kda_decode", "k3lab.ops.attn_res_norm", "k3lab.ops.packed_matmul"),
        kernels=("kernels/kda_decode.cu", "kernels/attn_res_norm.cu",
                 "k3lab.ops.kda_decode.triton._conv_silu_kernel",
                 "k3lab.ops.kda_decode.triton._norm_gates_recurrence_kernel",
                 "k3lab.ops.kda_decode.triton._gated_rms_norm_kernel",
                 "k3lab.ops.attn_res_norm.triton._attn_res_norm_kernel"),
        docs=("docs/copy_removal.md", "docs/kda_decode.md", "docs/launch_overhead.md"),
        records=_rec("copy_removal", "kda_decode", "launch_overhead")),
    Entry(
        "mla_padding", "MLA head padding", "MLA head padding (4)",
        "The 12 query heads of a GPU padded to 16, so a decode that splits the history across the GPU "
        "and merges the pieces applies.",
        "12 heads padded to 16, the history split across the GPU and merged",
        ("04_*.ipynb", "04b_*.ipynb"), studies=("mla_padding",), switches=("mla_padded",),
        ops=("k3lab.ops.mla_decode",),
        kernels=("kernels/mla_decode.cu", "kernels/mla_decode_before.cu", "kernels/mla_decode_wgmma.h",
                 "k3lab.ops.mla_decode.triton._before_kernel", "k3lab.ops.mla_decode.triton._split_kernel",
                 "k3lab.ops.mla_decode.triton._merge_kernel"),
        docs=("docs/mla_padding.md",), records=_rec("mla_padding")),
    Entry(
        "kda_scan", "KDA chunk scan and verification tiles", "KDA prefill and verification (5)",
        "Prefill: chunk summaries scanned, then chunks replayed in parallel. Verification: narrow value "
        "tiles for enough parallel work.",
        "chunk summaries scanned then replayed in parallel; narrow verification tiles",
        ("05_*.ipynb", "05b_*.ipynb"), studies=("kda_scan", "kda_verify", "kda_precision", "occupancy"),
        switches=("kda_verify_tiles",), ops=("k3lab.ops.kda_chunk", "k3lab.ops.kda_verify"),
        kernels=("kernels/kda_chunk_prologue.cu", "kernels/kda_chunk_walk.cu", "kernels/kda_verify.cu",
                 "k3lab.ops.kda_chunk.prologue._a_kernel", "k3lab.ops.kda_chunk.prologue._fixup_kernel",
                 "k3lab.ops.kda_chunk.prologue._inverse_kernel", "k3lab.ops.kda_chunk.prologue._wu_kernel",
                 "k3lab.ops.kda_chunk.walk._summary_kernel", "k3lab.ops.kda_chunk.walk._walk_kernel",
                 "k3lab.ops.kda_chunk.scan._scan_kernel", "k3lab.ops.kda_verify.triton.verify_stream_kernel",
                 "k3lab.ops.kda_verify.triton.verify_narrow_kernel"),
        docs=("docs/kda_scan.md", "docs/kda_verify.md"), records=_rec("kda_scan", "kda_verify", "occupancy")),
    Entry(
        "draft_depth", "Draft depth", "draft depth (6)",
        "Choose how many tokens to draft from committed tokens per cycle over the whole cycle's cost.",
        "committed tokens per cycle, simulated and by formula; choosing the depth",
        ("06_*.ipynb",), studies=("draft_depth",), modules=("k3lab.speculative",),
        docs=("docs/draft_depth.md",)),
    Entry(
        "agent_cache", "Cache offload across agent turns", "cache offload across turns (1)",
        "Keep MLA history and KDA checkpoints in host memory between turns, with resume points that agree.",
        "resume points, a prefix-cache simulator over AgentX-like traces, host<->device copies, the headline "
        "arithmetic",
        ("07_*.ipynb",), studies=("agent_cache",), modules=("k3lab.cache", "k3lab.agentx"),
        docs=("docs/agent_cache.md",), records=_rec("agent_cache")),
    Entry(
        "decode_step", "All together: one decode step", "the whole decode step",
        "One TP8 rank's whole decode step through all 93 layers, each optimization a switch.",
        "one TP8 rank through all 93 layers, each optimization switched off alone",
        ("08_*.ipynb",), studies=("decode_step",), switches=("glue_fused",),
        ops=("k3lab.ops.moe_router", "k3lab.ops.situ_glu", "k3lab.ops.gemv", "k3lab.ops.mla_glue"),
        modules=("k3lab.engine",),
        kernels=("k3lab.ops.moe_router.triton._route_sort_kernel", "k3lab.ops.moe_router.triton._topk_kernel",
                 "k3lab.ops.moe_router.triton._sort_kernel", "k3lab.ops.situ_glu._situ_glu_kernel",
                 "k3lab.ops.gemv._gemv_kernel", "k3lab.ops.gemv._stack_kernel",
                 "k3lab.ops.mla_glue._norms_kernel", "k3lab.ops.mla_glue._absorb_q_kernel",
                 "k3lab.ops.mla_glue._out_gate_kernel",
                 # the article's precisions (the step's 'precision' setting, k3lab.engine.switches): MXFP4
                 # routed experts and the FP8 MLA latent cache; checked in Triton's interpreter, on a GPU and
                 # compiled by the ISA report (where they ran: k3lab.studies.runs)
                 "k3lab.ops.moe_experts.mxfp4_kernels._up_kernel",
                 "k3lab.ops.moe_experts.mxfp4_kernels._down_kernel",
                 "k3lab.ops.moe_experts.mxfp4_kernels._down_flat_kernel",
                 "k3lab.ops.moe_experts.mxfp4_kernels._scaled_up_kernel",
                 "k3lab.ops.moe_experts.mxfp4_kernels._scaled_down_kernel",
                 "k3lab.ops.mla_decode.fp8_cache._fp8_split_kernel",
                 "k3lab.ops.mla_decode.fp8_cache._write_kernel"),
        docs=("docs/decode_step.md",), records=_rec("decode_step")),
    Entry(
        "serving", "The serving curve", "the serving curve",
        "Measured step times to tokens/s/GPU against tokens/s/user on 8 GPUs: capacity, collectives, "
        "speculation and agent turns, each optimization's share.",
        "the step model fitted to H200 steps, the Pareto curve per optimization, MI355X projected as a band "
        "carrying the model's measured error (below)",
        # serving_run: the measured serving run beside the model; its records (profiles/<device>/serving_run)
        # are read by the study itself (k3lab.studies.serving_run.measured), the model's folder here
        ("09_*.ipynb",), studies=("serving", "serving_run"), modules=("k3lab.serving",),
        docs=("docs/serving.md", "docs/serving_run.md"), records=_rec("serving")),
)

ENTRIES: tuple[Entry, ...] = (ANATOMY, *OPTIMIZATIONS)

# what serves every entry and so belongs to none: path or module -> why
INFRASTRUCTURE: dict[str, str] = {
    "k3lab.ops._build": "builds and loads every kernels/*.cu for the op packages' CUDA backends",
    "k3lab.ops.triton_math": "Triton helpers (tanh, rounding) that several ops' kernels call",
    "kernels/k3lab_mma.h": "the matrix-multiply-accumulate helpers shared by the .cu kernels",
    "kernels/k3lab_portability.h": "CUDA/HIP names and device facts shared by every .cu kernel",
    "docs/README.md": "the index of the documentation pages",
    "docs/layout.md": "the package's rooms and their import rules, each job's files beside fla's and vLLM's",
    "docs/gpu_check.md": "running tests, notebooks and report on a GPU machine: every entry's check",
    "docs/instructor.md": "the workshop's tasks across all notebooks",
    "docs/ladder.md": "the workshop's Triton ladder: the kernel puzzles before each kernel lesson",
    "docs/workshop.md": "the workshop day: agenda, prerequisites, which notebooks need a GPU",
    "docs/mi355x.md": "which kernel runs on MI355X for every op",
    "docs/profiling.md": "the profilers, traces, rooflines and trends every study's records go through",
    f"profiles/{RECORDS_DEVICE}/gpu_check": "records of the tests, notebooks and report run on the GPU "
                                             "machine",
}


def by_name(name: str) -> Entry:
    """The entry called `name`; KeyError naming the known ones."""
    for e in ENTRIES:
        if e.name == name:
            return e
    raise KeyError(f"no optimization {name!r}; known: {', '.join(e.name for e in ENTRIES)}")


def notebook_paths(entry: Entry, root: Path = REPO) -> list[Path]:
    """The notebooks of `entry` found under root/notebooks, in the entry's order (a glob may find none)."""
    return [p for g in entry.notebooks for p in sorted((root / "notebooks").glob(g))]


def _notebook_cell(entry: Entry, root: Path) -> str:
    """'`04_mla_padding` (+ `04b`)': the lesson's stem, then the other notebooks by their number."""
    paths = notebook_paths(entry, root)
    if not paths:
        return " ".join(f"`{g}`" for g in entry.notebooks)
    rest = ", ".join(f"`{p.stem.split('_', 1)[0]}`" for p in paths[1:])
    return f"`{paths[0].stem}`" + (f" (+ {rest})" if rest else "")


def readme_table(root: Path = REPO) -> str:
    """The README's notebook table (markdown, one row per entry, ending in a newline)."""
    rows = ["| notebook | optimization (article section) | what runs |", "|---|---|---|"]
    rows += [f"| {_notebook_cell(e, root)} | {e.section} | {e.runs} |" for e in ENTRIES]
    return "\n".join(rows) + "\n"


def readme_section_table(readme: str) -> str:
    """The table inside README text's "## Notebooks" section (its lines that start with '|')."""
    section = readme.split("\n## Notebooks\n", 1)[1].split("\n## ", 1)[0]
    return "".join(line + "\n" for line in section.splitlines() if line.startswith("|"))


def _imports(module: str) -> bool:
    """Whether `module` imports."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _resolves(kernel: str) -> str:
    """'' when `kernel` ('module.function') names a Triton kernel, else why not."""
    import importlib

    module, _, attr = kernel.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        return f"does not resolve ({err})"
    return "" if _is_triton_kernel(obj) else f"is a {type(obj).__name__}, not a Triton kernel"


def _is_triton_kernel(obj) -> bool:
    """A @triton.jit function, compiled (JITFunction) or in Triton's interpreter (InterpretedFunction)."""
    from triton.runtime.jit import KernelInterface

    return isinstance(obj, KernelInterface) and hasattr(obj, "fn")


def _triton_kernels() -> set[str]:
    """'module.function' of every Triton kernel named *kernel defined in a module under k3lab.ops."""
    import importlib
    import pkgutil

    import k3lab.ops

    found = set()
    for info in pkgutil.walk_packages(k3lab.ops.__path__, "k3lab.ops."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for attr, obj in vars(module).items():
            if _is_triton_kernel(obj) and attr.endswith("kernel") and obj.fn.__module__ == info.name:
                found.add(f"{info.name}.{attr}")
    return found


def problems(entries: tuple[Entry, ...] = ENTRIES, root: Path = REPO) -> list[str]:
    """Every way `entries` and the tree under `root` disagree, one line each ([] when they agree): a name
    that does not resolve (notebook glob, study, switch, module, kernel, doc, records folder), and a
    notebook, study, switch, op module, kernel, doc or records folder of the tree in no entry and not
    in `INFRASTRUCTURE`."""
    from k3lab.engine import SWITCHES
    from k3lab.studies import STUDIES

    out = []
    listed: set[str] = set(INFRASTRUCTURE)
    for e in entries:
        where = f"{e.name}:"
        for g in e.notebooks:
            if not sorted((root / "notebooks").glob(g)):
                out.append(f"{where} notebook glob {g!r} finds nothing under notebooks/")
        out += [f"{where} study {s!r} is not a key of k3lab.studies.STUDIES" for s in e.studies
                if s not in STUDIES]
        out += [f"{where} switch {s!r} is not a key of k3lab.engine.SWITCHES" for s in e.switches
                if s not in SWITCHES]
        out += [f"{where} op {m!r} is not under k3lab.ops" for m in e.ops if not m.startswith("k3lab.ops.")]
        for m in (*e.ops, *e.modules):
            if not _imports(m):
                out.append(f"{where} module {m!r} does not import")
        for k in e.kernels:
            why = ("" if (root / k).is_file() else "is not a file") if "/" in k else _resolves(k)
            out += [f"{where} kernel {k!r} {why}"] if why else []
        out += [f"{where} doc {d!r} is not a file" for d in e.docs if not (root / d).is_file()]
        for r in e.records:
            if not (root / r).is_dir():
                out.append(f"{where} records folder {r!r} is not a folder")
            elif Path(r).name not in e.studies:
                out.append(f"{where} records folder {r!r} is not one of the entry's studies")
        listed |= {*e.notebooks, *e.studies, *e.switches, *e.ops, *e.kernels, *e.docs, *e.records}
    nb_globs = [g for e in entries for g in e.notebooks]
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        if not any(nb.match(g) for g in nb_globs):
            out.append(f"notebook {nb.name} is in no entry")
    out += [f"study {s!r} is in no entry" for s in STUDIES if s not in listed]
    out += [f"switch {s!r} is in no entry" for s in SWITCHES if s not in listed]
    ops_dir = root / "k3lab" / "ops"
    for p in sorted(ops_dir.iterdir()):
        name = p.stem if p.suffix == ".py" else p.name
        module = f"k3lab.ops.{name}"
        is_module = p.suffix == ".py" or (p / "__init__.py").is_file()
        if is_module and name != "__init__" and module not in listed:
            out.append(f"op module {module} is in no entry and not infrastructure")
    for p in sorted((root / "kernels").iterdir()):
        if f"kernels/{p.name}" not in listed:
            out.append(f"kernels/{p.name} is in no entry and not infrastructure")
    out += [f"Triton kernel {k} is in no entry" for k in sorted(_triton_kernels() - listed)]
    for p in sorted((root / "docs").glob("*.md")):
        if f"docs/{p.name}" not in listed:
            out.append(f"docs/{p.name} is in no entry and not infrastructure")
    for p in sorted((root / "profiles" / RECORDS_DEVICE).iterdir()):
        if p.is_dir() and f"profiles/{RECORDS_DEVICE}/{p.name}" not in listed:
            out.append(f"profiles/{RECORDS_DEVICE}/{p.name} is in no entry and not infrastructure")
    for key in INFRASTRUCTURE:
        exists = (root / key).exists() if "/" in key else _imports(key)
        if not exists:
            out.append(f"infrastructure {key!r} does not exist")
    return out


def describe(entry: Entry) -> str:
    """The entry as a block of 'field: values' lines (fields left empty are left out)."""
    lines = [f"{entry.name}: {entry.title} [{entry.section}]"]
    for field in ("notebooks", "studies", "switches", "ops", "modules", "kernels", "docs", "records"):
        values = getattr(entry, field)
        if values:
            lines.append(f"  {field:9} " + ", ".join(values))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3lab.optimizations",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the README's notebook table")
    args = parser.parse_args(argv)
    if args.markdown:
        print(readme_table(), end="")
    else:
        print("\n\n".join(map(describe, ENTRIES)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
