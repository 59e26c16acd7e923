"""The serving model: one node of 8 GPUs serving K3, from measured step times to tokens/s/GPU against
tokens/s/user.

Modules: `stepmodel` (the per-rank step as a sum of parts, fitted to whole-step records, held-out
validation), `hardware` (GPUs and links with their sources), `node` (bytes, capacity, the served step,
collectives, DCP, verification, prefill), `curve` (the cycle, the per-user and per-GPU rates, the Pareto
front, the article's order of optimizations and each one's share). The records it reads are gathered by
the serving study (k3lab.studies.serving.inputs); nothing here touches a GPU.
"""

from . import curve, hardware, node, stepmodel

__all__ = ["curve", "hardware", "node", "stepmodel"]
