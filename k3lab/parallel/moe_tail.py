"""K3's latent MoE under tensor parallelism, with the routed output projection replicated or sharded.

One rank's layer (TP = W ranks, docs/k3.md):

    route(x)                       router replicated: every rank picks the same 16 experts per token
    z = down_proj(x)               replicated (7168 -> 3584)
    lat_r = experts_r(z)           experts sharded on their intermediate (3072 / W each): a partial sum
    lat = all_reduce(lat_r)        collective 1, the latent (fp32, [N, 3584])
    s_r = shared_r(x)              shared expert row-parallel (6144 / W): a partial sum [N, 7168]

    tail "replicated" (the original path): out = all_reduce(s_r) + up_proj(norm(lat)); every rank holds
        the whole up_proj and computes all 7168 outputs, the same numbers on all W ranks.
    tail "sharded": s_r[:, own] += up_proj[own](norm(lat)); out = all_reduce(s_r). Rank r computes only
        its 7168 / W output coordinates `own` and holds only those rows of up_proj; the shared
        expert's all-reduce, needed anyway, sums the shared partials and stitches the routed slices,
        each coordinate's routed part added once (the others add 0 there).

Both tails call all_reduce exactly twice per layer. Before them, TPLatentMoE (verify=True) gathers a
few numbers per rank (token count, width, dtype, tail, two checksums of x) and refuses, on every rank
at once, inputs that differ across ranks: a token count that differs would make the all-reduces
mismatch and hang, and an x that differs would give silently wrong sums.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from k3lab.nn.moe import LatentMoE, route
from k3lab.nn.situ import situ_glu
from k3lab.ops import moe_experts

TAILS = ("replicated", "sharded")
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


def check_world_size(world_size, *, hidden: int, intermediate: int = 0, shared: int = 0) -> int:
    """world_size must divide the hidden size (the sharded tail's output rows), the expert
    intermediate and the shared expert's width. Raises ValueError naming the one that does not."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    for name, value in (("hidden size (up_proj output rows)", hidden),
                        ("expert intermediate size", intermediate), ("shared expert width", shared)):
        if value % world_size:
            raise ValueError(f"world_size {world_size} does not divide the {name} {value}")
    return world_size


def _check_tail(tail) -> str:
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    return tail


@dataclass
class RankMoEWeights:
    """One rank's weights of a latent MoE layer under TP (see the module docstring).

    up_proj is [hidden, latent] for the replicated tail, [hidden / world_size, latent] (rows
    own_cols) for the sharded one. shared_* are None when the layer has no shared expert."""

    world_size: int
    rank: int
    tail: str
    gate_weight: torch.Tensor       # [E, H]
    gate_bias: torch.Tensor         # [E] fp32, selection only
    top_k: int
    scaling: float
    renormalize: bool
    down_proj: torch.Tensor         # [LAT, H]
    w1: torch.Tensor                # [E, F / W, LAT]
    w3: torch.Tensor                # [E, F / W, LAT]
    w2: torch.Tensor                # [E, LAT, F / W]
    norm_weight: torch.Tensor       # [LAT]
    eps: float
    up_proj: torch.Tensor           # [H, LAT] or [H / W, LAT]
    shared_gate: torch.Tensor | None  # [S / W, H]
    shared_up: torch.Tensor | None    # [S / W, H]
    shared_down: torch.Tensor | None  # [H, S / W]

    @property
    def hidden(self) -> int:
        return self.down_proj.shape[1]

    @property
    def own_cols(self) -> tuple[int, int]:
        """The output coordinates [lo, hi) whose routed part this rank computes."""
        if self.tail == "replicated":
            return 0, self.hidden
        rows = self.hidden // self.world_size
        return self.rank * rows, (self.rank + 1) * rows

    def nbytes(self) -> dict[str, int]:
        """Bytes of storage each weight holds (its whole storage: a view of a bigger tensor counts
        the bigger tensor), and 'total'."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                out[f.name] = t.untyped_storage().nbytes()
        out["total"] = sum(out.values())
        return out


def _own(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """A fresh tensor holding exactly t's elements (never a view of the whole weight)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=device or t.device).copy_(t.detach())


