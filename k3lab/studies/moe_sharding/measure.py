"""One-GPU benchmark of the latent MoE at one TP8 rank's shapes: the tail, the routed experts, and
the memory of up_proj under each tail.

    k3lab bench moe_sharding --json OUT.json [--save-profiles]

- tail (norm + up_proj + add into the output) for N = 1, 8, 64, 256 tokens, graph replay:
  before = the replicated tail (all 7168 rows of up_proj on every rank) and after = the sharded tail
  (this rank's 896 rows), both in the same form (tail_triton: one Triton norm launch, one in-place
  addmm_), so that their ratio is the policy's; torch = the sharded tail in the plain reference ops
  (tail_torch). Each beside its bytes / bandwidth floor (tail_cost), inputs rotated so that they are
  read from HBM; on a GPU each record also lists the kernels one call launches (a copy of the output
  would show there).
- experts for N = 1 and 64 (896 experts, 384 of the 3072 intermediate, bf16, the router's top-16 at
  K3's shape with random weights): before = the per-expert torch loop (eager: it reads back counts,
  so it cannot be captured), after = the grouped kernels (graph replay and eager); floor = the
  chosen experts' weight bytes (with the activations, `work.experts_work`) over the bandwidth; each
  record carries extra['bytes'], extra['flops'] and extra['weight_bytes'].
- memory: torch.cuda.memory_allocated() around shard_moe of one layer (K3's shapes, 16 experts
  instead of 896 so that the source layer fits) for each tail; the up_proj difference is the freed
  memory of one layer.

Every variant is checked against an fp32 computation on the same inputs before it is timed.
`run` returns the records and the memory figures; `table` prints the records. Needs a CUDA/ROCm GPU
(a smaller config only exercises the code on a CPU).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.ops import moe_experts as me
from k3lab.parallel import moe_tail as mt
from k3lab.studies import select_cases

from .tables import NAME
from .work import experts_work

TAIL_TOKENS = (1, 8, 64, 256)
EXPERT_TOKENS = (1, 64)


def _randn(*shape, gen, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device=gen.device, generator=gen) * scale).to(dtype)


def _launched(fn) -> dict:
    """Kernels one call of fn() launches on the GPU (names, launches, copies); {} on a CPU."""
    if not torch.cuda.is_available():
        return {}
    from k3lab import profile

    cap = profile.capture(fn, steps=1, warmup=1, name="moe_tail")
    return {"kernels": sorted(cap.table["name"]), **{k: cap.counts()[k] for k in ("launches", "copies")}}


def _tail_case(cfg, tp: int, n: int, gen, dt, timing: dict) -> list:
    """Records of the tail at n tokens: before (replicated) and after (sharded) in tail_triton's form,
    torch (sharded, the reference ops)."""
    H, LAT, eps = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.rms_norm_eps
    rows = H // tp
    lo = 0  # rank 0's rows; every rank's tail costs the same
    norm_w = (1 + 0.1 * _randn(LAT, gen=gen, dtype=torch.float32)).to(dt)
    graph = gen.device.type == "cuda"
    variants = {"before": ("replicated", me.tail_triton), "after": ("sharded", me.tail_triton),
                "torch": ("sharded", me.tail_torch)}
    records = []
    for variant, (tail, fn) in variants.items():
        R = H if tail == "replicated" else rows

        def make(R=R):
            return (_randn(n, LAT, dtype=torch.float32, gen=gen),
                    _randn(R, LAT, scale=LAT**-0.5, gen=gen, dtype=dt),
                    _randn(n, H, gen=gen, dtype=dt))
        cost = mt.tail_cost(cfg, tp, tail, n, dt)
        sets = bench.rotation_sets(make, cost["bytes"])
        lat, up, out = sets[0]
        col0 = 0 if tail == "replicated" else lo
        ref = out.double()
        normed = (lat.double() * torch.rsqrt(lat.double().pow(2).mean(-1, keepdim=True) + eps)
                  * norm_w.double())
        ref[:, col0:col0 + R] += normed.to(dt).double() @ up.double().t()
        err = bench.check(fn(lat, norm_w, eps, up, out.clone(), col0), ref, dtype=dt,
                          name=f"tail {variant} N={n}")
        scratch = out.clone()  # made outside the profiled call, whose copies are counted
        launched = _launched(lambda: fn(lat, norm_w, eps, up, scratch, col0))
        t = bench.time_fn(lambda a, b, c: fn(a, norm_w, eps, b, c, col0), graph=graph, rotate=sets, **timing)
        floor = bench.floor_us(bytes=cost["bytes"], flops=cost["flops"])
        records.append(bench.make_record(
            NAME, f"tail_N{n}", variant, t,
            shape={"tokens": n, "rows": R, "latent": LAT, "hidden": H, "tp": tp},
            dtype=dt, floor_us=floor, error=err, tail=tail, form=fn.__name__, bytes=cost["bytes"],
            flops=cost["flops"], **launched))
    return records


def _expert_weights(cfg, tp: int, gen, dt):
    E, LAT, F = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size // tp
    return (_randn(E, F, LAT, scale=LAT**-0.5, gen=gen, dtype=dt),
            _randn(E, F, LAT, scale=LAT**-0.5, gen=gen, dtype=dt),
            _randn(E, LAT, F, scale=F**-0.5, gen=gen, dtype=dt))


def _routing(cfg, n: int, seed: int, gen, dt):
    idx = me.random_router_idx(n, hidden=cfg.hidden_size, num_experts=cfg.num_experts,
                               top_k=cfg.num_experts_per_token, seed=seed).to(gen.device)
    w = torch.rand(n, cfg.num_experts_per_token, device=gen.device, generator=gen) + 0.1
    return _randn(n, cfg.routed_expert_hidden_size, gen=gen, dtype=dt), w / w.sum(-1, keepdim=True), idx


def _experts_reference(z, w, idx, w1, w3, w2):
    """fp32 loop over the chosen experts only (their weights widened one expert at a time)."""
    chosen = idx.unique()  # sorted
    remap = torch.searchsorted(chosen, idx)
    return me.expert_loop(z.float(), w, remap, w1[chosen].float(), w3[chosen].float(), w2[chosen].float())


def _experts_case(cfg, tp: int, n: int, weights, gen, timing: dict) -> list:
    w1, w3, w2 = weights
    dt = w1.dtype
    sets = [_routing(cfg, n, seed, gen, dt) for seed in range(4)]  # different experts per set: cold weights
    z, w, idx = sets[0]
    ref = _experts_reference(z, w, idx, w1, w3, w2)
    F, LAT = w1.shape[1], w1.shape[2]
    chosen = int(idx.unique().numel())
    work = experts_work(n, cfg.num_experts_per_token, F, LAT, chosen, w1.element_size())
    floor = bench.floor_us(bytes=work["bytes"], flops=work["flops"])
    shape = {"tokens": n, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token, "intermediate": F,
             "latent": LAT, "tp": tp, "experts_chosen": chosen}
    m = me.default_block_m(n, cfg.num_experts_per_token, cfg.num_experts)
    pad = me.padding_of(idx.cpu(), cfg.num_experts, m)
    records = []
    runs = (("before", me.expert_loop, False), ("after", lambda *a: me.grouped_experts(*a, block_m=m), True),
            ("after", lambda *a: me.grouped_experts(*a, block_m=m), False))
    for variant, fn, graph in runs:
        graph = graph and z.is_cuda
        err = bench.check(fn(z, w, idx, w1, w3, w2), ref, dtype=dt, name=f"experts {variant} N={n}")
        t = bench.time_fn(lambda a, b, c: fn(a, b, c, w1, w3, w2), graph=graph, rotate=sets, **timing)
        records.append(bench.make_record(
            NAME, f"experts_N{n}", variant, t, shape=shape, dtype=dt, floor_us=floor, error=err,
            block_m=m if variant == "after" else None, padding=pad, **work))
    return records


def _memory(cfg, tp: int) -> dict:
    """memory_allocated() around shard_moe of one layer for each tail (rank 0), and up_proj's storage."""
    from k3lab.model import init_weights
    from k3lab.nn.moe import LatentMoE

    small = dataclasses.replace(cfg, num_experts=16, num_experts_per_token=4, name="full-16-experts")
    layer = init_weights(LatentMoE(small, device="cuda", dtype=torch.bfloat16), on_device=True)
    out = {}
    for tail in mt.TAILS:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        w = mt.shard_moe(layer, tp, 0, tail)
        torch.cuda.synchronize()
        out[tail] = {"rank_weights_bytes": torch.cuda.memory_allocated() - before,
                     "up_proj_bytes": w.up_proj.untyped_storage().nbytes(),
                     "formula_up_proj_bytes": mt.tail_bytes(cfg, tp, tail, "bf16") // cfg.num_moe_layers}
        del w
    out["freed_per_layer_measured"] = (out["replicated"]["rank_weights_bytes"]
                                       - out["sharded"]["rank_weights_bytes"])
    out["freed_per_layer_formula"] = mt.freed_bytes(cfg, tp, "bf16") // cfg.num_moe_layers
    out["freed_all_layers_formula_gib"] = mt.freed_bytes(cfg, tp, "bf16") / 2**30
    return out


def run_tokens(tail_tokens=TAIL_TOKENS, expert_tokens=EXPERT_TOKENS, tp: int = 8, seed: int = 0, config=None,
        repeats: int = 100, warmup: int = 10) -> dict:
    """All cases on this GPU; returns {'records': [Record...], 'memory': {...}}. config: K3's full
    shapes by default; a smaller config (with a CPU) only exercises the code (eager CPU timings,
    Triton's interpreter, no memory figures). repeats / warmup: bench.time_fn's."""
    timing = {"repeats": repeats, "warmup": warmup}
    cfg = config or K3Config.full()
    gpu = torch.cuda.is_available()
    if not gpu and config is None:
        raise RuntimeError("bench_moe times GPU kernels under graph replay and needs a CUDA/ROCm GPU; "
                           "on a CPU, notebook 02 shows the committed records instead")
    gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(seed)
    dt = torch.bfloat16 if gpu else torch.float16  # bf16 dots are wrong in Triton's interpreter
    records = []
    with torch.no_grad():
        for n in tail_tokens:
            records += _tail_case(cfg, tp, n, gen, dt, timing)
        weights = _expert_weights(cfg, tp, gen, dt)
        for n in expert_tokens:
            records += _experts_case(cfg, tp, n, weights, gen, timing)
        del weights
        memory = {}
        if gpu:
            torch.cuda.empty_cache()
            memory = _memory(cfg, tp)
    return {"records": records, "memory": memory}


# ------------------------------------------------------------------ the study contract
def case_names(preset=None) -> list[str]:
    return [f"tail_N{n}" for n in TAIL_TOKENS] + [f"experts_N{n}" for n in EXPERT_TOKENS]


def run(preset=None, cases=None) -> list:
    """Every case (cases: a subset of case_names()); checks each variant against the reference first."""
    if not torch.cuda.is_available():
        raise RuntimeError("moe_sharding times compiled kernels at TP8 shapes and needs a GPU; on a CPU "
                           "tests/test_moe_*.py and notebook 02 check the same code in Triton's interpreter")
    cases = select_cases(case_names(), cases or None)
    tail = tuple(int(c[6:]) for c in cases if c.startswith("tail_N"))
    experts = tuple(int(c[9:]) for c in cases if c.startswith("experts_N"))
    res = run_tokens(tail_tokens=tail, expert_tokens=experts)
    if res["memory"]:  # not records: up_proj's memory under each tail, printed for the run's README
        print("memory (one layer, rank 0):", json.dumps(res["memory"], indent=1))
    return res["records"]


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """The study's before/after kernels at one small case, for traces: the tail at one token, replicated
    ('tail_before') and sharded ('tail_after', both tail_triton), and the routed experts of one token,
    the per-expert loop ('experts_before') and the grouped kernels ('experts_after'). On a GPU at K3's
    TP8 shapes in bf16; on a CPU at K3Config.tiny()'s over two ranks in fp16 through Triton's
    interpreter (as tests/test_moe_sharding_measure.py runs the code)."""
    gpu = torch.cuda.is_available()
    cfg, tp, dt = (K3Config.full(), 8, torch.bfloat16) if gpu else (K3Config.tiny(), 2, torch.float16)
    gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    H, LAT, eps = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.rms_norm_eps
    norm_w = (1 + 0.1 * _randn(LAT, gen=gen, dtype=torch.float32)).to(dt)
    lat, out = _randn(1, LAT, dtype=torch.float32, gen=gen), _randn(1, H, gen=gen, dtype=dt)
    targets = {}
    for variant, rows in (("tail_before", H), ("tail_after", H // tp)):
        up = _randn(rows, LAT, scale=LAT**-0.5, gen=gen, dtype=dt)
        targets[variant] = lambda up=up: me.tail_triton(lat, norm_w, eps, up, out, 0)
    w1, w3, w2 = _expert_weights(cfg, tp, gen, dt)
    z, w, idx = _routing(cfg, 1, 0, gen, dt)
    m = me.default_block_m(1, cfg.num_experts_per_token, cfg.num_experts)
    targets["experts_before"] = lambda: me.expert_loop(z, w, idx, w1, w3, w2)
    targets["experts_after"] = lambda: me.grouped_experts(z, w, idx, w1, w3, w2, block_m=m)
    return targets
