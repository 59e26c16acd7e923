"""Checks and timings of the kda_verify study (the package docstring says what it measures): its cases,
each variant checked against the fp32 reference before it is timed into records.
"""

from __future__ import annotations

import re
import zlib
from typing import Callable

import torch

from k3lab import bench
from k3lab import env as _env
from k3lab.config import K3Config
from k3lab.ops import kda_verify as kv
from k3lab.studies import select_cases
from k3lab.studies.peers import FLA_RECURRENT, fla_status, on_gpu

from .tables import bytes_moved, NAME


GPU_SHAPES = [(1, 4), (8, 4), (32, 4), (1, 1), (1, 2), (1, 8)]  # (batch, positions); T = 1..8 for draft depth
CPU_SHAPES = [(1, 4)]
ABLATIONS = ("narrow_only", "narrow_1wave", "ragged")
SWEEP_BATCHES = (1, 8, 32)
SWEEP = [("narrow", w, n) for w in (4, 8) for n in (1, 2)] + [("stream", w, n) for w in (4, 8, 16, 32) for n
                                                              in (1, 4)]
CUDA_ABLATION = "b1_t4.cudawarp8_w4"  # the CUDA kernel launched plainly (the default adds PDL)
MIN_GRAPH_CALLS = 10
GATE_LOWER_BOUND = K3Config.full().kda_gate_lower_bound  # -5: g = -5 sigmoid(.)


def _heads(preset) -> int:
    return K3Config.preset(preset or _env.default_preset()).kda_num_heads


def _input_dtype() -> torch.dtype:
    # bf16 inputs as served; fp32 on CPU, where the Triton interpreter runs the kernels
    return torch.bfloat16 if on_gpu() else torch.float32


def case_names(preset=None) -> list[str]:
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    shapes = GPU_SHAPES if on_gpu() else CPU_SHAPES
    names = []
    for B, T in shapes:
        names += [f"b{B}_t{T}", f"b{B}_t{T}.final_only"]
    if on_gpu():
        names += [f"b1_t4.{a}" for a in ABLATIONS]
        names += [f"b{B}_t4.{kind}{w}_w{n}" for B in SWEEP_BATCHES for kind, w, n in SWEEP]
        if kv.BACKENDS.status()["cuda"][0]:  # the .cu built here
            names.append(CUDA_ABLATION)
    else:
        names.append("b1_t4.ragged")
    return names


# ----------------------------------------------------------------------------------------------
# inputs, reference, floor


def make_inputs(B: int, T: int, H: int, *, V: int = kv.HEAD_DIM, dtype=None, device=None,
                generator: torch.Generator | None = None) -> dict:
    """Fresh random verify inputs: L2-normalised q, k; K3-style gates g = -5 sigmoid(x) (fp32);
    beta = sigmoid(x); a random fp32 state with the scale of a long-running one."""
    dtype = dtype or _input_dtype()
    device = device or _env.detect().device
    K = kv.HEAD_DIM

    def rn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32)

    t = {
        "q": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1).to(dtype),
        "k": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1).to(dtype),
        "v": rn(B, T, H, V).to(dtype),
        "g": GATE_LOWER_BOUND * torch.sigmoid(rn(B, T, H, K) * 2.0 - 1.0),
        "beta": torch.sigmoid(rn(B, T, H)).to(dtype),
        "initial_state": rn(B, H, K, V) * 0.5,
    }
    return {n: x.to(device) for n, x in t.items()}


def floor_parts(B: int, T: int, H: int, in_bytes: int, *, final_only: bool, mode: str) -> dict:
    """The memory floor and the one-launch floor (graph or eager launch cost) and their max."""
    launch_mode = "graph" if mode == "graph" else "eager"
    parts = bench.floor_breakdown(bytes=bytes_moved(B, T, H, in_bytes, final_only=final_only),
                                  launches=1 if on_gpu() else 0, launch_mode=launch_mode)
    return {"floor_us": parts["floor_us"], "floor_memory_us": parts["memory_us"],
            "floor_launch_us": parts["launch_us"],
            "bytes": bytes_moved(B, T, H, in_bytes, final_only=final_only)}


