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

`resolve(optimizations, device, dtype, q_len, tokens=, top_k=, projections=, precision=)` settles every
setting once into `Resolved`: per switch whether it is on, the implementation that runs (the op's row name,
or the switch's form) and, where that is not what the switch names (a GPU kernel on a CPU, a verification
switch at q_len = 1, more routing pairs than the fused router takes), a note saying what runs instead; and
per op the step calls, the chosen row as an object (`Resolved.rows`, `rows.Chosen`: its name and the
callables the step binds), so the step binds callables and never chooses again. strict=True turns the
notes into a ValueError for switches that were asked for by name.

Two settings take values instead of on/off, in the same table (`SETTINGS`): `projections`, how the dense
projections run ('bf16': the matrix library in the weights' dtype; 'gemv': the same weights, one-row
products by k3lab.ops.gemv; 'fp8': e4m3fn weights, `fp8.resolve_projections`), and `precision`, the
number formats of the step ('bf16': the weights' dtype; 'fp8': FP8 dense projections; 'article': the
article's MXFP4 routed experts, FP8 dense projections and an FP8 MLA latent cache). Either may be given
in the optimizations dict or as a keyword. Unset at precision 'bf16', the projections are
`rows.default_projections(tokens, dtype, device)`: the one-row GEMV where the step has one token (decode
at batch 1) on a GPU, the matrix library above and on a CPU; `Resolved.projections` says what runs and
`notes['projections']` why where the form asked for cannot run as asked.

At precision='article' the rows bound differ in two ops, settled here once like every other:
'moe_experts' runs one of k3lab.ops.moe_experts' MXFP4 rows (`experts_mxfp4_row`: the GEMV form for one
token, the grouped tl.dot_scaled form for more where the target has scaled matrix instructions, else the
GEMV form; the PyTorch loop with grouped_experts off or without Triton), and 'mla_decode' binds
k3lab.ops.mla_decode.fp8_cache's row quantization + FP8 split decode (`rows.fp8_plan_binder`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3lab import env
from k3lab.ops import moe_experts

from . import rows
from .fp8 import PROJECTIONS, resolve_projections


@dataclass(frozen=True)
class Setting:
    """One row of the settings table: what it turns or chooses, its values (the first is what 'all'
    gives; (True, False) for an on/off switch) and, for an on/off switch, where it applies."""

    what: str
    values: tuple = (True, False)
    applies: str = "always"  # 'always', 'decode' (q_len = 1) or 'verify' (q_len > 1)

    @property
    def on_off(self) -> bool:
        return self.values == (True, False)


PRECISIONS = ("bf16", "fp8", "article")
FP8_PRECISIONS = ("fp8", "article")  # the precisions whose dense projections are FP8

SETTINGS: dict[str, Setting] = {
    "kda_fused": Setting("fused KDA decode (conv, norms, gates, recurrence, output norm in one launch)",
                         applies="decode"),
    "mla_padded": Setting("MLA decode padded to 16 heads with the history split across the GPU"),
    "attn_res_fused": Setting("AttnRes mix + RMSNorm in one kernel"),
    "pack_where_used": Setting("pack the KDA gate input only in the branch whose kernel reads it"),
    "grouped_experts": Setting("routed experts as two grouped launches, the MoE tail as one fused launch"),
    "moe_tail_sharded": Setting("MoE tail sharded: this rank's up_proj rows, stitched by the existing "
                                "all-reduce"),
    "kda_verify_tiles": Setting("KDA verification with narrow value tiles (q_len > 1)", applies="verify"),
    "glue_fused": Setting("the MoE router + expert sort in one launch (two past 32 pairs), SiTU-GLU in one, "
                          "the glue around MLA attention in three (k3lab.ops.moe_router, situ_glu, "
                          "mla_glue)"),
    "projections": Setting("how the dense projections run: the matrix library in the weights' dtype, the "
                           "one-row GEMV (k3lab.ops.gemv) on the same weights, or FP8 weights", PROJECTIONS),
    "precision": Setting("the step's number formats: the weights' dtype, FP8 dense projections, or the "
                         "article's (MXFP4 routed experts, FP8 dense projections, FP8 MLA cache)",
                         PRECISIONS),
}
SWITCHES: dict[str, str] = {n: s.what for n, s in SETTINGS.items() if s.on_off}
DECODE_ONLY = frozenset(n for n, s in SETTINGS.items() if s.applies == "decode")
VERIFY_ONLY = frozenset(n for n, s in SETTINGS.items() if s.applies == "verify")
# the on/off switches that pick one of two forms of an op: impl says which form runs
FORMS = {"mla_padded": ("after", "before"), "attn_res_fused": ("after", "before"),
         "pack_where_used": ("after", "before"), "kda_verify_tiles": ("after", "before"),
         "moe_tail_sharded": ("sharded", "replicated")}


