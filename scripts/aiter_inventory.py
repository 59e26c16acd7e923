#!/usr/bin/env python3
"""Extract a small inventory of AITER's prebuilt MLA kernels, and the signature of aiter.mla.mla_decode_fwd,
from the amd-aiter wheel on PyPI (no import: the wheel needs ROCm to import).

    pip download amd-aiter==0.1.7.post2.dev18 --no-deps -d /tmp/aiter
    python scripts/aiter_inventory.py /tmp/aiter/amd_aiter-0.1.7.post2.dev18-py3-none-any.whl

Writes profiles/isa/aiter_mla_inventory.json (per code object aiter_meta/hsa/<arch>/mla/*.co: kernel
symbol, family, query heads, dtypes, verify length, persistent / paged, and from its ELF notes via
llvm-readelf-19: LDS, VGPRs, AGPRs, SGPRs, scratch, wave and workgroup size; plus the head counts the
decode dispatcher in aiter_meta/csrc/py_itfs_cu/asm_mla.cu accepts) and profiles/isa/aiter_mla_signature.json
(the parameters of mla_decode_fwd, what it returns, and which calls write the lse it returns), each with
the wheel's name, version and sha256. The names are parsed from AITER's file-naming scheme: a16 / a8 is the
query dtype (bf16 / fp8), w16 / w8 the cache's, qhN / mqaN / subQN the query heads, qseqlenN the verify
length, _ps the persistent (work-list) form, _page the paged one.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from k3lab.isa.hip import parse_metadata  # noqa: E402

OUT = ROOT / "profiles" / "isa"
DTYPE = {"16": "bf16", "8": "fp8"}


def describe(stem: str) -> dict:
    """Fields of an AITER MLA kernel file name (see the module docstring)."""
    aw = re.search(r"a(16|8)w(16|8)", stem)
    heads = re.search(r"(?:qh|mqa)(\d+)", stem)
    qlen = re.search(r"qseqlen(\d+)", stem)
    return {
        "family": "prefill" if "_pfl_" in stem else "decode",
        "query_heads": int(heads.group(1)) if heads else None,
        "q_dtype": DTYPE[aw.group(1)] if aw else None, "kv_dtype": DTYPE[aw.group(2)] if aw else None,
        "q_len": int(qlen.group(1)) if qlen else None,
        "persistent": bool(re.search(r"_ps(_|$)", stem)), "paged": stem.endswith("_page"),
    }


def signature(src: str) -> dict:
    """mla_decode_fwd's parameters (name, default source), its return expressions and the calls that take
    the final_lse it returns, read with ast from aiter/mla.py."""
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "mla_decode_fwd")
    args = fn.args
    defaults = [None] * (len(args.args) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    params = [{"name": a.arg, "default": d, "kind": "positional_or_keyword"} for a, d in zip(args.args, defaults)]
    params += [{"name": a.arg, "default": ast.unparse(d) if d else None, "kind": "keyword_only"}
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    returns = [ast.unparse(n.value) for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    writers = sorted({ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)
                      and any(isinstance(a, ast.Name) and a.id == "final_lse" for a in n.args)})
    return {"function": "aiter.mla.mla_decode_fwd", "params": params, "varargs": bool(args.vararg or args.kwarg),
            "returns": returns, "final_lse_passed_to": writers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    whl = args.wheel
    if not whl.is_file():
        print(f"no wheel at {whl}: pip download amd-aiter==0.1.7.post2.dev18 --no-deps -d /tmp/aiter",
              file=sys.stderr)
        return 2
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()
    z = zipfile.ZipFile(whl)
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    version = re.search(r"^Version: (\S+)", meta, flags=re.M).group(1)
    prov = {"wheel": whl.name, "package": "amd-aiter", "version": version, "sha256": digest, "source": "PyPI"}
    kernels = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(n for n in z.namelist() if re.match(r"aiter_meta/hsa/gfx9\d\d/mla/.*\.co$", n)):
            path = Path(z.extract(name, tmp))
            notes = subprocess.run(["llvm-readelf-19", "--notes", str(path)], capture_output=True, text=True,
                                   check=True).stdout
            for symbol, res in parse_metadata(notes).items():
                kernels.append({"arch": name.split("/")[2], "file": path.name, "symbol": symbol,
                                **describe(path.stem), "lds_bytes": res["lds_bytes"], "vgprs": res["vgprs"],
                                "agprs": res["agprs"], "sgprs": res["sgprs"], "scratch_bytes": res["scratch_bytes"],
                                "wave": res["wave"], "workgroup_threads": res["max_workgroup"]})
    dispatcher = z.read("aiter_meta/csrc/py_itfs_cu/asm_mla.cu").decode()
    ratios = sorted({int(x) for x in re.findall(r"gqa_ratio\s*==\s*(\d+)", dispatcher)})
    args.out.mkdir(parents=True, exist_ok=True)
    inv = {"provenance": prov | {"extracted_with": "llvm-readelf-19 --notes"},
           "dispatch_query_heads_per_kv_head": ratios,
           "dispatch_source": "aiter_meta/csrc/py_itfs_cu/asm_mla.cu (gqa_ratio == N branches)", "kernels": kernels}
    (args.out / "aiter_mla_inventory.json").write_text(json.dumps(inv, indent=1) + "\n")
    sig = {"provenance": prov | {"file": "aiter/mla.py", "read_with": "ast"},
           **signature(z.read("aiter/mla.py").decode())}
    (args.out / "aiter_mla_signature.json").write_text(json.dumps(sig, indent=1) + "\n")
    print(f"{len(kernels)} kernels from {whl.name} (sha256 {digest[:12]}...); dispatcher head ratios {ratios}; "
          f"wrote {args.out}/aiter_mla_inventory.json and aiter_mla_signature.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