def shard_moe(layer: LatentMoE, world_size: int, rank: int, tail: str, *, device=None, dtype=None
              ) -> RankMoEWeights:
    """Rank `rank`'s weights of `layer` under TP `world_size`: router, down_proj and norm replicated,
    experts sharded on their intermediate, the shared expert row-parallel, up_proj whole
    (tail="replicated") or only this rank's rows (tail="sharded": the other rows are never copied).
    device / dtype: where and how the rank's weights are stored (default: the layer's)."""
    if not isinstance(layer, LatentMoE):
        raise ValueError(f"layer must be a k3lab.nn.moe.LatentMoE, got {type(layer).__name__}")
    _check_tail(tail)
    H = layer.hidden_size
    F = layer.experts[0].w1.weight.shape[0]
    S = layer.shared_experts.gate_proj.weight.shape[0] if layer.shared_experts is not None else 0
    check_world_size(world_size, hidden=H, intermediate=F, shared=S)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    own = lambda t: _own(t, device, dtype)  # noqa: E731
    f_lo, f_hi = rank * F // world_size, (rank + 1) * F // world_size
    w1, w3, w2 = moe_experts.stack_experts(layer.experts, f_lo, f_hi)
    if tail == "sharded":
        rows = H // world_size
        up = own(layer.routed_expert_up_proj.weight[rank * rows:(rank + 1) * rows])
    else:
        up = own(layer.routed_expert_up_proj.weight)
    shared = [None, None, None]
    if layer.shared_experts is not None:
        se, s_lo, s_hi = layer.shared_experts, rank * S // world_size, (rank + 1) * S // world_size
        shared = [own(se.gate_proj.weight[s_lo:s_hi]), own(se.up_proj.weight[s_lo:s_hi]),
                  own(se.down_proj.weight[:, s_lo:s_hi])]
    gate = layer.gate
    return RankMoEWeights(
        world_size, rank, tail, own(gate.weight), _own(gate.e_score_correction_bias, device, torch.float32),
        gate.top_k, float(gate.scaling), bool(gate.renormalize), own(layer.routed_expert_down_proj.weight),
        own(w1), own(w3), own(w2), own(layer.routed_expert_norm.weight), float(layer.routed_expert_norm.eps),
        up, *shared)


def _dtype_code(dtype: torch.dtype) -> int:
    order = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    return order.index(dtype) if dtype in order else len(order)


def _agree(x: torch.Tensor, w: RankMoEWeights, group) -> None:
    """Gather (tokens, width, dtype, tail, world size, checksums of x) from every rank; raise the same
    ValueError on every rank when they differ (fixed-size gather: it cannot hang on a shape)."""
    xd = x.detach().reshape(-1).to(torch.float64)
    ramp = torch.arange(xd.numel(), device=xd.device, dtype=torch.float64).remainder_(977).add_(1)
    mine = torch.tensor([x.shape[0], x.shape[1], _dtype_code(x.dtype), TAILS.index(w.tail), w.world_size,
                         0.0, 0.0], dtype=torch.float64, device=x.device)
    mine[5], mine[6] = xd.sum(), (xd * ramp).sum()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    names = ("token count", "width", "dtype", "tail", "weights' world size", "x", "x")
    for r, theirs in enumerate(every):
        bad = [n for n, a, b in zip(names, every[0].tolist(), theirs.tolist())
               if a != b and not (math.isnan(a) and math.isnan(b))]
        if bad:
            raise ValueError(f"x must be the same on every rank: rank {r} differs from rank 0 in "
                             f"{', '.join(dict.fromkeys(bad))} (rank 0: {every[0][:2].long().tolist()} "
                             f"tokens x width, rank {r}: {theirs[:2].long().tolist()})")


