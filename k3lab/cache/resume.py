"""Where a returning request can resume: the position at which MLA history and KDA state both exist.

A prefix-cache hit on a hybrid model needs both kinds of state at one position p:
- MLA: the latent rows of positions [0, p). A server stores them in blocks of `mla_block` positions;
  only whole blocks are kept, so the stored history reaches floor(reach / mla_block) * mla_block,
  unless the partial last block (the tail) was saved with a KDA checkpoint, in which case it reaches
  `reach` exactly.
- KDA: conv and recurrent state describe one position only, so they exist only where a checkpoint was
  saved (on a block grid, and at the end of a request's prompt).

The request resumes at the latest checkpoint that the stored MLA history covers, and recomputes the
rest. The seed's example: MLA history reaches 3,072, the latest compatible KDA checkpoint is at
2,048: the request resumes at 2,048. A checkpoint at the end of the last turn (3,100, say) is only
usable if the MLA tail [3,072, 3,100) was saved beside it: that is what tail alignment buys.
Restoring MLA rows without the matching KDA state would not fail: it would give wrong output, which
is why the rule is applied before anything is restored.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..ops import int_arg  # an int >= 0 by default: never a bool, never a float


def stored_mla_reach(mla_reach: int, *, mla_block: int, tail_saved: bool = False) -> int:
    """How far the stored MLA history reaches: whole blocks of `mla_block` positions, or all of
    `mla_reach` when the tail was saved."""
    int_arg("mla_reach", mla_reach)
    if int_arg("mla_block", mla_block) == 0:
        raise ValueError("mla_block must be at least 1 position, got 0")
    return mla_reach if tail_saved else (mla_reach // mla_block) * mla_block


def resume_point(mla_reach: int, kda_checkpoints: Iterable[int], *, mla_block: int = 16,
                 tail_saved: bool = False, limit: int | None = None) -> int:
    """The position a request resumes at: the largest KDA checkpoint not beyond the stored MLA history
    (and not beyond `limit`, e.g. prompt length - 1, since at least one token must be computed to
    produce logits); 0 when none qualifies (the request recomputes everything).

    mla_reach: positions of MLA history the cache held; kda_checkpoints: positions with saved KDA
    state; mla_block: positions per stored MLA block (vLLM's block size); tail_saved: the partial last
    MLA block was saved with the checkpoint at its end."""
    stored = stored_mla_reach(mla_reach, mla_block=mla_block, tail_saved=tail_saved)
    if limit is not None:
        stored = min(stored, int_arg("limit", limit))
    best = 0
    for i, c in enumerate(kda_checkpoints):
        int_arg(f"kda_checkpoints[{i}]", c)
        if best < c <= stored:
            best = c
    return best


def grid_checkpoints(length: int, interval: int) -> list[int]:
    """Checkpoint positions saved on a grid of `interval` positions over a prompt of `length`."""
    int_arg("length", length)
    if int_arg("interval", interval) == 0:
        raise ValueError("interval must be at least 1 position, got 0")
    return list(range(interval, length + 1, interval))
