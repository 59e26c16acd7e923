"""The workshop's setup check: what runs on this machine, and a one-minute smoke that proves it.

    from k3lab.workshop import setup
    setup.report()            # a table: device, Triton compiled or interpreted, peers and profilers
    python -m k3lab.workshop.setup

Each row says what is there and, where something is missing, what the notebooks use instead: a missing
GPU, FlashMLA, AITER, fla or rocprofv3 is not an error (the notebooks read committed H200 records and
traces, or run the kernels in Triton's interpreter). The smoke grades one task's solution (the Triton
kernel task, compiled on a GPU and interpreted on a CPU) and one small MLA decode against its reference,
so a broken install shows up before the workshop's first segment, not in its middle.
"""

from __future__ import annotations

import time

from k3lab import env


def _status(fn) -> tuple[bool, str]:
    try:
        out = fn()
    except Exception as exc:  # a probe that cannot even ask is a "no", with its reason
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if isinstance(out, tuple):
        return bool(out[0]), str(out[1])
    return bool(out), ""


def _flashmla():
    from k3lab.studies.peers import flashmla_status
    return flashmla_status()


def _aiter():
    from k3lab.studies.peers import aiter_status
    return aiter_status()


def _fla():
    from k3lab.studies.peers import FLA_DECODE, fla_status
    return fla_status(FLA_DECODE)


def _rocprofv3():
    from k3lab.profile import rocprofv3_available
    return rocprofv3_available(), "on PATH" if rocprofv3_available() else "not on PATH"


INSTEAD = {
    "FlashMLA": "notebook 04 shows the committed H200 FlashMLA records",
    "AITER": "k3lab's own MLA decode runs (AITER is for AMD GPUs; not yet run on AMD hardware here)",
    "fla": "notebooks 03 and 05 show the committed H200 fla records",
    "rocprofv3": "torch.profiler traces (and the committed H200 traces) are read instead",
}


def facts() -> list[dict]:
    """One row per fact: what, here (yes/no or a value), and a note (the reason, or what runs instead)."""
    d = env.detect()
    gpu = d.backend != "cpu"
    interp = env.triton_interpreted()
    rows = [{"what": "machine", "here": d.backend, "note": env.describe()},
            {"what": "GPU", "here": "yes" if gpu else "no",
             "note": "" if gpu else ("CPU: every notebook runs at tiny sizes; GPU figures come from "
                                     "committed records")},
            {"what": "Triton kernels", "here": "interpreter" if interp else "compiled",
             "note": "correct, not fast: CPU timings of kernels mean nothing" if interp else ""}]
    for name, probe in (("FlashMLA", _flashmla), ("AITER", _aiter), ("fla", _fla), ("rocprofv3", _rocprofv3)):
        ok, why = _status(probe)
        rows.append({"what": name, "here": "yes" if ok else "no",
                     "note": why if ok else f"{why}; {INSTEAD[name]}".lstrip("; ")})
    return rows


def smoke() -> list[dict]:
    """Grade the Triton task's solution and one small MLA decode against the reference; one row each with
    ok and seconds. Raises nothing: a failure is a row with ok False and the error's first line."""
    out = []

    def run(what, fn):
        t0 = time.perf_counter()
        try:
            ok, note = bool(fn()), ""
        except Exception as exc:
            ok, note = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out.append({"what": what, "ok": ok, "seconds": round(time.perf_counter() - t0, 2), "note": note})

    def task():
        from k3lab.workshop import check, solution
        return check("gated_norm_kernel", solution("gated_norm_kernel"), verbose=False)

    def mla():
        import torch

        from k3lab import runtime
        from k3lab.ops import mla_decode as mla_op
        dev = env.detect().device
        dtype = torch.bfloat16 if env.detect().backend != "cpu" else torch.float32
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 1, 12, mla_op.LATENT_DIM, generator=g).to(dev, dtype)
        cache = torch.randn(1, 130, mla_op.LATENT_DIM, generator=g).to(dev, dtype)
        pool, table = mla_op.to_paged(cache, 64)
        o, _ = mla_op.plan_after(q, pool, torch.tensor([130], device=dev), block_table=table)()
        ref, _ = mla_op.reference(q.float(), cache.float())
        runtime.check(o, ref, dtype=dtype, name="MLA decode, 12 heads padded to 16")
        return True

    run("Triton task kernel (gated RMSNorm) against fp64", task)
    run("MLA padded decode against the reference", mla)
    return out


def report():
    """facts() and smoke() as two tables (pandas DataFrames)."""
    import pandas as pd

    return pd.DataFrame(facts()), pd.DataFrame(smoke())


def main() -> int:
    f, s = report()
    print(f.to_string(index=False))
    print(s.to_string(index=False))
    return 0 if s["ok"].all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