@dataclass(frozen=True)
class Resolved:
    """on: switch -> bool (what was asked for); impl: switch -> what runs (the op's row name, or the
    switch's form); notes: switch -> why that differs from what the switch names (empty when it does
    not); projections: what the dense projections run in (the step's dtype, 'gemv', 'fp8' or
    'fp8_emulated'); precision: the step's number formats; rows: op -> `rows.Chosen`, for every op the
    step calls; graph: '' where the step's ops can be captured in one CUDA graph, else why not."""

    on: dict
    impl: dict
    notes: dict
    projections: str = "bf16"
    rows: dict = field(default_factory=dict)
    precision: str = "bf16"
    graph: str = ""

    @property
    def backends(self) -> dict[str, str]:
        """op -> the name of what runs it (`rows`)."""
        return {op: c.name for op, c in self.rows.items()}

    def describe(self) -> list[str]:
        """One line per switch: name, on/off, what runs, and the note when there is one; then the
        projections' and the precision's lines."""
        lines = [
            f"{n}: {'on ' if self.on[n] else 'off'} -> {self.impl[n]}"
            + (f" ({self.notes[n]})" if n in self.notes else "")
            for n in SWITCHES
        ]
        note = self.notes.get("projections") or _PROJECTIONS_RUN.get(self.projections, "torch.matmul")
        return lines + [f"projections: {self.projections} ({note})", f"precision: {self.precision}"]

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


_PROJECTIONS_RUN = {"gemv": "k3lab.ops.gemv's one-row kernel where a projection takes one row, torch.matmul "
                            "above", "fp8": "e4m3fn weights: k3lab.ops.gemv's one-row kernel (W8A16) at one "
                            "row, torch._scaled_mm above", "fp8_emulated": "e4m3fn weights, plain PyTorch"}


def _value(name: str, value):
    """value when it is one of SETTINGS[name].values, else a ValueError naming the setting."""
    values = SETTINGS[name].values
    if isinstance(value, bool) or value not in values:
        raise ValueError(f"{name} must be one of {values}, got {value!r}")
    return value


def parse(optimizations) -> dict[str, bool]:
    """'all' / True, 'none' / False / None, an iterable of names that are on, or a dict name -> bool
    (names left out of the dict are on). ValueError naming an unknown switch. A dict may also hold the
    valued settings ('projections', 'precision'); `settings` reads them, this returns the switches."""
    if optimizations in ("all", True):
        return dict.fromkeys(SWITCHES, True)
    if optimizations in ("none", False, None):
        return dict.fromkeys(SWITCHES, False)
    if isinstance(optimizations, str):
        raise ValueError(f"optimizations must be 'all', 'none', a set of switch names or a dict, got "
                         f"{optimizations!r}")
    if isinstance(optimizations, dict):
        chosen = dict.fromkeys(SWITCHES, True)
        items = ((n, v) for n, v in optimizations.items() if n not in SETTINGS or SETTINGS[n].on_off)
    else:
        chosen = dict.fromkeys(SWITCHES, False)
        items = ((name, True) for name in optimizations)
    for name, value in items:
        if name not in SWITCHES:
            raise ValueError(f"optimizations: unknown switch {name!r}; switches: {', '.join(SETTINGS)}")
        if not isinstance(value, bool):
            raise ValueError(f"optimizations[{name!r}] must be True or False, got {value!r}")
        chosen[name] = value
    return chosen


def settings(optimizations, projections: str | None = None, precision: str | None = None) -> tuple[str, str]:
    """(projections, precision) from the keywords or the optimizations dict (not both, unless equal):
    unset, each follows the other ('fp8' projections <-> 'fp8' precision; 'article' precision -> 'fp8'
    projections), else 'bf16'. ValueError for a value outside the table and for projections that
    contradict the precision."""
    given = optimizations if isinstance(optimizations, dict) else {}
    out = {}
    for name, kw in (("projections", projections), ("precision", precision)):
        if name in given and kw is not None and given[name] != kw:
            raise ValueError(f"{name} is given twice: {kw!r} as a keyword and {given[name]!r} in "
                             "optimizations")
        value = kw if kw is not None else given.get(name)
        out[name] = None if value is None else _value(name, value)
    proj, prec = out["projections"], out["precision"]
    if prec is None:
        prec = "fp8" if proj == "fp8" else "bf16"
    if proj is None:
        proj = "fp8" if prec in FP8_PRECISIONS else "bf16"
    if (prec in FP8_PRECISIONS) != (proj == "fp8"):
        raise ValueError(f"projections={proj!r} contradicts precision={prec!r}: the 'fp8' and 'article' "
                         f"precisions run FP8 projections, and FP8 projections are one of those precisions")
    return proj, prec


