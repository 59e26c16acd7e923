"""Check the distributed code on N ranks against single-rank results; exit non-zero on a mismatch.

    python -m k3lab.parallel.check dcp --world-size 4 [--merge ag_rs|a2a] [--interleave 16] [--tq 3]
    torchrun --nproc-per-node 8 -m k3lab.parallel.check dcp [--merge a2a]
    python -m k3lab.parallel.check moe --world-size 4 [--tokens 7] [--dtype bf16] [--experts-backend triton]

`dcp` builds random queries and a random latent history (the same seed on every rank), shards the
history, runs `dcp.dcp_decode` on every rank and compares each rank's heads with single-rank fp64
attention over the whole history; it prints the errors per rank and the bytes each rank exchanged
per layer. Started by torchrun (RANK and WORLD_SIZE set) it runs in those processes; otherwise it
starts the ranks itself (`launch.spawn`). `moe` hands over to `k3lab.parallel.moe_tail.run_check`.
Exit codes: 0 all ranks match, 1 a mismatch, 2 the check could not run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from k3lab import env

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}  # max |o - ref| / max |ref|


def default_attention(device) -> str:
    """The op's after, unless the ranks hold CPU tensors where Triton cannot run (no interpreter):
    then the reference decode (the gloo ranks of a GPU machine)."""
    if torch.device(device).type == "cuda" or env.triton_interpreted():
        return "after"
    return "reference"


def dcp_rank_check(rank: int, world_size: int, opts: dict) -> list[dict]:
    """One rank's side of the DCP check: its errors for each merge, gathered to every rank."""
    import torch.distributed as dist

    from k3lab.nn.mla import latent_attention
    from k3lab.parallel import dcp
    from k3lab.parallel.launch import rank_device

    dev, dtype = rank_device(), getattr(torch, opts["dtype"])
    local = opts["local"] or default_attention(dev)
    B, Tq, H, L = opts["batch"], opts["tq"], opts["heads"], opts["length"]
    g = torch.Generator().manual_seed(opts["seed"])
    q = torch.randn(B, Tq, world_size * H, 576, generator=g, dtype=torch.float64)
    cache = torch.randn(B, L, 576, generator=g, dtype=torch.float64)
    # requests of different lengths; the last one only Tq long, so most ranks hold none of it
    lengths = torch.tensor([max(Tq, L - 37 * b) for b in range(B - 1)] + [Tq])
    ref_o, ref_lse = latent_attention(q[:, :, rank * H:(rank + 1) * H], cache, lengths)
    shard, held = dcp.shard_cache(cache.to(dtype).to(dev), lengths, world_size, rank, opts["interleave"])
    mine = q[:, :, rank * H:(rank + 1) * H].to(dtype).to(dev).contiguous()
    rows = []
    for merge in opts["merges"]:
        o, lse = dcp.dcp_decode(mine, shard, held, lengths, interleave=opts["interleave"], merge=merge,
                                local=local)
        o, lse = o.double().cpu(), lse.double().cpu()
        rows.append(
            {
                "merge": merge,
                "rank": rank,
                "nan": bool(torch.isnan(o).any() or torch.isnan(lse).any()),
                "max_abs": (o - ref_o).abs().max().item(),
                "rel": ((o - ref_o).abs().max() / ref_o.abs().max()).item(),
                "lse_abs": (lse - ref_lse).abs().max().item(),
                "held": [int(x) for x in held.tolist()],
                "local": local,
            }
        )
    every = [None] * world_size
    dist.all_gather_object(every, rows)
    return [r for rank_rows in every for r in rank_rows]


def _report(rows: list[dict], opts: dict, world_size: int) -> int:
    from k3lab.parallel import dcp

    tol = TOLERANCE[opts["dtype"]]
    print(f"dcp check: {world_size} ranks, B={opts['batch']} Tq={opts['tq']} heads/rank={opts['heads']} "
          f"L={opts['length']} interleave={opts['interleave']} {opts['dtype']} local={rows[0]['local']}")
    print(f"{'merge':<6} {'rank':>4} {'max_abs':>10} {'max_rel':>10} {'lse_abs':>10}  positions held")
    bad = 0
    for r in rows:
        ok = not r["nan"] and r["rel"] <= tol and r["lse_abs"] <= tol * 10
        bad += not ok
        print(f"{r['merge']:<6} {r['rank']:>4} {r['max_abs']:>10.2e} {r['rel']:>10.2e} {r['lse_abs']:>10.2e} "
              f" {r['held']}{'' if ok else '  MISMATCH'}")
    for merge in opts["merges"]:
        x = dcp.exchange_bytes(opts["batch"], opts["tq"], opts["heads"], world_size, merge,
                               getattr(torch, opts["dtype"]))
        parts = ", ".join(f"{c['op']}({c['what']}) {c['input_bytes']} B" for c in x["collectives"])
        print(f"{merge}: {x['calls']} collectives per layer and rank, {x['sent_bytes']} B sent: {parts}")
    print("OK" if not bad else f"FAILED: {bad} rank results beyond {tol:g} relative")
    return 0 if not bad else 1


