"""One decode (or verification) step of a tensor-parallel rank through all of K3, built from k3lab's ops,
each optimization a named switch.

    from k3lab.engine import DecodeStep, SWITCHES
    step = DecodeStep(K3Config.tp_slice(8), batch=1, context_len=1024, optimizations="all")
    logits = step(ids)

Modules: `switches` (the settings table and what each runs here), `rows` (the chosen row of every op the
step calls and the callables the step binds from them), `fp8` (FP8 dense projections:
`projections='fp8'`, `fp8_status(device)`), `weights` (a rank's weights: sliced from a K3Model or
random at a rank's shapes, rotated through the layers; `to_fp8`, `to_article`, whose routed experts are
in the MXFP4 format of k3lab.ops.moe_experts.mxfp4), `layers` (each sublayer's rank-local
part), `step` (DecodeStep, the rank program and its collectives, `run_group` for a TP group in lockstep).
The whole-step waterfall that measures it is the decode_step study (k3lab.studies.decode_step).
"""

from k3lab.engine.fp8 import PROJECTIONS, fp8_status
from k3lab.engine.step import COLLECTIVES, DecodeStep, run_group
from k3lab.engine.switches import SETTINGS, SWITCHES, Resolved, all_but, parse, resolve
from k3lab.engine.weights import RankWeights

__all__ = ["COLLECTIVES", "PROJECTIONS", "SETTINGS", "SWITCHES", "DecodeStep", "RankWeights", "Resolved",
           "all_but", "fp8_status", "parse", "resolve", "run_group"]