def all_but(name: str) -> dict[str, bool]:
    """Every switch on except `name` (one bar of the waterfall)."""
    if name not in SWITCHES:
        raise ValueError(f"unknown switch {name!r}; switches: {', '.join(SWITCHES)}")
    return {n: n != name for n in SWITCHES}


def _row(op: str, on: bool, names: tuple[str, str], device, *inputs, **options):
    """(row, why it is not the on-row) for an op whose switch picks between two of its rows: the first
    name when the switch is on and that row runs these inputs here, else the second."""
    from importlib import import_module

    table = import_module(f"k3lab.ops.{op}").BACKENDS
    if not on:
        return table[names[1]], ""
    ok, why = table.check(names[0], device, *inputs, **options)
    return (table[names[0]], "") if ok else (table[names[1]], why)


def experts_mxfp4_row(grouped: bool, tokens: int | None, device):
    """(row, why) of the MXFP4 routed experts: one of k3lab.ops.moe_experts' rows that provide `mxfp4`.
    With grouped_experts off, 'mxfp4_torch' (the per-expert loop); on, the first of them in the table's
    order for `tokens` (the GEMV form for one token, each chosen expert read once anyway; the grouped
    tl.dot_scaled form for more) that runs on `device` here, with why the ones before it do not (the
    GEMV form for more tokens re-reads its experts' weights per token; the loop reads back to the host)."""
    table = moe_experts.BACKENDS
    if not grouped:
        return table["mxfp4_torch"], ""
    refused = []
    for row in table.ranked(device, None, tokens, need="mxfp4"):
        ok, why = table.check(row.name, device, None, tokens, need="mxfp4")
        if ok:
            return row, "; ".join(refused)
        refused.append(f"{row.name} cannot run here ({why})")
    raise AssertionError("the mxfp4_torch row runs anywhere")