class TPLatentMoE:
    """One rank's latent MoE layer: TPLatentMoE(weights)(x, group=None) -> out.

    x [N, H] (or [..., H]) must be the same on every rank of `group` (the default group when None;
    no group at all when world_size is 1 and torch.distributed is not initialized). Returns the full
    output, x's shape, on every rank. experts_backend / tail_backend: see k3lab.ops.moe_experts (the
    grouped Triton kernels and the Triton-norm + addmm tail on a GPU, plain torch on a CPU, by default).
    verify=False skips the agreement gather (then only the two all-reduces run)."""

    def __init__(self, weights: RankMoEWeights, *, experts_backend: str | None = None,
                 tail_backend: str | None = None, verify: bool = True):
        if not isinstance(weights, RankMoEWeights):
            raise ValueError(f"weights must come from shard_moe, got {type(weights).__name__}")
        self.weights = weights
        device = weights.down_proj.device
        self.experts_backend = moe_experts.BACKENDS.choose(experts_backend, device, arg="experts_backend")[0]
        self.tail_backend = moe_experts.BACKENDS.choose(tail_backend, device, arg="tail_backend")[0]
        self.verify = verify

    def _group_checked(self, group) -> bool:
        w = self.weights
        if not dist.is_initialized():
            if w.world_size != 1:
                raise ValueError(f"weights are rank {w.rank} of {w.world_size}, but torch.distributed is not "
                                 "initialized (start the ranks with k3lab.parallel.spawn or torchrun)")
            return False
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (w.world_size, w.rank):
            raise ValueError(f"weights are rank {w.rank} of {w.world_size}, but this process is rank {rank} "
                             f"of a group of {size}")
        return True

    def _check_x(self, x) -> torch.Tensor:
        w = self.weights
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != w.hidden:
            raise ValueError(f"x must be a [N, {w.hidden}] tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if x.dtype != w.down_proj.dtype or x.device != w.down_proj.device:
            raise ValueError(f"x must be {w.down_proj.dtype} on {w.down_proj.device} (the weights'), got "
                             f"{x.dtype} on {x.device}")
        return x.reshape(-1, w.hidden)

    def routed_latent_partial(self, x2: torch.Tensor) -> torch.Tensor:
        """This rank's share of the combined expert output, fp32 [N, LAT] (before the all-reduce)."""
        w = self.weights
        dt = torch.float64 if x2.dtype == torch.float64 else torch.float32
        weights, idx, _ = route(x2.to(dt) @ w.gate_weight.to(dt).t(), w.gate_bias, w.top_k, w.scaling,
                                w.renormalize)
        z = x2 @ w.down_proj.t()
        return moe_experts.routed_experts(z, weights, idx, w.w1, w.w3, w.w2, backend=self.experts_backend)

    def shared_partial(self, x2: torch.Tensor) -> torch.Tensor:
        """This rank's share of the shared expert's output, [N, H] in x's dtype (zeros without one)."""
        w = self.weights
        if w.shared_gate is None:
            return torch.zeros_like(x2)
        return situ_glu(x2 @ w.shared_gate.t(), x2 @ w.shared_up.t()) @ w.shared_down.t()

    def __call__(self, x: torch.Tensor, group=None) -> torch.Tensor:
        w = self.weights
        x2 = self._check_x(x)
        distributed = self._group_checked(group)
        if distributed and self.verify:
            _agree(x2, w, group)
        lat = self.routed_latent_partial(x2)
        if distributed:
            dist.all_reduce(lat, group=group)                    # 1: the latent
        out = self.shared_partial(x2).contiguous()
        lo, hi = w.own_cols
        if w.tail == "sharded":
            moe_experts.latent_tail(lat, w.norm_weight, w.eps, w.up_proj, out, lo, backend=self.tail_backend)
            if distributed:
                dist.all_reduce(out, group=group)                # 2: shared partials + routed slices
        else:
            if distributed:
                dist.all_reduce(out, group=group)                # 2: shared partials
            moe_experts.latent_tail(lat, w.norm_weight, w.eps, w.up_proj, out, 0, backend=self.tail_backend)
        return out.view(x.shape)


# ------------------------------------------------------------------------------------------------
# Bytes and FLOPs of the tail
# ------------------------------------------------------------------------------------------------

def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype or a name ('bf16', 'fp8', ...)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype.lower()]
    raise ValueError(f"dtype must be a torch dtype or one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")


def tail_rows(config, tp: int, tail: str) -> int:
    """Rows of up_proj one rank holds and computes: all of them, or hidden / tp."""
    _check_tail(tail)
    check_world_size(tp, hidden=config.hidden_size)
    return config.hidden_size if tail == "replicated" else config.hidden_size // tp


def tail_bytes(config, tp: int, tail: str, dtype="bf16") -> int:
    """up_proj bytes per rank over all MoE layers of `config` (a full config: K3Config.full())."""
    per_layer = tail_rows(config, tp, tail) * config.routed_expert_hidden_size * dtype_bytes(dtype)
    return config.num_moe_layers * per_layer


def freed_bytes(config, tp: int, dtype="bf16") -> int:
    """Memory per rank the sharded tail frees: (1 - 1/tp) of up_proj over all MoE layers
    (K3 at TP8 in bf16: 92 x 7168 x 3584 x 2 B x 7/8 = 4,136,108,032 B = 3.85 GiB)."""
    return tail_bytes(config, tp, "replicated", dtype) - tail_bytes(config, tp, "sharded", dtype)


def cache_positions(config, nbytes: float, kv_bytes: float = 1) -> int:
    """MLA cache positions `nbytes` holds: a position costs the 576-value latent in every MLA layer
    (K3 in FP8: 24 x 576 B = 13,824 B)."""
    return int(nbytes // (config.num_mla_layers * config.mla_latent_bytes_per_position(kv_bytes)))


def tail_cost(config, tp: int, tail: str, n_tokens: int, dtype="bf16") -> dict[str, float]:
    """Work of one rank's tail (norm + up_proj rows + add into the output) in one layer for n_tokens:
    weight bytes, activation bytes (fp32 latent read, output columns read and written), FLOPs."""
    if not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be a non-negative integer, got {n_tokens!r}")
    rows, lat, e = tail_rows(config, tp, tail), config.routed_expert_hidden_size, dtype_bytes(dtype)
    weight = rows * lat * e + lat * e
    act = n_tokens * lat * 4 + 2 * n_tokens * rows * e
    return {"rows": rows, "weight_bytes": weight, "activation_bytes": act, "bytes": weight + act,
            "flops": 2 * n_tokens * rows * lat + 4 * n_tokens * lat}


# ------------------------------------------------------------------------------------------------
# The distributed check: python -m k3lab.parallel.check moe --world-size N
# ------------------------------------------------------------------------------------------------

_CHECK_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "reduce", "send", "recv")


