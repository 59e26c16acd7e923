"""The GPUs and links of the serving model, each figure with where it comes from.

Published figures are datasheet peaks; `measured` marks the one figure k3lab has measured itself (the
H200's copy bandwidth, in every decode_step record). What one GPU cannot measure (the links between GPUs)
is a `Link` from published numbers, labelled as modelled wherever it is used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """The GPU-to-GPU fabric of one 8-GPU node: bandwidth per GPU and direction (GB/s), the latency of one
    small collective call inside a graph (us), and the sources."""

    name: str
    gbs_per_direction: float
    call_latency_us: float
    source: str


@dataclass(frozen=True)
class GPU:
    """One GPU kind: memory (GB), peak and usable copy bandwidth (TB/s), dense bf16 matrix rate (TFLOP/s),
    its node's link, the seed's cost per GPU-hour (None where the seed gives none), sources, and its
    compute units (SMs / CUs: the waves of a one-program-per-(token, head) kernel, stepmodel.waves), and
    its host link: GB/s one way from pinned host memory (what a restore from the host tier moves at)."""

    key: str
    name: str
    memory_gb: float
    bandwidth_tbs: float
    usable_bandwidth_tbs: float
    bf16_tflops: float
    link: Link
    usd_per_hour: float | None
    source: str
    compute_units: int
    host_gbs: float
    host_source: str


# The H200's host-to-device copy of 64 MiB from pinned memory, measured by the agent_cache study
# (profiles/nvidia-h200/agent_cache/h2d_64MiB__after.json: 51.97 GB/s over PCIe Gen5 x16, 63 GB/s raw).
# The other GPUs here sit on a PCIe Gen5 x16 host link too (H100 SXM, MI355X) or are given it (B300): they
# take the same figure, assumed, not measured.
HOST_GBS_MEASURED = 52.0
HOST_MEASURED = ("the H200's pinned host-to-device copy of 64 MiB measured by k3lab's agent_cache study, "
                 "PCIe Gen5 x16")
HOST_ASSUMED = "assumed: the H200's measured PCIe Gen5 x16 copy (52 GB/s), not measured on this GPU"

# One small all-reduce or all-to-all per call inside a CUDA/HIP graph: anchors.md gives 7-25 us per
# collective call for the DCP exchange; the model takes the low end for graph-captured small messages
# and says so. The what-if lets a reader move it.
CALL_LATENCY_US = 8.0

NVLINK_H200 = Link(
    "NVLink 4 (HGX H200)",
    450.0,
    CALL_LATENCY_US,
    "NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (both directions); latency: anchors.md's "
    "7-25 us per collective call, low end",
)
INFINITY_FABRIC = Link(
    "Infinity Fabric (8x MI355X)",
    537.6,
    CALL_LATENCY_US,
    "AMD Instinct MI355X product page: 7 Infinity Fabric links of 153.6 GB/s (both "
    "directions), 1,075 GB/s per GPU; latency: as for NVLink (not measured by k3lab)",
)

NVLINK_B300 = Link(
    "NVLink 5 (HGX B300)",
    900.0,
    CALL_LATENCY_US,
    "NVIDIA HGX B300: NVLink 5 1.8 TB/s per GPU (both directions); latency: as for NVLink 4 (not measured "
    "by k3lab)",
)

GPUS: dict[str, GPU] = {
    "h200": GPU(
        "h200",
        "NVIDIA H200",
        141.0,
        4.8,
        4.25,
        989.0,
        NVLINK_H200,
        None,
        "NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 dense); usable bandwidth: "
        "the 1 GiB copy measured in every decode_step record (anchors.md: 4.25 TB/s); 132 SMs",
        compute_units=132,
        host_gbs=HOST_GBS_MEASURED,
        host_source=HOST_MEASURED,
    ),
    "mi355x": GPU(
        "mi355x",
        "AMD Instinct MI355X",
        288.0,
        8.0,
        7.2,
        2500.0,
        INFINITY_FABRIC,
        1.50,
        "the seed and AMD's MI355X page (288 GB HBM3E, 8 TB/s; 2.5 PFLOP/s bf16 dense); usable "
        "bandwidth 7.2 TB/s as measured in public work (anchors.md); $1.50 per GPU-hour (seed); 256 CUs",
        compute_units=256,
        host_gbs=HOST_GBS_MEASURED,
        host_source=HOST_ASSUMED,
    ),
    "h100": GPU(
        "h100",
        "NVIDIA H100",
        80.0,
        3.35,
        3.02,
        989.0,
        NVLINK_H200,
        None,
        "NVIDIA H100 SXM datasheet (80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense, NVLink 900 GB/s); "
        "usable bandwidth: the 1 GiB copy measured in the H100 80GB HBM3's decode_step records "
        "(profiles/nvidia-h100-80gb-hbm3/decode_step/, 3.02 TB/s; a step record's own bandwidth_tbs is "
        "what the step model uses); 132 SMs",
        compute_units=132,
        host_gbs=HOST_GBS_MEASURED,
        host_source=HOST_ASSUMED,
    ),
    "b300": GPU(
        "b300",
        "NVIDIA B300",
        288.0,
        8.0,
        8.0 * 4.25 / 4.8,
        2250.0,
        NVLINK_B300,
        None,
        "NVIDIA HGX B300 platform figures (288 GB HBM3e and up to 8 TB/s per GPU; 36 PFLOP/s bf16 per 8 "
        "GPUs with sparsity, 2.25 PFLOP/s dense per GPU; NVLink 5 1.8 TB/s per GPU); usable bandwidth: the "
        "H200's measured share of its peak (assumed, not measured); 160 SMs (Blackwell Ultra)",
        compute_units=160,
        host_gbs=HOST_GBS_MEASURED,
        host_source=HOST_ASSUMED,
    ),
}

def matrix_efficiency() -> tuple[float, str]:
    """The share of its datasheet bf16 matrix rate a large matmul reaches: the H200's rate as
    k3lab.env.PEAKS holds it (a bf16 8192^3 product on random data; its label says whether a committed
    record backs it) over its datasheet figure, with the source.
    Prefill is charged at this share of any GPU's datasheet rate (for MI355X a projection)."""
    from k3lab.env import PEAKS

    h = GPUS["h200"]
    return PEAKS["H200"].bf16_tflops / h.bf16_tflops, (
        f"H200 bf16 8192^3 matmul {PEAKS['H200'].bf16_tflops:g} TFLOP/s ({PEAKS['H200'].bf16_source}, "
        "k3lab.env) over "
        f"{h.bf16_tflops:g} datasheet"
    )


