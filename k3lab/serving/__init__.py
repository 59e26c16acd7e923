"""The serving model: one node of 8 GPUs serving K3, from measured step times to tokens/s/GPU against
tokens/s/user, and a measured serving run on one rank to hold it against.

Modules: `stepmodel` (the per-rank step as a sum of parts, fitted to whole-step records), `validate` (its
measured error: held-out shapes disjoint from the fit, extrapolation past batch 32, cross-GPU fit and
validate), `hardware` (GPUs and links with their sources), `node` (bytes, capacity, the served step,
collectives, DCP, verification, prefill), `curve` (the cycle, the per-user and per-GPU rates, the Pareto
front, the article's order of optimizations and each one's share), `bands` (projected fronts with the
measured error and the sensitivities as a band; the article's figures as calibration ratios), `article`
(what the projection and the article's measurement are made of), `run` / `pool` / `workload` (the measured
serving run: continuous batching, chunked prefill, a prefix cache in real memory), `predict` (the step
model replaying a measured run: TTFT, TPOT and output tokens/s predicted beside measured, the wrong term
named), `inputs` (what the model reads from the committed records: the measured steps, their fits,
node.Inputs). The serving study (k3lab.studies.serving) measures the grid and writes the model's records.
"""

from . import bands, curve, hardware, inputs, node, predict, stepmodel, validate

__all__ = ["bands", "curve", "hardware", "inputs", "node", "predict", "stepmodel", "validate"]