@contextlib.contextmanager
def count_collectives():
    """Count this process's torch.distributed collective calls by name inside the block (a dict)."""
    counts = {name: 0 for name in COLLECTIVES}
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return counted

    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def check_rank(rank: int, world_size: int, opts: dict) -> list[dict]:
    """On every rank: both tails against the single-rank layer; returns every rank's figures."""
    from k3lab.runtime import check
    from k3lab.config import K3Config
    from k3lab.model import init_weights
    from k3lab.parallel.launch import rank_device

    dtype = _CHECK_DTYPES[opts["dtype"]]
    cfg = K3Config.preset(opts["preset"])
    layer = init_weights(LatentMoE(cfg), seed=opts["seed"]).to(dtype)
    x = torch.randn(opts["tokens"], cfg.hidden_size,
                    generator=torch.Generator().manual_seed(opts["seed"] + 1))
    x = x.to(dtype)
    with torch.no_grad():
        ref = layer(x.unsqueeze(0))[0]
        dev = rank_device()
        mine = []
        for tail in TAILS:
            w = shard_moe(layer, world_size, rank, tail, device=dev)
            moe = TPLatentMoE(w, experts_backend=opts.get("experts_backend"),
                              tail_backend=opts.get("tail_backend"))
            with count_collectives() as calls:
                out = moe(x.to(dev))
            bound = {"max_rel": 1e-5} if dtype == torch.float32 else {}
            try:
                figs = check(out.cpu(), ref, dtype=dtype, **bound)
                ok, err = True, ""
            except AssertionError as exc:
                figs, ok, err = {"max_rel": float("nan"), "rel_l2": float("nan")}, False, str(exc)
            mine.append({"rank": rank, "tail": tail, "ok": ok, "error": err, "max_rel": figs["max_rel"],
                         "rel_l2": figs["rel_l2"], "all_reduce": calls["all_reduce"],
                         "other_collectives": sum(calls.values()) - calls["all_reduce"],
                         "up_proj_bytes": w.nbytes()["up_proj"]})
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    return [row for rows in every for row in rows]


def run_check(world_size: int, backend: str | None = None, **opts) -> int:
    """Run both tails on `world_size` ranks against the single-rank layer; print the error figures
    and all-reduce count per rank and tail; return 0 when every rank matches with two all-reduces.

    opts: preset ('tiny'), tokens (7), dtype ('fp32' | 'bf16' | 'fp16' or the torch names), seed (0),
    experts_backend,
    tail_backend (None: the defaults), timeout_s (120)."""
    from k3lab.config import K3Config
    from k3lab.parallel.launch import spawn

    o = {"preset": "tiny", "tokens": 7, "dtype": "fp32", "seed": 0, "experts_backend": None,
         "tail_backend": None, "timeout_s": 120}
    unknown = set(opts) - set(o)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; known: {sorted(o)}")
    o.update({k: v for k, v in opts.items() if v is not None})
    if o["dtype"] not in _CHECK_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_CHECK_DTYPES)}, got {o['dtype']!r}")
    for name in ("experts_backend", "tail_backend"):
        if o[name] is not None and o[name] not in moe_experts.BACKENDS:
            raise ValueError(f"{name} must be one of {moe_experts.BACKENDS.names} or None, got {o[name]!r}")
    cfg = K3Config.preset(o["preset"])
    check_world_size(world_size, hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                     shared=cfg.shared_intermediate_size)
    timeout_s = o.pop("timeout_s")
    rows = spawn(check_rank, world_size, o, backend=backend, timeout_s=timeout_s)
    print(f"moe tail check: {world_size} ranks, preset {o['preset']}, {o['tokens']} tokens, {o['dtype']}")
    print(f"{'tail':<11} {'rank':>4} {'max_rel':>10} {'rel_l2':>10} {'all-reduces':>11} "
          f"{'up_proj bytes':>14}")
    failed = 0
    for r in rows:
        good = r["ok"] and r["all_reduce"] == 2
        failed += not good
        print(f"{r['tail']:<11} {r['rank']:>4} {r['max_rel']:>10.2e} {r['rel_l2']:>10.2e} "
              f"{r['all_reduce']:>11} {r['up_proj_bytes']:>14,}" + ("" if good else f"  FAILED {r['error']}"))
    print("OK: both tails equal the single-rank layer on every rank, two all-reduces per layer" if not failed
          else f"FAILED: {failed} rank/tail results")
    return 1 if failed else 0
