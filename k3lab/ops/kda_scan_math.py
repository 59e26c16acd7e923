"""Public path of the group scan's algebra in plain PyTorch: `k3lab.ops.kda_chunk.scan_math`, re-exported
here so that `from k3lab.ops import kda_scan_math` keeps working (notebook 05 reads it under this name)."""

from k3lab.ops.kda_chunk.scan_math import *  # noqa: F403
from k3lab.ops.kda_chunk.scan_math import __all__  # noqa: F401
