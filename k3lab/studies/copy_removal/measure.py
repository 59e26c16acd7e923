"""Checks and timings of the copy_removal study (the package docstring says what it measures): its cases,
each variant checked against the reference before it is timed into records.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from k3lab import bench, env
from k3lab.config import K3Config
from k3lab.ops import attn_res_norm as arn
from k3lab.studies.peers import on_gpu

from .tables import attn_res_bytes, NAME

HIDDEN_GPU = 7168
ATTN_RES_GPU = [(1, 2), (1, 5), (1, 9), (64, 2), (64, 5), (64, 9), (8192, 2), (8192, 5), (8192, 9)]
ATTN_RES_CPU = [(1, 2), (1, 9), (16, 5)]
KDA_DECODE_BATCHES = [1, 8, 32, 128]


def _device() -> torch.device:
    return env.detect().device


# ------------------------------------------------------------------ AttnRes + RMSNorm
@dataclasses.dataclass
class AttnResInputs:
    prefix: torch.Tensor
    delta: torch.Tensor
    blocks: torch.Tensor
    n_blocks: int
    res_norm_w: torch.Tensor
    res_proj_w: torch.Tensor
    next_norm_w: torch.Tensor
    mix_weight: torch.Tensor

    def args(self):
        return (self.prefix, self.delta, self.blocks, self.n_blocks, self.res_norm_w, self.res_proj_w,
                self.next_norm_w)


def attn_res_inputs(tokens: int, sources: int, hidden: int, dtype=torch.bfloat16, device=None, seed=0):
    """Fresh random inputs (never zeros): sources - 1 stored blocks, the partial and a delta."""
    if sources < 1 or sources > 9:
        raise ValueError(f"sources must be in 1..9 (K3 has at most 8 blocks + the partial), got {sources}")
    device = device or _device()
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(device)

    n_blocks = sources - 1
    blocks = r(9, tokens, hidden).to(dtype)  # 9 slots as a server keeps them; n_blocks in use
    res_norm_w, res_proj_w = 1 + r(hidden, scale=0.1), r(hidden, scale=0.05)
    return AttnResInputs(r(tokens, hidden).to(dtype), r(tokens, hidden).to(dtype), blocks, n_blocks,
                         res_norm_w,
                         res_proj_w, 1 + r(hidden, scale=0.1), arn.fold_mix_weight(res_norm_w, res_proj_w))


def check_attn_res(x: AttnResInputs) -> dict:
    """after and before against the fp64 reference (k3lab.nn): output and the persistent partial."""
    from k3lab.nn.attn_res import attn_res_mix
    from k3lab.nn.norms import rms_norm

    ref_prefix = (x.prefix.double() + x.delta.double()).to(x.prefix.dtype)
    sources = torch.cat([x.blocks[: x.n_blocks], ref_prefix.unsqueeze(0)]).double()
    ref_out = rms_norm(attn_res_mix(sources, x.res_norm_w.double(), x.res_proj_w.double()),
                       x.next_norm_w.double())
    errors = {}
    for impl in ("before", "after"):
        prefix, blocks = x.prefix.clone(), x.blocks.clone()
        kwargs = {"mix_weight": x.mix_weight} if impl == "after" else {}
        out = arn.attn_res_norm(prefix, x.delta, blocks, x.n_blocks, x.res_norm_w, x.res_proj_w,
                                x.next_norm_w,
                                impl=impl, **kwargs)
        errors[impl] = bench.check_all({"output": (out, ref_out), "partial": (prefix, ref_prefix)},
                                       dtype=x.prefix.dtype)
        if not torch.equal(prefix, ref_prefix.to(prefix.dtype)):
            raise bench.CheckFailed(f"attn_res {impl}: the persistent partial sum is not bit-exact")
        if not torch.equal(blocks, x.blocks):
            raise bench.CheckFailed(f"attn_res {impl}: a stored block changed without a block boundary")
    return errors


def _attn_res_case(tokens: int, sources: int, hidden: int, graph: bool) -> list[bench.Record]:
    x = attn_res_inputs(tokens, sources, hidden)
    errors = check_attn_res(x)
    fns = {"before": lambda: arn.before(*x.args()),
           "after": lambda: arn.after(*x.args(), mix_weight=x.mix_weight)}
    nbytes = attn_res_bytes(tokens, sources, hidden, x.prefix.element_size())
    floor = bench.floor_us(bytes=nbytes) if on_gpu() else None
    modes = [False, True] if graph else [False]
    records = []
    pieces, why = arn.kernel_status(x.prefix, x.delta, x.blocks)
    launch = {
        "after": {"launch": arn.launch_config(tokens, x.n_blocks, cluster_pieces=pieces), "kernel_note": why},
        "before": {},
    }
    for use_graph in modes:
        case = f"attn_res_t{tokens}_s{sources}" + ("_graph" if use_graph else "")
        for variant, fn in fns.items():
            t = bench.time_fn(fn, graph=use_graph, warmup=5, repeats=30 if tokens >= 4096 else 100)
            records.append(
                bench.make_record(
                    NAME,
                    case,
                    variant,
                    t,
                    shape={"tokens": tokens, "sources": sources, "hidden": hidden},
                    dtype=x.prefix.dtype,
                    floor_us=floor,
                    error=errors[variant],
                    bytes=nbytes,
                    **launch[variant],
                )
            )
    return records


# ------------------------------------------------------------------ packing copies
def packing_config() -> K3Config:
    """Full depth (93 layers: 69 KDA, 24 MLA). On a GPU: one TP8 rank's widths (12 MLA heads, 12 KDA
    heads, expert intermediate 384) with 16 experts instead of 896 so the weights fit one GPU, and no
    collectives. On CPU: the tiny widths at full depth."""
    if on_gpu():
        s = K3Config.tp_slice(8)
        return dataclasses.replace(K3Config.full(), num_attention_heads=s.num_attention_heads,
                                   kda_num_heads=s.kda_num_heads,
                                   moe_intermediate_size=s.moe_intermediate_size,
                                   intermediate_size=s.intermediate_size, num_experts=16,
                                   num_experts_per_token=16, name="tp8-rank-16-experts")
    return dataclasses.replace(K3Config.tiny(), num_hidden_layers=93, attn_res_block_size=12, name="tiny-93")


def packing_model(config: K3Config | None = None, batch: int = 1, prompt: int = 8, seed: int = 0):
    """A K3Model at `config`, a prefilled cache and the next token: one decode step to profile."""
    from k3lab.model import K3Model, init_weights

    config = config or packing_config()
    device = _device()
    dtype = torch.bfloat16 if on_gpu() else torch.float32
    with torch.device(device):
        model = init_weights(K3Model(config, dtype=dtype), seed=seed, on_device=True)
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=g).to(device)
    with torch.no_grad():
        _, cache = model.prefill(ids)
    nxt = torch.randint(0, config.vocab_size, (batch, 1), generator=g).to(device)
    return model, cache, nxt


def count_copies(fn: Callable[[], object], steps: int = 1) -> dict:
    """Launches, copies and bytes copied per step, from the profiler's kernel table."""
    from k3lab import profile

    cap = profile.capture(fn, steps=steps, warmup=1)
    return cap.counts()