def reference(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 outputs [B, T, H, V] and per-position states [B, T, H, K, V] (k3lab.nn.kda)."""
    return kv.reference_verify(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                               inputs["initial_state"])


def check_result(o, states, ref_o, ref_states, *, final_only: bool) -> dict:
    """Outputs (in their dtype's bound) and states (fp32 bound) against fp64; per-position state
    errors too. Raises bench.CheckFailed outside the bounds."""
    ref_s = ref_states[:, -1] if final_only else ref_states
    figs = bench.check_all({"o": (o, ref_o), "states": (states, ref_s)},
                           dtype={"o": o.dtype, "states": torch.float32})
    if not final_only:
        figs["state_max_rel_by_position"] = [
            bench.check(states[:, t], ref_states[:, t], dtype=torch.float32, name=f"state[{t}]")["max_rel"]
            for t in range(states.shape[1])]
    return figs


# ----------------------------------------------------------------------------------------------
# variants


def _variant_fn(kind: str, *, final_only: bool, tile_v: int | None = None, num_warps: int | None = None,
                ragged: bool = False, backend: str | None = None, pdl: bool | None = None) -> Callable:
    """fn(q, k, v, g, beta, h0, states_buf) -> (o, states) for one variant."""
    if kind == "fla":
        from fla.ops.kda import fused_recurrent_kda

        def run_fla(q, k, v, g, beta, h0, buf):
            return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return run_fla
    fn = kv.kda_verify if kind == "after" else kv.kda_verify_before
    kw = {"final_state_only": final_only}
    if tile_v is not None:
        kw["tile_v"] = tile_v
    if num_warps is not None and backend != "cuda":
        kw["num_warps"] = num_warps
    if kind == "after":
        kw.update(backend=backend, pdl=pdl)

    if ragged:  # the same work through the dynamic path: flattened tokens + cu_seqlens
        def run_ragged(q, k, v, g, beta, h0, buf, cu, T):
            B = q.shape[0]
            flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
            out = buf.view(1, B * T, *buf.shape[2:]) if buf is not None and not final_only else buf
            o, s = fn(*flat, h0, cu_seqlens=cu, max_seqlen=T, states_out=out, **kw)
            return o.view(B, T, *o.shape[2:]), (s.view(B, T, *s.shape[2:]) if not final_only else s)
        return run_ragged

    def run(q, k, v, g, beta, h0, buf):
        return fn(q, k, v, g, beta, h0, states_out=buf, **kw)
    return run


def _parse(case: str, H: int) -> dict:
    """Case name -> what to run: shape, final_only and the list of (variant label, spec); a spec's
    kind is 'after' (kda_verify), 'before' (the streaming kernel via kda_verify_before) or 'fla'.
    An 'after' spec without a backend runs kda_verify's default (resolved on the inputs by `run`)."""
    base, _, tail = case.partition(".")
    B, T = (int(x[1:]) for x in base.split("_"))
    after_w = kv.choose_tile_v(B, H)
    after = dict(kind="after", tile_v=after_w, num_warps=None, backend=None)
    before = dict(kind="before", tile_v=kv.BEFORE_TILE_V, num_warps=kv.before_num_warps())
    narrow_w = kv.min_tile_v()
    spec = {"B": B, "T": T, "final_only": tail == "final_only", "variants": []}
    if tail in ("", "final_only"):
        spec["variants"] = [("before", before), ("after", after)]
        if fla_status(FLA_RECURRENT)[0]:  # fla's fused_recurrent_kda as the peer
            spec["variants"].append(("fla", dict(kind="fla", tile_v=32, num_warps=4)))
    elif tail == "narrow_only":  # narrow tiles in the original kernel: 128 threads, per-token loads
        spec["variants"] = [("after", dict(kind="before", tile_v=narrow_w, num_warps=kv.before_num_warps()))]
    elif tail == "narrow_1wave":  # + one wave per program
        spec["variants"] = [("after", dict(kind="before", tile_v=narrow_w, num_warps=1))]
    elif tail == "ragged":  # the after kernel through its dynamic (cu_seqlens) path
        spec["variants"] = [("after", dict(after, ragged=True))]
    elif case == CUDA_ABLATION:  # the CUDA kernel, plain launch
        spec["variants"] = [
            ("after", dict(kind="after", tile_v=8, num_warps=kv.cuda.NUM_WARPS, backend="cuda", pdl=False))
        ]
    else:
        m = re.fullmatch(r"(narrow|stream)(\d+)_w(\d+)", tail)
        if m is None or (m[1] == "narrow" and int(m[2]) > kv.NARROW_MAX):
            raise ValueError(f"unknown case {case!r}")
        v = dict(kind="before" if m[1] == "stream" else "after", tile_v=int(m[2]), num_warps=int(m[3]))
        if m[1] == "narrow":
            v["backend"] = "triton"
        spec["variants"] = [("after", v)]
    return spec


def _resolved(vs: dict, x: tuple) -> dict:
    """An 'after' spec with the backend and waves kda_verify picks for inputs `x`, so the record names
    what ran."""
    if vs["kind"] != "after" or vs["tile_v"] > kv.NARROW_MAX:
        if vs["num_warps"] is None:
            return dict(vs, num_warps=kv.choose_num_warps(vs["tile_v"]))
        return vs
    backend = vs.get("backend") or kv.BACKENDS.choose(None, *x[:6], vs["tile_v"], states=x[6])[0]
    warps = kv.cuda.NUM_WARPS if backend == "cuda" else (vs["num_warps"] or kv.choose_num_warps(vs["tile_v"]))
    return dict(vs, backend=backend, num_warps=warps)


def _pdl_used(vs: dict) -> bool:
    """Whether a variant's launches are programmatic dependents (the CUDA backend, asked by the case or,
    for the default 'after', as kda_verify decides)."""
    if vs.get("kind") != "after" or vs.get("backend") != "cuda":
        return False
    return bool(vs["pdl"]) if vs.get("pdl") is not None else kv.cuda.pdl_default()


def kernel_name(kind: str, tile_v: int, backend: str | None = None) -> str:
    """Which kernel a variant runs: 'narrow' (Triton) or 'cuda_warp' (kernels/kda_verify.cu) for
    kda_verify at <= NARROW_MAX columns, 'stream' (the streaming kernel) or 'fla'."""
    if kind == "fla":
        return "fla"
    if kind == "after" and tile_v <= kv.NARROW_MAX:
        return "cuda_warp" if backend == "cuda" else "narrow"
    return "stream"


def _timing_args(graph: bool, n_sets: int) -> dict:
    if not on_gpu():
        return {"warmup": 1, "repeats": 3}
    if graph:  # one graph replays every input set (>= 10 calls), so no call finds its inputs in L2
        return {"warmup": 10, "repeats": 100, "graph": True, "calls_per_sample": max(n_sets, MIN_GRAPH_CALLS)}
    return {"warmup": 10, "repeats": 100}


def run(preset=None, cases=None, *, modes=None, repeats: int | None = None) -> list[bench.Record]:
    """Check every variant of every case against the fp64 reference, then time it (eager and graph
    replay on a GPU, perf_counter on CPU; the sweep and ablation cases in graph replay only).
    `repeats`: timed samples per variant and mode (None: 100 on a GPU, 3 on a CPU)."""
    if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"repeats must be a positive integer or None, got {repeats!r}")
    chosen = select_cases(case_names(preset), cases)
    H = _heads(preset)
    dev = _env.detect().device
    dtype = _input_dtype()
    in_bytes = torch.tensor([], dtype=dtype).element_size()
    records: list[bench.Record] = []
    for case in chosen:
        spec = _parse(case, H)
        B, T, final_only = spec["B"], spec["T"], spec["final_only"]
        main = "." not in case or case.endswith(".final_only")
        case_modes = modes or ((["eager", "graph"] if main else ["graph"]) if on_gpu() else ["cpu"])
        gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))

        def make():
            x = make_inputs(B, T, H, dtype=dtype, device=dev, generator=gen)
            shape = (B, H, kv.HEAD_DIM, kv.HEAD_DIM) if final_only else (B, T, H, kv.HEAD_DIM, kv.HEAD_DIM)
            buf = torch.empty(shape, dtype=torch.float32, device=dev)
            return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], buf)

        per_set = bytes_moved(B, T, H, in_bytes, final_only=final_only)
        sets = bench.rotation_sets(make, per_set, max_sets=32) if on_gpu() else [make()]
        first = dict(zip(("q", "k", "v", "g", "beta", "initial_state"), sets[0][:6]))
        ref_o, ref_states = reference(first)
        for label, vs in spec["variants"]:
            vs = _resolved(vs, sets[0])
            fn = _variant_fn(vs["kind"], final_only=final_only, tile_v=vs["tile_v"],
                             num_warps=vs["num_warps"],
                             ragged=vs.get("ragged", False), backend=vs.get("backend"), pdl=vs.get("pdl"))
            if vs.get("ragged"):
                cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev)
                inner = fn
                fn = lambda *a, _f=inner, _cu=cu: _f(*a, _cu, T)  # noqa: E731
            o, states = fn(*sets[0])
            err = check_result(o, states, ref_o.to(o.device), ref_states.to(o.device),
                               final_only=final_only or vs["kind"] == "fla")
            for mode in case_modes:
                kw = _timing_args(mode == "graph", len(sets))
                t = bench.time_fn(fn, rotate=sets, **{**kw, **({"repeats": repeats} if repeats else {})})
                fl = floor_parts(B, T, H, in_bytes, final_only=final_only or vs["kind"] == "fla", mode=t.mode)
                extra = {"kernel": kernel_name(vs["kind"], vs["tile_v"], vs.get("backend")),
                         "backend": vs.get("backend"), "pdl": _pdl_used(vs),
                         "tile_v": vs["tile_v"], "num_warps": vs["num_warps"],
                         "workgroups": kv.workgroups(B, H, vs["tile_v"]),
                         "compute_units": _env.detect().compute_units, "wave_width": _env.detect().wave_width,
                         "path": "ragged" if vs.get("ragged") else "uniform",
                         "states_written": "final" if (final_only or vs["kind"] == "fla")
                         else "every position",
                         "floor_memory_us": fl["floor_memory_us"], "floor_launch_us": fl["floor_launch_us"],
                         "bytes": fl["bytes"]}
                records.append(
                    bench.make_record(
                        NAME,
                        case,
                        label,
                        t,
                        shape={"B": B, "T": T, "H": H, "K": 128, "V": 128},
                        dtype=str(dtype).replace("torch.", ""),
                        floor_us=fl["floor_us"],
                        error=err,
                        **extra,
                    )
                )
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """One verify step (B = 1, T = 4) per variant, for traces."""
    H = _heads(preset)
    dev = _env.detect().device
    x = make_inputs(1, 4, H, device=dev)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], None)
    spec = _parse("b1_t4", H)
    out = {}
    for label, vs in spec["variants"]:
        vs = _resolved(vs, args[:6] + (None,))
        fn = _variant_fn(vs["kind"], final_only=False, tile_v=vs["tile_v"], num_warps=vs["num_warps"],
                         backend=vs.get("backend"))
        out[label] = lambda _f=fn: _f(*args)
    return out


# ----------------------------------------------------------------------------------------------
# tables for the notebook (plain data; the notebook draws them)


