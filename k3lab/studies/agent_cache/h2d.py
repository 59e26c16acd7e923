"""Host <-> device copies, and one request's real state offloaded to the host and restored.

    k3lab bench agent_cache --cases copies state --json OUT.json [--save-profiles]

- copies: host -> device and device -> host, pageable ('before') and pinned ('after') host memory,
  blocks of 64 KiB to 64 MiB (random bytes; each copy checked equal once before it is timed). Device
  events, warm-up, repeats, median with p20/p80 (k3lab.bench). Floor: the bytes over PCIe Gen5 x16's
  raw rate (63 GB/s one way), which the H200 is attached by. Target: pinned H2D at 2 MiB and up within
  80% of the best pinned H2D figure measured.
- state: a few KDA and MLA layers of K3Config.tp_slice(8) (k3lab.nn, random weights, bf16) prefill a
  32K-token context in chunks; the request's state (MLA latent rows, KDA conv and recurrent state) is
  saved with k3lab.cache.save (pinned and pageable) and restored with k3lab.cache.restore, each timed.
  The restored cache must equal the saved one entry for entry, and decoding a few steps from it must
  equal decoding from the original cache, outputs and every cache entry, bit for bit. The records
  carry the bytes by kind and what the whole rank's state (69 KDA + 24 MLA layers) would take at the
  measured rate.

On a CPU (smoke=True, or no GPU) it runs the same code at tiny sizes: copies between two host tensors
(labelled 'host memcpy'; there is no pinned memory) and the tiny preset's layers. `run` returns the
records with a summary beside them; `print_summary` prints it.
"""

from __future__ import annotations

import torch

from k3lab import bench, env
from k3lab.config import K3Config
from k3lab.model import K3Cache, init_weights
from k3lab.nn.kda import KimiDeltaAttention
from k3lab.nn.mla import MultiHeadLatentAttention

from k3lab.cache.state import restore, save

from .tables import NAME

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
SMOKE_SIZES = (64 * KiB, 1 * MiB)
PCIE_GEN5_X16 = 63.0e9  # bytes/s one way: 16 lanes x 32 GT/s x 128/130 encoding / 8
WITHIN = 0.8


def _label(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


def copy_records(sizes=SIZES, *, device: str = "cuda", repeats: int = 30, gen=None) -> list[bench.Record]:
    """One record per (direction, size, host memory): 'before' pageable, 'after' pinned (GPU only)."""
    gpu = device != "cpu"
    gen = gen or torch.Generator().manual_seed(0)
    out = []
    for n in sizes:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"sizes must hold positive byte counts, got {n!r}")
        for pinned in ((False, True) if gpu else (False,)):
            host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).pin_memory() if pinned else \
                torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            dev = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(device)
            back = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            for direction, dst, src in (("h2d", dev, host), ("d2h", back, dev)):
                dst.copy_(src)
                if gpu:
                    torch.cuda.synchronize()
                if not torch.equal(dst.cpu(), src.cpu()):
                    raise bench.CheckFailed(f"{direction} copy of {n} bytes "
                                            f"({'pinned' if pinned else 'pageable'}) differs from its source")
                t = bench.time_fn(lambda d=dst, s=src: d.copy_(s, non_blocking=pinned), warmup=5,
                                  repeats=repeats,
                                  device=device)
                memory = "pinned" if pinned else ("pageable" if gpu else "host memcpy")
                out.append(bench.make_record(
                    NAME, f"{direction}_{_label(n)}", "after" if pinned else "before", t,
                    shape={"bytes": n, "direction": direction, "host_memory": memory}, dtype=torch.uint8,
                    floor_us=n / PCIE_GEN5_X16 * 1e6 if gpu else None, error={"equal": True},
                    gb_per_s=n / (t.median_us * 1e-6) / 1e9,
                    floor_note="bytes / 63 GB/s (PCIe Gen5 x16 raw, one way)" if gpu
                    else "none: a host memcpy"))
    return out


def _layers(cfg: K3Config, n_kda: int, n_mla: int, device, dtype):
    layers = [KimiDeltaAttention(cfg, device=device, dtype=dtype) for _ in range(n_kda)]
    layers += [MultiHeadLatentAttention(cfg, device=device, dtype=dtype) for _ in range(n_mla)]
    for i, layer in enumerate(layers):
        init_weights(layer, seed=100 + i, on_device=device != "cpu")
    return layers


