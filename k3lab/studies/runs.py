"""Where each part of k3lab has run, as data held to the committed records and to the text that states it.

`RUNS` holds one `Run` per part: the devices it ran on, each with the committed record under profiles/
that shows it (`ran_on`), and the targets it has not run on, each with the files whose text says so
(`not_run`). tests/test_runs.py holds this to the tree:
- a device claimed with no record of that device at the named path fails;
- a records folder profiles/<device>/<folder> that no claim names fails (a new run must be entered);
- a part said not to have run on a target with a record for it fails: an AMD device's folder under
  profiles/ fails every "AMD GPU" claim, a GPU claim fails "GPU";
- every file whose text states a run status ("not yet run on AMD hardware", "not yet run on a GPU",
  "not yet made" for several GPUs, "not yet on the H200": `STATEMENTS`) must be named by a part for that
  target, and every file a part names must state it; a part said not to have run on one card (`CARDS`)
  that claims a run on it fails;
- a sentence saying notebooks have no GPU (or H100, H200) timing (`NOTEBOOK_CLAIM`: "09 has no GPU
  timing yet", "03, 05b and 06-09 have no H100 figure") fails when a GPU report log under
  profiles/*/gpu_check/ timed one of them (`timed_notebooks`, read as k3lab.workshop.agenda reads them).
The README's "What runs where" table is `markdown()`, between the markers `TABLE_BEGIN` / `TABLE_END`
(`python -m k3lab.studies.runs --write` rewrites it; the test compares it).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "profiles"

# device folder under profiles/ -> the name its records carry in their "device" field ('' = any: the CPU
# records carry the machine's architecture)
DEVICES: dict[str, str] = {
    "nvidia-h200": "NVIDIA H200",
    "nvidia-h100-80gb-hbm3": "NVIDIA H100 80GB HBM3",
    "cpu": "",
}
DEVICE_LABELS: dict[str, str] = {"nvidia-h200": "H200", "nvidia-h100-80gb-hbm3": "H100", "cpu": "CPU"}
# the targets a part may not have run on, and the phrases that state it in code and docs
TARGETS = ("AMD GPU", "GPU", "several GPUs", "H200", "H100")
# the targets that are one card: the device folder whose run contradicts them
CARDS: dict[str, str] = {"H200": "nvidia-h200", "H100": "nvidia-h100-80gb-hbm3"}
def _phrase(*alternatives: str) -> re.Pattern:
    """A pattern of phrases whose words may be split across lines; the word '...' stands for any text
    inside one sentence."""
    def words(a: str) -> str:
        return r"\s+".join(r"[^.]*?" if w == "..." else re.escape(w) for w in a.split())

    return re.compile("|".join(words(a) for a in alternatives), re.I)


# checked in this order, each statement's text taken out before the next target's search (an NCCL line
# that says "not yet run on a GPU" is a statement about several GPUs)
STATEMENTS: dict[str, re.Pattern] = {
    "several GPUs": _phrase("multi-GPU NCCL runs are not yet made",
                            "NCCL / RCCL ... not yet run on a GPU"),
    "AMD GPU": _phrase("not yet run on AMD hardware", "not yet been run on AMD hardware",
                       "not yet run on ROCm", "not run on AMD hardware", "not yet on AMD hardware",
                       "nothing run on AMD hardware", "nothing here has run on AMD hardware",
                       "nothing in k3lab has run on that device", "a GPU nobody here ran on",
                       "nothing here ran on it", "compiled only: no AMD timing",
                       "gfx950 code is compiled only"),
    **{card: _phrase(f"not yet on the {card}", f"not yet run on the {card}", f"not yet run on an {card}",
                     f"not yet been run on the {card}", f"no {card} run yet") for card in CARDS},
    "GPU": _phrase("not yet run on a GPU", "not yet been run on a GPU", "GPU path is not yet run",
                   "has run only on a CPU", "no GPU timing yet"),
}
# notebooks said to have no timing on a GPU (any), or on one card: "<ids> has/have no <GPU|H100|H200>
# timing|figure", the ids two digits and a letter (05b), listed with commas and "and", or a range (06-09)
NOTEBOOK_CLAIM = re.compile(r"(?P<ids>\b\d\d[a-z]?(?:(?:\s*,\s*|\s*,?\s+and\s+|\s*-\s*)\d\d[a-z]?)*)\s+"
                            r"ha(?:s|ve)\s+no\s+(?P<card>GPU|H\d00)\s+(?:timing|figure)", re.I)
AMD_FOLDER = re.compile(r"^(amd|mi\d|instinct|gfx)", re.I)
TABLE_BEGIN = "<!-- runs table: python -m k3lab.studies.runs --write (k3lab/studies/runs.py) -->"
TABLE_END = "<!-- end of runs table -->"


@dataclass(frozen=True)
class Run:
    """One part of k3lab: `what` it is, `ran_on` {device folder: a record path under profiles/ (a file or
    a folder) that shows the run}, `not_run` {target: files (repository paths) whose text states it; none
    when only this data and the tables made from it state it}."""

    name: str
    what: str
    ran_on: dict[str, str] = field(default_factory=dict)
    not_run: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _h200(study: str) -> dict[str, str]:
    return {"nvidia-h200": f"nvidia-h200/{study}"}


RUNS: tuple[Run, ...] = (
    Run("launch_overhead", "launch costs, eager against graph replay", _h200("launch_overhead")),
    Run("copy_removal", "AttnRes + RMSNorm fused, packing where read", _h200("copy_removal")),
    Run("kda_decode", "the fused KDA decode step against five launches and fla", _h200("kda_decode")),
    Run("mla_padding", "MLA decode, 12 heads padded to 16, split history; FlashMLA beside it",
        _h200("mla_padding")),
    Run("kda_scan", "KDA chunked prefill, the group scan against the walk and fla", _h200("kda_scan")),
    Run("kda_verify", "KDA verification with narrow value tiles", _h200("kda_verify")),
    Run("kda_precision", "the chunk inverse's error, fp32 against bf16 (host-side)",
        {"cpu": "cpu/kda_precision"}),
    Run("draft_depth", "committed tokens per cycle, simulated and by formula (host-side)",
        {"cpu": "cpu/draft_depth"}),
    Run("decode_step", "one TP8 rank's whole decode step, each switch off alone", _h200("decode_step")),
    Run("agent_cache", "the prefix-cache simulator and host<->device copies", _h200("agent_cache")),
    Run("dcp", "DCP8's local attention, the merge and the cache on one GPU", _h200("dcp")),
    Run("moe_sharding", "the MoE tail replicated vs sharded, the grouped experts", _h200("moe_sharding")),
    Run("serving", "the step model fitted to measured steps, the serving curves",
        {**_h200("serving"), "nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/serving"}),
    Run("gpu_check", "the tests, notebooks and `k3lab report` on a GPU machine",
        {"nvidia-h200": "nvidia-h200/gpu_check", "nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/gpu_check"}),
    Run("occupancy", "the seed's occupancy experiment: one binary, shared memory reserved level by level",
        _h200("occupancy"), {"AMD GPU": ()}),
    Run("triton_on_amd", "the Triton kernels through Triton's AMD backend (compiled for gfx950 / gfx942 "
        "in CI; docs/mi355x.md)", {},
        {"AMD GPU": ("README.md", "docs/instructor.md", "docs/mi355x.md", "k3lab/isa/__init__.py",
                     "k3lab/isa/__main__.py", "k3lab/isa/views.py",
                     "notebooks/04_mla_padding.ipynb", "notebooks/05b_kda_deep_dive.ipynb",
                     "k3lab/ops/moe_experts/mxfp4_kernels.py",
                     "k3lab/ops/gemv.py",
                     "k3lab/ops/attn_res_norm/inputs.py", "k3lab/ops/kda_chunk/__init__.py",
                     "k3lab/ops/kda_verify/__init__.py", "k3lab/ops/kda_verify/inputs.py",
                     "k3lab/ops/kda_verify/triton.py", "k3lab/ops/moe_router/triton.py")}),
    Run("hip_kernels", "kernels/*.cu built by hipcc (compiled for gfx942 in CI)", {},
        {"AMD GPU": ("k3lab/ops/_build.py", "k3lab/ops/attn_res_norm/cuda.py", "k3lab/ops/kda_chunk/cuda.py",
                     "k3lab/ops/kda_verify/cuda.py", "k3lab/ops/mla_decode/cuda.py", "k3lab/isa/hip.py",
                     "notebooks/03_copy_removal.ipynb")}),
    Run("mi355x", "anything on an MI355X: its rooflines are the datasheet's ceilings, drawn as projected", {},
        {"AMD GPU": ("docs/profiling.md", "k3lab/profiling/roofline.py", "notebooks/03_copy_removal.ipynb")}),
    Run("aiter", "AITER's padded MLA decode as a backend and peer", {},
        {"AMD GPU": ("docs/mi355x.md", "docs/mla_padding.md", "k3lab/env.py",
                     "k3lab/ops/mla_decode/__init__.py",
                     "k3lab/ops/mla_decode/peers.py", "k3lab/studies/mla_padding/__init__.py",
                     "k3lab/studies/mla_padding/measure.py", "k3lab/studies/peers.py",
                     "k3lab/workshop/setup.py")}),
    Run("profile_ncu", "`k3lab profile --tool ncu`: the fused KDA decode and the MLA split kernel captured, "
        "the marked step selected by its NVTX range (k3lab.profiling.tools)",
        {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/ncu"}),
    Run("profile_tools", "`k3lab profile --tool` nsys and rocprofv3, HTA folders, ROCTX ranges "
        "(k3lab.profiling.tools, export)", {},
        {"GPU": ("docs/profiling.md", "k3lab/profiling/tools.py"),
         "AMD GPU": ("k3lab/profiling/tools.py", "k3lab/profiling/export.py",
                     "k3lab/studies/decode_step/attribution.py")}),
    Run("ceilings", "the roofline ceilings measured: a device copy and a bf16 matmul (the probe "
        "k3lab.studies.ceilings)", {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/ceilings"}),
    Run("article_precisions", "the article's precisions: the MXFP4 routed experts' kernels, GEMV and grouped "
        "(k3lab.ops.moe_experts.mxfp4_kernels), the FP8 MLA cache's decode (k3lab.ops.mla_decode.fp8_cache)",
        {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/gpu_check/gpu_check_tests_a87f4ff.json"}),
    Run("rocprofv3", "rocprofv3 traces and their rocpd database", {},
        {"AMD GPU": ("k3lab/profiling/rocprofv3_run.py", "k3lab/profiling/rocpd.py")}),
    Run("collectives", "DCP and the MoE tail on torch.distributed (NCCL / RCCL; gloo in the tests)", {},
        {"several GPUs": ("README.md", "k3lab/parallel/dcp.py", "k3lab/parallel/launch.py")}),
    Run("serving_run", "the measured serving run (continuous batching, chunked prefill, the prefix cache)",
        {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/serving_run"}),
    Run("decode_step_targets", "the step targets' one budgeted run (k3lab.studies.decode_step.targets)",
        {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/decode_step"}, {"H200": ()}),
    Run("serving_run_capacity", "the serving run's capacity form (the cache binds at DCP1 and holds at DCP8)",
        {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/serving_run/capacity.c16.dcp8.host__after.json"}),
    Run("decode_step_experts", "one token's routed experts alone, bf16 against MXFP4, the one-token MXFP4 "
        "launches' block choices and the grouped form (k3lab.studies.decode_step.glue.expert_records)",
        {"nvidia-h100-80gb-hbm3":
         "nvidia-h100-80gb-hbm3/decode_step/glue.experts.N1.mxfp4.up8x256w4.down4x128w4__after.json"},
        {"H200": ("k3lab/studies/decode_step/glue.py",)}),
    Run("fp8_cache_one_launch", "the FP8 MLA cache's row writer in one launch and its split pieces merged by "
        "the Triton merge kernel (k3lab.ops.mla_decode.fp8_cache)",
        {"nvidia-h100-80gb-hbm3":
         "nvidia-h100-80gb-hbm3/decode_step/attribution.b1_1k.all_on_article__after.json"},
        {"H200": ("k3lab/ops/mla_decode/fp8_cache.py",)}),
    Run("mxfp4_flat_down", "the MXFP4 experts' down launch over the token's pairs end to end "
        "(mxfp4_kernels._down_flat_kernel, down_form='flat') and its rows in the one-token sweep", {},
        {"GPU": ("k3lab/ops/moe_experts/mxfp4_kernels.py", "k3lab/studies/decode_step/glue.py",
                 "docs/decode_step.md")}),
    Run("report_gpu_memory", "the report's notebooks scheduled by their GPU memory peaks, and rerun alone "
        "after running out of memory beside others (k3lab.report.workers.run_notebooks)",
        {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/gpu_check/gpu_check_tests_302a1ad.json"}),
    Run("gpu_check_workers_stop", "scripts/gpu_check.py's --stop-after with several pytest-xdist workers "
        "(a record of the finished files inside one device call)",
        {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/gpu_check/gpu_check_tests_f9fc851_part.json"}),
)


def by_name(name: str) -> Run:
    """The part called `name`; KeyError naming the known ones."""
    for r in RUNS:
        if r.name == name:
            return r
    raise KeyError(f"no part {name!r} in RUNS; known: {', '.join(r.name for r in RUNS)}")


def _record_devices(path: Path) -> set[str]:
    """The "device" fields of the JSON records at `path` (a file or every *.json under a folder)."""
    files = [path] if path.is_file() else sorted(path.rglob("*.json"))
    found = set()
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        for rec in data if isinstance(data, list) else [data]:
            if isinstance(rec, dict) and isinstance(rec.get("device"), str):
                found.add(rec["device"])
    return found


def problems(runs: tuple[Run, ...] = RUNS, root: Path = REPO) -> list[str]:
    """Every way `runs` and the tree under `root` disagree, one line each ([] when they agree)."""
    profiles = root / "profiles"
    out = []
    names = [r.name for r in runs]
    out += [f"part {n!r} is listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    claimed = set()
    for r in runs:
        for device, rel in r.ran_on.items():
            if device not in DEVICES:
                out.append(f"{r.name}: device {device!r} is not one of {sorted(DEVICES)}")
                continue
            path = profiles / rel
            claimed.add(rel)
            if not path.exists():
                out.append(f"{r.name}: ran on {device} claims profiles/{rel}, which does not exist")
                continue
            seen = _record_devices(path)
            want = DEVICES[device]
            if not seen or (want and want not in seen):
                out.append(f"{r.name}: ran on {device} claims profiles/{rel}, whose records name "
                           f"{sorted(seen) or 'no device'}")
        for target, files in r.not_run.items():
            if target not in TARGETS:
                out.append(f"{r.name}: target {target!r} is not one of {TARGETS}")
                continue
            if target == "GPU" and any(d != "cpu" for d in r.ran_on):
                out.append(f"{r.name}: said not to have run on a GPU, but ran on {sorted(r.ran_on)}")
            if target in CARDS and CARDS[target] in r.ran_on:
                out.append(f"{r.name}: said not to have run on the {target}, but ran on it "
                           f"(profiles/{r.ran_on[CARDS[target]]})")
            for f in files:
                p = root / f
                if not p.is_file():
                    out.append(f"{r.name}: {f} (stating it has not run on {target}) is not a file")
                elif target not in statements(_text(p)):
                    out.append(f"{r.name}: {f} is said to state that it has not run on {target}, "
                               "and does not")
    amd = sorted(p.name for p in profiles.iterdir() if p.is_dir() and AMD_FOLDER.match(p.name))
    if amd:
        out += [f"{r.name}: said not to have run on an AMD GPU, but profiles/ holds {amd}" for r in runs
                if "AMD GPU" in r.not_run]
    for device in DEVICES:
        folder = profiles / device
        for p in sorted(folder.iterdir()) if folder.is_dir() else []:
            rel = f"{device}/{p.name}"
            if p.is_dir() and rel not in claimed:
                out.append(f"profiles/{rel} is in no part's ran_on")
    for p in sorted(profiles.iterdir()):
        # isa: the ISA reports; projected: records a model projected to another GPU (bench.records.PROJECTED)
        if p.is_dir() and p.name not in DEVICES and p.name not in ("isa", "projected"):
            out.append(f"profiles/{p.name} is a device folder not in runs.DEVICES")
    named = {(t, f) for r in runs for t, files in r.not_run.items() for f in files}
    timed = None
    for path in _stating_files(root):
        rel = path.relative_to(root).as_posix()
        text = _text(path)
        for target in statements(text):
            if (target, rel) not in named:
                out.append(f"{rel} states a part has not run on {target}, and no part of runs.RUNS names it")
        claims = notebook_claims(text, root)
        if claims and timed is None:
            timed = timed_notebooks(root)
        for ids, card, notebooks in claims:
            for nb in notebooks:
                logs = [log for label, log in (timed or {}).get(nb, {}).items() if card in ("GPU", label)]
                if logs:
                    verb = "have" if len(notebooks) > 1 else "has"
                    out.append(f"{rel} says {ids} {verb} no {card} timing, but {logs[0]} timed {nb}")
    return out


def _notebook_names(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "notebooks").glob("*.ipynb"))


def notebook_claims(text: str, root: Path = REPO) -> list[tuple[str, str, list[str]]]:
    """Each NOTEBOOK_CLAIM in `text`: (the ids as written, the card or 'GPU', the notebooks under root's
    notebooks/ they name; a range 06-09 names every notebook whose two digits lie in it)."""
    names = _notebook_names(root)

    def short(nb: str) -> str:
        m = re.match(r"\d\d[a-z]?(?=_|$)", nb)
        return m[0] if m else nb

    out = []
    for m in NOTEBOOK_CLAIM.finditer(text):
        chosen: list[str] = []
        for part in re.split(r"\s*,\s*|\s*,?\s+and\s+", m["ids"].strip()):
            lo, _, hi = (x.strip() for x in part.partition("-"))
            chosen += [n for n in names
                       if (lo <= short(n)[:2] <= hi if hi else short(n) == lo) and n not in chosen]
        card = m["card"].upper()
        out.append((" ".join(m["ids"].split()), card, chosen))
    return out


def timed_notebooks(root: Path = REPO) -> dict[str, dict[str, str]]:
    """notebook -> {card ('H100', 'H200'): the first GPU report log under profiles/*/gpu_check/ in which
    it passed}, the logs read by k3lab.workshop.agenda.parse_report_log (the agenda's own reader)."""
    from k3lab.workshop.agenda import parse_report_log

    out: dict[str, dict[str, str]] = {}
    for log in sorted((root / "profiles").glob("*/gpu_check/report_*.log")):
        folder = log.parent.parent.name
        card = next((c for c, f in CARDS.items() if f == folder), DEVICE_LABELS.get(folder, folder))
        for nb, t in parse_report_log(log.read_text(errors="replace")).items():
            if t.seconds is not None:
                out.setdefault(nb, {}).setdefault(card, log.relative_to(root).as_posix())
    return out


def statements(text: str) -> set[str]:
    """The targets `text` states a part has not run on (STATEMENTS, in order, each match taken out)."""
    found = set()
    for target, pattern in STATEMENTS.items():
        text, n = pattern.subn(" ", text)
        if n:
            found.add(target)
    return found


def _text(path: Path) -> str:
    """A file's text; a notebook's cell sources joined (so statements in outputs or metadata do not count)."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n".join("".join(c["source"]) for c in cells)
    return path.read_text()


def _stating_files(root: Path) -> list[Path]:
    """The files whose statements are held to the data: README.md, docs/*.md, k3lab/**/*.py, notebooks."""
    files = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "k3lab").rglob("*.py"),
             *(root / "notebooks").glob("*.ipynb")]
    return sorted(f for f in files if f.name != "runs.py" or f.parent.name != "studies")  # not this file


def markdown(runs: tuple[Run, ...] = RUNS) -> str:
    """The README's table: one row per part, where it ran (with the record) and where not yet."""
    rows = ["| part | what | ran on (committed record) | stated as not yet run on |", "|---|---|---|---|"]
    for r in runs:
        ran = ", ".join(f"{DEVICE_LABELS[d]} (`profiles/{rel}`)" for d, rel in r.ran_on.items()) or "-"
        rows.append(f"| `{r.name}` | {r.what} | {ran} | {', '.join(r.not_run) or '-'} |")
    return "\n".join(rows) + "\n"


def between(text: str, begin: str, end: str) -> str:
    """The text between the markers `begin` and `end` ('' when either is absent), ending in a newline."""
    if begin not in text or end not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def write_between(path: Path, begin: str, end: str, body: str) -> bool:
    """Put `body` between the markers in the file at `path`; True when the file changed. ValueError naming
    the markers when the file lacks them (a generated section is never appended blindly)."""
    text = path.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{path} lacks the markers {begin!r} ... {end!r}")
    head, rest = text.split(begin, 1)
    new = f"{head}{begin}\n{body}{end}{rest.split(end, 1)[1]}"
    if new != text:
        path.write_text(new)
    return new != text


def readme_table(readme: str) -> str:
    """The README's generated run table ('' when the markers are absent)."""
    return between(readme, TABLE_BEGIN, TABLE_END)


def write_readme(path: Path = REPO / "README.md") -> bool:
    """Rewrite the run table between the markers; True when the file changed."""
    return write_between(path, TABLE_BEGIN, TABLE_END, markdown())


def section_main(argv: list[str] | None, *, prog: str, doc: str, what: str, markdown, write,
                 target: str = "README.md") -> None:
    """The command line every generated section of a page shares: print the section (`markdown()`), or
    with --write rewrite it in `target` (`write()`, True when the file changed)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {target}'s {what}")
    if parser.parse_args(argv).write:
        print(target, "rewritten" if write() else "unchanged")
    else:
        print(markdown(), end="")


@dataclass(frozen=True)
class PageSection:
    """A page's section generated from records: `page` (a file under the repository), its markers, and
    `markdown()` making its text; `module` is the command that prints or rewrites it (`main`)."""

    page: Path
    begin: str
    end: str
    markdown: Callable[[], str]
    module: str
    doc: str
    what: str = "headline table"

    def in_doc(self, text: str) -> str:
        """The section in the page's text ('' when its markers are absent)."""
        return between(text, self.begin, self.end)

    def write(self) -> bool:
        """Rewrite the section from the committed records; True when the file changed."""
        return write_between(self.page, self.begin, self.end, self.markdown())

    def main(self, argv: list[str] | None = None) -> int:
        section_main(argv, prog=f"python -m {self.module}", doc=self.doc, what=self.what,
                     markdown=self.markdown, write=self.write, target=self.page.relative_to(REPO).as_posix())
        return 0


def main(argv: list[str] | None = None) -> int:
    section_main(argv, prog="python -m k3lab.studies.runs", doc=__doc__, what="table", markdown=markdown,
                 write=write_readme)
    bad = problems()
    for line in bad:
        print("problem:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