def run_dcp(world_size: int | None, opts: dict, backend: str | None = None, timeout_s: float = 120) -> int:
    """The DCP check; under torchrun (RANK set) in this process, else on `world_size` spawned ranks."""
    from k3lab.parallel.launch import init_from_env, spawn

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, n = init_from_env(backend=backend, timeout_s=timeout_s)
        if world_size is not None and world_size != n:
            raise ValueError(f"--world-size {world_size} differs from torchrun's WORLD_SIZE {n}")
        rows = dcp_rank_check(rank, n, opts)
        code = _report(rows, opts, n) if rank == 0 else (1 if any(r["nan"] for r in rows) else 0)
        return code
    if world_size is None:
        raise ValueError("--world-size is required when not started by torchrun")
    rows = spawn(dcp_rank_check, world_size, opts, backend=backend, timeout_s=timeout_s)
    return _report(rows, opts, world_size)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3lab.parallel.check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("dcp", help="decode context parallelism against single-rank attention")
    d.add_argument("--world-size", type=int, default=None)
    d.add_argument("--merge", choices=("ag_rs", "a2a"), default=None, help="default: both")
    d.add_argument("--interleave", type=int, default=1)
    d.add_argument("--tq", type=int, default=1, help="tokens per request (1 decode, 2..8 verification)")
    d.add_argument("--batch", type=int, default=3)
    d.add_argument("--heads", type=int, default=2, help="query heads per rank (12 at TP8)")
    d.add_argument("--length", type=int, default=200, help="the longest request's context")
    d.add_argument("--dtype", choices=tuple(TOLERANCE), default="float32")
    d.add_argument("--attention", choices=("after", "before", "reference"), default=None,
                   help="the decode each rank runs on its shard (default: the MLA op's after; the reference "
                        "on CPU tensors where Triton has no interpreter)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    d.add_argument("--timeout-s", type=float, default=120)
    m = sub.add_parser("moe",
                       help="the MoE output tail against the single-rank layer (k3lab.parallel.moe_tail)")
    m.add_argument("--world-size", type=int, required=True)
    m.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    m.add_argument("--preset", default=None)
    m.add_argument("--tokens", type=int, default=None)
    m.add_argument("--dtype", default=None)
    m.add_argument("--seed", type=int, default=None)
    m.add_argument("--timeout-s", type=float, default=None)
    m.add_argument("--experts-backend", default=None,
                   help="k3lab.ops.moe_experts backend of the routed experts (default: the op's choice)")
    m.add_argument("--tail-backend", default=None,
                   help="backend of the latent tail (default: the op's choice)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.what == "moe":
        try:
            from k3lab.parallel.moe_tail import run_check
        except ImportError as exc:
            print(f"the moe check needs k3lab.parallel.moe_tail.run_check, which is not importable here: "
                  f"{exc}",
                  file=sys.stderr)
            return 2
        names = ("preset", "tokens", "dtype", "seed", "timeout_s", "experts_backend", "tail_backend")
        opts = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
        try:
            return run_check(args.world_size, backend=args.backend, **opts)
        except ValueError as exc:
            print(f"moe check: {exc}", file=sys.stderr)
            return 2
    opts = dict(batch=args.batch, tq=args.tq, heads=args.heads, length=args.length, dtype=args.dtype,
                interleave=args.interleave, local=args.attention, seed=args.seed,
                merges=[args.merge] if args.merge else ["ag_rs", "a2a"])
    try:
        return run_dcp(args.world_size, opts, backend=args.backend, timeout_s=args.timeout_s)
    except ValueError as exc:
        print(f"dcp check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
