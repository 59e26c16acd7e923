"""k3lab: Kimi K3 serving optimizations, run before and after, checked, profiled and explained.

On a machine without a GPU, Triton kernels run in Triton's interpreter: k3lab sets
TRITON_INTERPRET=1 here, before anything imports triton, unless the user set it already.
"""

import os as _os

__version__ = "0.1.0"


def _gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: k3lab's own import will say so
        return False


if "TRITON_INTERPRET" not in _os.environ and not _gpu_present():
    _os.environ["TRITON_INTERPRET"] = "1"

from k3lab._cells import hook_cells as _hook_cells  # noqa: E402  (after TRITON_INTERPRET is decided)

_hook_cells()