def packing_records(batch: int = 1) -> list[bench.Record]:
    from k3lab.ops import packed_matmul as pm

    model, cache, nxt = packing_model(batch=batch)
    config = packing_config()
    with torch.no_grad():
        ref, _ = model.decode(nxt, cache)
    step = lambda: model.decode(nxt, cache)  # noqa: E731 - the decode step, cache not modified
    records = []
    for policy in ("before", "after"):
        pm.install(model, policy)
        with torch.no_grad():
            out, _ = step()
            if not torch.equal(out, ref):
                raise bench.CheckFailed(f"packing {policy}: the decode step's logits changed")
            counts = count_copies(step)
            t = bench.time_fn(step, warmup=2 if on_gpu() else 1, repeats=10 if on_gpu() else 3)
        records.append(bench.make_record(
            NAME, f"packing_decode_b{batch}", policy, t, shape={"batch": batch,
                                                                "layers": config.num_hidden_layers,
                                                                "kda_layers": config.num_kda_layers},
            dtype=next(model.parameters()).dtype, error={"logits_equal": True}, config=config.name, **counts))
    # the pack alone, at the f_b input of one KDA layer (B x 128), eager and in a graph
    x = torch.randn(batch, config.kda_gate_rank, device=_device(), dtype=next(model.parameters()).dtype)
    for use_graph in ([False, True] if on_gpu() else [False]):
        t = bench.time_fn(lambda: pm.pack(x), graph=use_graph, warmup=10, repeats=200)
        nbytes = x.numel() * x.element_size()
        records.append(bench.make_record(
            NAME, "pack_copy" + ("_graph" if use_graph else ""), "before", t, shape={"bytes": nbytes},
            dtype=x.dtype, floor_us=bench.floor_us(bytes=2 * nbytes) if on_gpu() else None,
            seed_copy_bytes=1792, seed_copy_us=4.8))
    return records


# ------------------------------------------------------------------ fused KDA decode
def kda_decode_records(batches=None) -> list[bench.Record]:
    """k3lab.studies.kda_decode at the TP8 slice (GPU: the fused HIP/CUDA kernel), relabelled
    as this study's `kda_decode_b{B}` cases (eager and graph records of a variant share a case)."""
    from k3lab.studies import kda_decode

    records = kda_decode.run(batches=tuple(batches or KDA_DECODE_BATCHES))
    return [dataclasses.replace(r, study=NAME, case=f"kda_decode_b{r.shape['B']}") for r in records]


# ------------------------------------------------------------------ study contract
def case_names(preset: str | None = None) -> list[str]:
    shapes = ATTN_RES_GPU if on_gpu() else ATTN_RES_CPU
    names = [f"attn_res_t{t}_s{s}" for t, s in shapes] + ["packing"]
    if on_gpu():
        names = [f"kda_decode_b{b}" for b in KDA_DECODE_BATCHES] + names
    return names


def run(preset: str | None = None, cases: list[str] | None = None) -> list[bench.Record]:
    wanted = set(cases or case_names(preset))
    unknown = wanted - set(case_names(preset))
    if unknown:
        raise ValueError(f"cases must be among {case_names(preset)} on this machine, got {sorted(unknown)}")
    records: list[bench.Record] = []
    batches = [b for b in KDA_DECODE_BATCHES if f"kda_decode_b{b}" in wanted]
    if batches:
        records += kda_decode_records(batches)
    hidden = HIDDEN_GPU if on_gpu() else K3Config.tiny().hidden_size
    for t, s in ATTN_RES_GPU if on_gpu() else ATTN_RES_CPU:
        if f"attn_res_t{t}_s{s}" in wanted:
            records += _attn_res_case(t, s, hidden, graph=on_gpu())
    if "packing" in wanted:
        records += packing_records()
    return records


def profile_targets(preset: str | None = None) -> dict[str, Callable[[], None]]:
    """One AttnRes step (9 sources) before and after, for traces."""
    tokens, hidden = (64, HIDDEN_GPU) if on_gpu() else (4, K3Config.tiny().hidden_size)
    x = attn_res_inputs(tokens, 9, hidden)
    return {"before": lambda: arn.before(*x.args()),
            "after": lambda: arn.after(*x.args(), mix_weight=x.mix_weight)}