@torch.no_grad()
def _prefill(layers, context: int, chunk: int, gen, dtype) -> K3Cache:
    """Each layer runs its own random pre-normed input through `context` positions, `chunk` at a time."""
    h = layers[0].hidden_size
    dev = next(layers[0].parameters()).device
    caches = [None] * len(layers)
    for start in range(0, context, chunk):
        T = min(chunk, context - start)
        for i, layer in enumerate(layers):
            x = torch.randn(1, T, h, device=dev, generator=gen).to(dtype)
            _, caches[i] = layer(x, caches[i])
    return K3Cache(caches, torch.zeros(0, 1, h, device=dev, dtype=dtype),
                   torch.randn(1, h, device=dev, generator=gen).to(dtype), context)


@torch.no_grad()
def _continue(layers, cache: K3Cache, xs) -> tuple[list, list]:
    """Decode the steps `xs[step][layer]` from `cache`; (outputs, final caches)."""
    caches, outs = list(cache.layers), []
    for step in xs:
        for i, layer in enumerate(layers):
            o, caches[i] = layer(step[i], caches[i])
            outs.append(o)
    return outs, caches


def _check_equal(saved: K3Cache, restored: K3Cache, layers, steps: int, gen, dtype) -> dict:
    a, b = saved.entries(), restored.entries()
    bad = [k for k in a if not torch.equal(a[k], b[k].to(a[k].device))]
    if a.keys() != b.keys() or bad:
        raise bench.CheckFailed(f"restored cache differs from the saved one in {bad or 'its entries'}")
    h, dev = layers[0].hidden_size, a[next(iter(a))].device
    xs = [[torch.randn(1, 1, h, device=dev, generator=gen).to(dtype) for _ in layers] for _ in range(steps)]
    o1, c1 = _continue(layers, saved, xs)
    o2, c2 = _continue(layers, restored, xs)
    outs_equal = all(torch.equal(x, y) for x, y in zip(o1, o2))
    caches_equal = all(torch.equal(t, c2[i].entries()[k]) for i, c in enumerate(c1) for k, t
                       in c.entries().items())
    if not (outs_equal and caches_equal):
        raise bench.CheckFailed(f"decoding after restore differs from decoding without it (outputs equal: "
                                f"{outs_equal}, caches equal: {caches_equal})")
    return {"restored_equal": True, "continue_outputs_equal": True, "continue_caches_equal": True,
            "steps": steps}


def state_records(*, smoke: bool = False, context: int | None = None, n_kda: int = 3, n_mla: int = 2,
                  steps: int = 4, repeats: int = 10) -> tuple[list[bench.Record], dict]:
    """Save and restore one request's state of a few TP8-slice layers (tiny preset, 256 positions, on
    a CPU or with smoke=True); checked, then timed. Returns (records, summary)."""
    gpu = torch.cuda.is_available() and not smoke
    device = "cuda" if gpu else "cpu"
    cfg = K3Config.tp_slice(8) if gpu else K3Config.tiny()
    context = context or (32768 if gpu else 256)
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator(device=device).manual_seed(1)
    layers = _layers(cfg, n_kda, n_mla, device, dtype)
    cache = _prefill(layers, context, 2048 if gpu else 64, gen, dtype)
    if gpu:
        torch.cuda.synchronize()
    records, summary = [], {"context": context, "preset": cfg.name, "kda_layers": n_kda, "mla_layers": n_mla}
    for pin in ((False, True) if gpu else (False,)):
        state = save(cache, 0, pin=pin)
        nbytes = state.nbytes()
        total = sum(nbytes.values())
        error = _check_equal(cache, restore(state, device), layers, steps, gen, dtype)
        variant, memory = ("after", "pinned") if pin else ("before", "pageable")

        def do_restore(s=state):
            return restore(s, device)

        for what, fn in (("save", lambda p=pin: save(cache, 0, pin=p)), ("restore", do_restore)):
            t = bench.time_fn(fn, warmup=2, repeats=repeats, calls_per_sample=1, device=device)
            rate = total / (t.median_us * 1e-6)
            full = _full_rank_bytes(cfg, context, dtype)
            records.append(bench.make_record(
                NAME, f"state_{what}_ctx{context}", variant, t,
                shape={"context": context, "preset": cfg.name, "kda_layers": n_kda, "mla_layers": n_mla,
                       "host_memory": memory, "bytes": total},
                dtype=dtype, error=error, bytes_by_kind=nbytes, gb_per_s=rate / 1e9,
                full_rank_bytes=full, full_rank_ms_at_this_rate=full / rate * 1e3,
                note="save: device -> new host buffers (allocation included); restore: host -> new device "
                     "tensors (torch.stack adds a device copy)"))
            summary[f"{what}_{memory}_ms"] = t.median_us / 1e3
            summary[f"{what}_{memory}_gb_per_s"] = rate / 1e9
        summary["bytes"] = total
        summary["full_rank_bytes"] = _full_rank_bytes(cfg, context, dtype)
        summary["bit_equal"] = True
    return records, summary


