"""Cache reuse across agent turns (seed section 1): what one request's state is, where it can resume,
what agent traces look like, and how a prefix cache with a host tier behaves over them.

- `state`: save one request's `K3Model` state to host memory and restore it (MLA latent rows, KDA conv
  and recurrent state, AttnRes blocks); checkpoints of a sequence at chosen positions.
- `resume`: the rule that a hit resumes only where MLA history and a KDA checkpoint meet.
- `traces`: agent-session traces in the public cc-traces schema: a strict loader and a seeded generator.
- `sim`: a prefix-cache simulator over such traces (HBM budget, host tier, eviction, checkpoints).

What is measured of it (the simulator's speed, host <-> device copies, one request's state offloaded and
restored) is the agent_cache study's (k3lab.studies.agent_cache, `k3lab bench agent_cache`).

Pure PyTorch and numpy; nothing here needs a GPU (pinned host memory is used where there is one).
"""

from .resume import resume_point
from .state import RequestState, SequenceCheckpoints, restore, save

__all__ = ["RequestState", "SequenceCheckpoints", "restore", "resume_point", "save"]
