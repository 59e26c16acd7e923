"""The decode step's optimizations, one named switch each, and what each switch runs on this machine.

    name              on (the seed's "after")                     off ("before")
    kda_fused         fused KDA decode, one launch                 the unfused chain: 3 kernels + 2 copies
    mla_padded        MLA padded to 16 heads, history split        one program per query row, whole history
    attn_res_fused    AttnRes + RMSNorm in one kernel              the PyTorch sequence (about 12 kernels)
    pack_where_used   the KDA gate input packed only where read    packed before the dispatcher chooses
    grouped_experts   two grouped expert launches + fused tail     per-expert loop + three-kernel tail
    moe_tail_sharded  up_proj rows of this rank, inside the        the whole up_proj on every rank, after
                      shared expert's all-reduce                   the shared expert's all-reduce
    kda_verify_tiles  narrow value tiles (q_len > 1)               the streaming kernel, 32-column tiles
    glue_fused        routing + expert sort in one Triton launch   the PyTorch sequences: ~25 kernels per
                      (two past 32 pairs), SiTU-GLU in one, MLA's  router, ~12 per SiTU-GLU, ~25 around
                      norms/query/output gate in three             each MLA attention

`resolve(optimizations, device, dtype, q_len, tokens=, top_k=)` settles every switch once into
`Resolved`: per switch whether it is on, the implementation that runs (the records' words) and, where
that is not what the switch names (a GPU kernel on a CPU, a verification switch at q_len = 1, more
routing pairs than the fused router takes), a note saying what runs instead; and per op the step calls,
the backend that runs (`Resolved.backends`, k3lab.ops' names), which the step binds once per layer.
strict=True turns the notes into a ValueError for switches that were asked for by name.

How the dense projections run is not a switch but a choice beside them (`projections=`, 'bf16',
'gemv' or 'fp8'; `fp8.resolve_projections`): `Resolved.projections` says what runs, and
`notes['projections']` why where the form asked for cannot run as asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3lab import env

from .fp8 import check_projections, resolve_projections

SWITCHES: dict[str, str] = {
    "kda_fused": "fused KDA decode (conv, norms, gates, recurrence, output norm in one launch)",
    "mla_padded": "MLA decode padded to 16 heads with the history split across the GPU",
    "attn_res_fused": "AttnRes mix + RMSNorm in one kernel",
    "pack_where_used": "pack the KDA gate input only in the branch whose kernel reads it",
    "grouped_experts": "routed experts as two grouped launches, the MoE tail as one fused launch",
    "moe_tail_sharded": "MoE tail sharded: this rank's up_proj rows, stitched by the existing all-reduce",
    "kda_verify_tiles": "KDA verification with narrow value tiles (q_len > 1)",
    "glue_fused": "the MoE router + expert sort in one launch (two past 32 pairs), SiTU-GLU in one, the "
                  "glue around MLA attention in three (k3lab.ops.moe_router, situ_glu, mla_glue)",
}
DECODE_ONLY = frozenset({"kda_fused"})
VERIFY_ONLY = frozenset({"kda_verify_tiles"})


@dataclass(frozen=True)
class Resolved:
    """on: switch -> bool (what was asked for); impl: switch -> the implementation that runs;
    notes: switch -> why the implementation differs from what the switch names (empty when it does not);
    backends: op -> the k3lab.ops backend that runs it ('kda_decode', 'moe_router', 'situ_glu',
    'mla_glue', 'moe_experts'; kda_decode only at q_len = 1)."""

    on: dict
    impl: dict
    notes: dict
    projections: str = "bf16"  # what the dense projections run in: the step's dtype, 'fp8' or 'fp8_emulated'
    backends: dict = field(default_factory=dict)

    def describe(self) -> list[str]:
        """One line per switch: name, on/off, what runs, and the note when there is one; then the
        projections' line."""
        lines = [
            f"{n}: {'on ' if self.on[n] else 'off'} -> {self.impl[n]}"
            + (f" ({self.notes[n]})" if n in self.notes else "")
            for n in SWITCHES
        ]
        note = self.notes.get("projections")
        return lines + [f"projections: {self.projections}" + (f" ({note})" if note else "")]

    def label(self) -> str:
        """'all on', 'all off', 'all on but X', or the list of switches that are on; ', fp8 projections'
        (or 'fp8_emulated') appended where the projections run in FP8."""
        applied = [n for n in SWITCHES if self.impl[n] != "n/a"]
        off = [n for n in applied if not self.on[n]]
        if not off:
            base = "all on"
        elif len(off) == len(applied):
            base = "all off"
        elif len(off) == 1:
            base = f"all on but {off[0]}"
        else:
            base = "on: " + ", ".join(n for n in applied if self.on[n])
        return base + (f", {self.projections} projections" if self.projections.startswith("fp8") else "")


def parse(optimizations) -> dict[str, bool]:
    """'all' / True, 'none' / False / None, an iterable of names that are on, or a dict name -> bool
    (names left out of the dict are on). ValueError naming an unknown switch."""
    if optimizations in ("all", True):
        return dict.fromkeys(SWITCHES, True)
    if optimizations in ("none", False, None):
        return dict.fromkeys(SWITCHES, False)
    if isinstance(optimizations, str):
        raise ValueError(f"optimizations must be 'all', 'none', a set of switch names or a dict, got "
                         f"{optimizations!r}")
    if isinstance(optimizations, dict):
        chosen = dict.fromkeys(SWITCHES, True)
        items = optimizations.items()
    else:
        chosen = dict.fromkeys(SWITCHES, False)
        items = ((name, True) for name in optimizations)
    for name, value in items:
        if name not in SWITCHES:
            raise ValueError(f"optimizations: unknown switch {name!r}; switches: {', '.join(SWITCHES)}")
        if not isinstance(value, bool):
            raise ValueError(f"optimizations[{name!r}] must be True or False, got {value!r}")
        chosen[name] = value
    return chosen