def _full_rank_bytes(cfg: K3Config, context: int, dtype) -> int:
    """One request's state on a rank with every layer of `cfg`'s kind (K3: 69 KDA + 24 MLA at TP8):
    latent rows in `dtype`, KDA state fp32, conv in `dtype`."""
    item = torch.empty(0, dtype=dtype).element_size()
    full = K3Config.full().sliced(8) if cfg.tp_size == 8 else cfg
    return (full.num_mla_layers * context * full.mla_latent_dim * item + full.kda_state_bytes_all_layers()
            + full.num_kda_layers * full.kda_conv_state_values_per_sequence() * item)


def run(smoke: bool = False, parts=("copies", "state")) -> dict:
    """The copies and / or the state save and restore (`parts`), at the GPU's sizes, or tiny ones on a
    CPU or with smoke=True: {'records', 'state' (the state's summary), and the pinned H2D figures}."""
    gpu = torch.cuda.is_available() and not smoke
    copies = copy_records(SIZES if gpu else SMOKE_SIZES, device="cuda" if gpu else "cpu",
                          repeats=30 if gpu else 5) if "copies" in parts else []
    states, summary = state_records(smoke=smoke, repeats=10 if gpu else 3) if "state" in parts else ([], {})
    pinned_h2d = [r for r in copies if r.variant == "after" and r.shape["direction"] == "h2d"]
    best = max((r.extra["gb_per_s"] for r in pinned_h2d), default=None)
    share = {r.case: r.extra["gb_per_s"] / best for r in pinned_h2d if r.shape["bytes"] >= 2 * MiB}
    return {"records": copies + states, "state": summary, "best_pinned_h2d_gb_per_s": best,
            "pinned_h2d_share_of_best": share, "within_80pct": all(v >= WITHIN for v in share.values()),
            "device": env.detect().name}


def print_summary(result: dict) -> None:
    """The copy rates per direction and block, the pinned H2D verdict and the state's save and restore."""
    rows: dict[tuple, dict] = {}
    for r in result["records"]:
        if r.case.startswith(("h2d", "d2h")):
            rows.setdefault((r.shape["direction"], r.shape["bytes"]),
                            {})[r.shape["host_memory"]] = r.extra["gb_per_s"]
    if rows:
        print(f"copies on {result['device']} (GB/s, median)")
        print(f"{'dir':<4} {'block':>7} {'pageable':>9} {'pinned':>8}")
    for (d, n), v in sorted(rows.items()):
        pag = v.get("pageable", v.get("host memcpy"))
        pin = v.get("pinned")
        print(f"{d:<4} {_label(n):>7} {pag:>9.2f} {'-' if pin is None else f'{pin:.2f}':>8}")
    if result["best_pinned_h2d_gb_per_s"]:
        verdict = "yes" if result["within_80pct"] else "NO"
        print(f"pinned h2d >= 2MiB within {WITHIN:.0%} of the best ({result['best_pinned_h2d_gb_per_s']:.2f} "
              f"GB/s): {verdict}")
    s = result["state"]
    if not s:
        return
    print(f"state of {s['kda_layers']} KDA + {s['mla_layers']} MLA layers ({s['preset']}, {s['context']} "
          f"positions, {s['bytes'] / 1e6:.1f} MB), bit-equal after restore: {s['bit_equal']}")
    for memory in ("pageable", "pinned"):
        if f"save_{memory}_ms" in s:
            print(f"  {memory:<8} save {s[f'save_{memory}_ms']:8.2f} ms ({s[f'save_{memory}_gb_per_s']:6.2f} "
                  f"GB/s)  restore {s[f'restore_{memory}_ms']:8.2f} ms "
                  f"({s[f'restore_{memory}_gb_per_s']:6.2f} GB/s)")
    print(f"  a whole rank's state "
          f"({'69 KDA + 24 MLA layers' if s['preset'] == 'tp8' else 'every layer of the preset'}) at this "
          f"context: {s['full_rank_bytes'] / 1e6:.1f} MB")