def resolve(optimizations, device, dtype, q_len: int, *, strict: bool = False, projections: str | None = None,
            precision: str | None = None, tokens: int | None = None, top_k: int | None = None) -> Resolved:
    """What runs for each setting here (see the module docstring). strict: raise ValueError instead of
    running a replacement for a switch that is on and cannot run as named on this device, or for
    projections='fp8' where FP8 matmul cannot run. tokens, top_k: the step's tokens (batch x q_len) and
    experts per token, for whether the fused router takes their pairs (None: it is not asked)."""
    asked = projections is not None or (isinstance(optimizations, dict) and "projections" in optimizations)
    projections, precision = settings(optimizations, projections, precision)
    if not asked and precision == "bf16":  # the default: the one-row GEMV at one row, the library above
        projections = rows.default_projections(tokens, dtype, device)
    on = parse(optimizations)
    device = torch.device(device)
    if device.type == "cpu" and torch.cuda.is_available() and not env.triton_interpreted():
        raise ValueError("device='cpu' on a machine with a GPU: the step's Triton kernels run compiled, on "
                         "GPU tensors (k3lab turns Triton's interpreter on only where there is no GPU); use "
                         "device='cuda', or set TRITON_INTERPRET=1 before triton is imported")
    impl, notes, chosen = {}, {}, {}

    def refuse(name: str, note: str, instead: str) -> None:
        notes[name] = note
        if strict:
            raise ValueError(f"optimizations: {name} cannot run here ({note}); pass strict=False to run "
                             f"{instead}, or turn {name} off")

    for name, (after, before) in FORMS.items():
        impl[name] = after if on[name] else before
    decode = q_len == 1
    if decode:
        impl["kda_verify_tiles"] = "n/a"
        notes["kda_verify_tiles"] = "applies to verification steps (q_len > 1)"
        from k3lab.ops import kda_decode

        if on["kda_fused"]:
            ok, why = kda_decode.BACKENDS.check("cuda", device, dtype)
            row = kda_decode.BACKENDS["cuda" if ok else "torch"]
            if not ok:
                refuse("kda_fused", f"{why}: the PyTorch reference of the same step runs instead",
                       "the PyTorch reference")
        else:
            row = kda_decode.BACKENDS["triton"]
        impl["kda_fused"] = row.name
        chosen["kda_decode"] = rows.Chosen("kda_decode", row.name, notes.get("kda_fused", ""),
                                           {"bind": rows.kda_decode_binder(row.name)})
    else:
        impl["kda_fused"], notes["kda_fused"] = (
            "n/a", f"applies to q_len = 1; verification (q_len = {q_len}) runs kda_verify_tiles")
        chosen["kda_verify"] = rows.Chosen("kda_verify", impl["kda_verify_tiles"], "",
                                           {"bind": rows.verify_binder(on["kda_verify_tiles"])})

    experts, why = _row("moe_experts", on["grouped_experts"], ("triton", "torch"), device)
    impl["grouped_experts"] = experts.name
    if why:
        refuse("grouped_experts", f"grouped kernels unavailable ({why}): the loop runs", "the loop")
    routed, name, mx_row = rows.experts(experts), experts.name, None
    if precision == "article":
        mx_row, why = experts_mxfp4_row(on["grouped_experts"], tokens, device)
        name, routed = mx_row.name, rows.experts_mxfp4(mx_row)
        impl["grouped_experts"] = name
        if why:
            refuse("grouped_experts", f"{why}: {name} runs", name)
    chosen["moe_experts"] = rows.Chosen("moe_experts", name, notes.get("grouped_experts", ""),
                                        {"experts": routed, "tail": experts.tail})

    glue = {op: _row(op, on["glue_fused"], ("triton", "torch"), device)
            for op in ("situ_glu", "mla_glue", "moe_router")}
    why = next((w for _, w in glue.values() if w), "")
    fused_glue = on["glue_fused"] and not why
    if why:  # every glue kernel runs, or none of them does
        glue = {op: _row(op, False, ("triton", "torch"), device) for op in glue}
        refuse("glue_fused", f"fused glue kernels unavailable ({why}): PyTorch runs", "PyTorch")
    fused_route = fused_glue
    if fused_glue and tokens is not None:
        router, why = _row("moe_router", True, ("triton", "torch"), device, tokens, top_k or 1)
        if why:
            glue["moe_router"], fused_route = (router, why), False
            notes["glue_fused"] = (f"{tokens} tokens x top-{top_k} exceed the fused router's pairs: routing "
                                   f"runs the PyTorch sequence, SiTU-GLU fused")
    note = notes.get("glue_fused", "")
    impl["glue_fused"] = glue["situ_glu"][0].name
    glu = rows.glu(glue["situ_glu"][0])
    chosen["situ_glu"] = rows.Chosen("situ_glu", glue["situ_glu"][0].name, note,
                                     {"glu": glu, "shared_down": rows.shared_down(glu, fused_glue)})
    chosen["mla_glue"] = rows.of_row("mla_glue", glue["mla_glue"][0], note)
    router = glue["moe_router"][0]
    route = rows.router_fused(router) if fused_route else rows.route_plain
    chosen["moe_router"] = rows.Chosen("moe_router", router.name, note, {"route": route})

    chosen["attn_res_norm"] = rows.Chosen("attn_res_norm", impl["attn_res_fused"], "",
                                          {"bind": rows.mix_binder(on["attn_res_fused"])})
    if precision == "article":  # one form: the FP8 cache's padded split decode
        impl["mla_padded"] = "fp8_cache"
        if not on["mla_padded"]:
            notes["mla_padded"] = ("the FP8 latent cache has one decode, padded with the history split "
                                   "(k3lab.ops.mla_decode.fp8_cache): it runs with the switch off too")
        chosen["mla_decode"] = rows.Chosen("mla_decode", "fp8_cache", notes.get("mla_padded", ""),
                                           {"bind": rows.fp8_plan_binder()})
    else:
        chosen["mla_decode"] = rows.Chosen("mla_decode", impl["mla_padded"], "",
                                           {"bind": rows.mla_plan_binder(on["mla_padded"])})
    chosen["packed_matmul"] = rows.Chosen("packed_matmul", impl["pack_where_used"], "",
                                          {"dispatch": rows.pack_policy(on["pack_where_used"])})
    proj, note = resolve_projections(projections, device, dtype, strict=strict and asked)
    if note:
        notes["projections"] = note
    looped = (mx_row is moe_experts.BACKENDS["mxfp4_torch"] if precision == "article"
              else not on["grouped_experts"] or bool(notes.get("grouped_experts")))
    graph = "the per-expert loop reads the expert counts back to the host" if looped else ""
    return Resolved(on, impl, notes, proj, chosen, precision, graph)