# The seed's serving figures (MI355X and HGX B300, their stacks), for labelled comparison only.
SEED = {
    "mi355x_tokens_per_s_gpu": 7567.0,
    "b300_tokens_per_s_gpu": 6083.0,
    "interactivity": 50.0,
    "host_cache_gb": 224.875,
    # PR-reported mean time per output token, 8x MI355X, TP8, concurrency one, MXFP4 weights, padded MLA
    "tpot_ms_c1": {1024: 22.8, 32768: 23.6},
    # prefix-cache hit rate in the AgentX experiment of the MoE-rows change, before and after it
    "hit_rate_reported": (0.748, 0.801),
    # draft depths the recipe uses at 50 tokens/s/user (DCP8 without drafts to DCP1 with three)
    "depths_at_50": (0, 3),
    # the MI355X serving settings at each comparison target (the article's benchmark notes), interpolated
    # there between bracketing runs: the host tier on or off, the DCP degrees and the draft depths they span
    "settings": {30.0: {"host": True, "dcp": (8, 1), "depths": (0, 3)},
                 50.0: {"host": True, "dcp": (8, 1), "depths": (0, 3)},
                 150.0: {"host": False, "dcp": (1,), "depths": (5, 7)}},
}


def named(device: str) -> GPU:
    """The GPU whose name a record's `device` field carries ('NVIDIA H200' -> h200); ValueError otherwise."""
    for g in GPUS.values():
        if g.key.upper() in device.upper().replace(" ", ""):
            return g
    raise ValueError(f"device must name one of {[g.name for g in GPUS.values()]}, got {device!r}")


def gpu(key: str) -> GPU:
    """The GPU called `key` ('h200', 'mi355x'); ValueError naming the known ones."""
    if key not in GPUS:
        raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {key!r}")
    return GPUS[key]