def all_but(name: str) -> dict[str, bool]:
    """Every switch on except `name` (one bar of the waterfall)."""
    if name not in SWITCHES:
        raise ValueError(f"unknown switch {name!r}; switches: {', '.join(SWITCHES)}")
    return {n: n != name for n in SWITCHES}


# kda_fused's implementation -> the k3lab.ops.kda_decode backend that runs it
KDA_DECODE_BACKENDS = {"fused": "cuda", "chain": "triton", "reference": "torch"}


def _kda_fused_impl(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    from k3lab.ops import kda_decode

    if device.type != "cuda":
        return "reference", ("the fused KDA decode is a CUDA kernel and this step is on the CPU: the PyTorch "
                             "reference of the same step runs instead")
    if dtype != torch.bfloat16:
        return (
            "reference",
            f"the fused KDA decode takes bf16, the step is {dtype}: the PyTorch reference runs instead",
        )
    ok, why = kda_decode.fused_status()
    if not ok:
        return "reference", why
    return "fused", ""


def resolve(optimizations, device, dtype, q_len: int, *, strict: bool = False, projections: str = "bf16",
            tokens: int | None = None, top_k: int | None = None) -> Resolved:
    """What runs for each switch here (see the module docstring). strict: raise ValueError instead of
    running a replacement for a switch that is on and cannot run as named on this device, or for
    projections='fp8' where FP8 matmul cannot run. tokens, top_k: the step's tokens (batch x q_len) and
    experts per token, for whether the fused router takes their pairs (None: it is not asked)."""
    check_projections(projections)
    on = parse(optimizations)
    device = torch.device(device)
    if device.type == "cpu" and torch.cuda.is_available() and not env.triton_interpreted():
        raise ValueError("device='cpu' on a machine with a GPU: the step's Triton kernels run compiled, on "
                         "GPU tensors (k3lab turns Triton's interpreter on only where there is no GPU); use "
                         "device='cuda', or set TRITON_INTERPRET=1 before triton is imported")
    impl, notes = {}, {}
    for name in SWITCHES:
        if name in DECODE_ONLY and q_len > 1:
            impl[name], notes[name] = (
                "n/a",
                f"applies to q_len = 1; verification (q_len = {q_len}) runs kda_verify_tiles",
            )
            continue
        if name in VERIFY_ONLY and q_len == 1:
            impl[name], notes[name] = "n/a", "applies to verification steps (q_len > 1)"
            continue
        if name == "kda_fused":
            if on[name]:
                impl[name], note = _kda_fused_impl(device, dtype)
                if note:
                    notes[name] = note
                    if strict:
                        raise ValueError(f"optimizations: kda_fused cannot run here ({note}); pass "
                                         f"strict=False to run the replacement, or turn kda_fused off")
            else:
                impl[name] = "chain"
            continue
        impl[name] = {
            "mla_padded": ("after", "before"), "attn_res_fused": ("after", "before"),
            "pack_where_used": ("after", "before"), "grouped_experts": ("triton", "torch"),
            "moe_tail_sharded": ("sharded", "replicated"), "kda_verify_tiles": ("after", "before"),
            "glue_fused": ("triton", "torch"),
        }[name][0 if on[name] else 1]
    if impl["grouped_experts"] == "triton":
        from k3lab.ops import moe_experts

        ok, why = moe_experts.BACKENDS.check("triton", device)
        if not ok:
            impl["grouped_experts"], notes["grouped_experts"] = (
                "torch",
                f"grouped kernels unavailable ({why}): the loop runs",
            )
            if strict:
                raise ValueError(f"optimizations: grouped_experts cannot run here ({why})")
    if impl["glue_fused"] == "triton":
        from k3lab.ops import mla_glue, moe_router, situ_glu

        why = [w for ok, w in (moe_router.BACKENDS.check("triton", device),
                               situ_glu.BACKENDS.check("triton", device),
                               mla_glue.BACKENDS.check("triton", device)) if not ok]
        if why:
            impl["glue_fused"], notes["glue_fused"] = (
                "torch",
                f"fused glue kernels unavailable ({why[0]}): PyTorch runs",
            )
            if strict:
                raise ValueError(f"optimizations: glue_fused cannot run here ({why[0]})")
    backends = {"moe_experts": impl["grouped_experts"], "situ_glu": impl["glue_fused"],
                "moe_router": impl["glue_fused"], "mla_glue": impl["glue_fused"]}
    if impl["kda_fused"] != "n/a":
        backends["kda_decode"] = KDA_DECODE_BACKENDS[impl["kda_fused"]]
    if impl["glue_fused"] == "triton" and tokens is not None:
        from k3lab.ops import moe_router

        if not moe_router.BACKENDS.check("triton", device, tokens, top_k or 1)[0]:
            backends["moe_router"] = "torch"
            notes["glue_fused"] = (f"{tokens} tokens x top-{top_k} exceed the fused router's pairs: routing "
                                   f"runs the PyTorch sequence, SiTU-GLU fused")
    proj, note = resolve_projections(projections, device, dtype, strict=strict)
    if note:
        notes["projections"] = note
    return Resolved(on, impl, notes, proj, backends)
