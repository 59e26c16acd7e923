"""Task of notebook 05 (KDA group scan): summarise each group of chunk maps before the state is
known, then scan over the summaries to get every group's starting state.

The chunk maps are the real ones: `k3lab.ops.kda_chunk.scan_math.chunk_affine` of random KDA inputs
(small K and V and 16-token chunks, so the check is quick). The grader compares the learner's group
summaries with `scan_math.group_summaries` and the starting states with a plain walk that applies the
chunk maps one by one (`scan_math.apply`), all in fp64; a walk cannot be told apart from a scan by its
states, so the summaries are graded too.
"""

from __future__ import annotations

import torch

from k3lab.ops.kda_chunk import scan_math

from ._core import Case, Task


def _maps(gen, B: int, H: int, n: int, K: int, V: int, chunk: int):
    T = n * chunk
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) - 4.0)  # mild decay
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    cq = scan_math.chunk_quantities(q, k, v, g, beta, chunk_size=chunk)
    return scan_math.chunk_affine(cq)  # A [B, H, n, K, K], Bc [B, H, n, K, V]


def _cases(seed: int, device) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    specs = [  # (label, B, H, chunks, group size, K, V, dtype)
        ("7 chunks in groups of 3: the last group is short", 1, 2, 7, 3, 16, 8, torch.float64),
        ("8 chunks in groups of 2", 2, 1, 8, 2, 16, 16, torch.float64),
        ("6 chunks in groups of 4, fp32 maps", 1, 2, 6, 4, 16, 8, torch.float32),
        ("5 chunks, one group of 8 (the walk itself)", 1, 1, 5, 8, 8, 8, torch.float64),
    ]
    out = []
    for label, B, H, n, gs, K, V, dt in specs:
        A, Bc = _maps(gen, B, H, n, K, V, chunk=16)
        S0 = 0.5 * torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
        out.append(Case(label, {"A": A.to(dt), "Bc": Bc.to(dt), "S0": S0.to(dt), "group_size": gs}, dt,
                        out_dtype={"M": dt, "b": dt, "starts": dt}))
    return out


def _reference(case: Case):
    x = case.inputs
    A, Bc, S = x["A"].double(), x["Bc"].double(), x["S0"].double()
    M, b = scan_math.group_summaries(A, Bc, x["group_size"])
    starts = []
    for c in range(A.shape[2]):  # the plain walk, recording the state where each group begins
        if c % x["group_size"] == 0:
            starts.append(S)
        S = scan_math.apply((A[:, :, c], Bc[:, :, c]), S)
    return M, b, torch.stack(starts, 2)


def group_scan_solution(A, Bc, S0, group_size):
    """Summaries first (no state needed: 'apply (A1, B1), then (A2, B2)' is (A2 A1, A2 B1 + B2)),
    then one step per group from S0."""
    B, H, n, K, _ = A.shape
    Ms, bs = [], []
    for s in range(0, n, group_size):
        M = torch.eye(K, dtype=A.dtype).expand(B, H, K, K)
        b = torch.zeros_like(Bc[:, :, 0])
        for c in range(s, min(s + group_size, n)):
            M, b = A[:, :, c] @ M, A[:, :, c] @ b + Bc[:, :, c]
        Ms.append(M)
        bs.append(b)
    M, b = torch.stack(Ms, 2), torch.stack(bs, 2)
    starts, S = [], S0
    for j in range(M.shape[2]):
        starts.append(S)
        S = M[:, :, j] @ S + b[:, :, j]
    return M, b, torch.stack(starts, 2)


STUB = '''\
def group_scan(A, Bc, S0, group_size):
    """A [B, H, n, K, K], Bc [B, H, n, K, V]: chunk c maps a state S to A[:, :, c] @ S + Bc[:, :, c].
    S0 [B, H, K, V]: the state before chunk 0. Groups are chunks [0, g), [g, 2g), ... (the last may be
    shorter). Return (M [B, H, G, K, K], b [B, H, G, K, V], starts [B, H, G, K, V]): each group's
    summary map and the state at the start of each group."""
    # TODO 1: compose each group's chunk maps, in order, into one (M, b) - without using S0
    # TODO 2: scan: starts[0] = S0; each next start is the previous group's map applied to its start
    raise NotImplementedError("write the group scan")
'''

TASK = Task(
    name="kda_group_scan", notebook="05_kda_scan", minutes=15,
    statement="""\
**Task: the scan over group summaries.** Chunk `c` maps the state `S` to `A_c S + B_c`, and these maps
are known before any state is. Write `group_scan(A, Bc, S0, group_size)`: first compose each group's
chunk maps into one summary `(M, b)` (applying `(A1, B1)` then `(A2, B2)` is `(A2 A1, A2 B1 + B2)`),
then walk the summaries, one step per group, to get the state at the start of every group. `check`
compares your summaries with `scan_math.group_summaries` and your starting states with a chunk-by-chunk
walk, in fp64 (one case has fp32 maps).""",
    signature="group_scan(A: Tensor[B, H, n, K, K], Bc: Tensor[B, H, n, K, V], S0: Tensor[B, H, K, V], "
              "group_size: int) -> (M: Tensor[B, H, G, K, K], b: Tensor[B, H, G, K, V], "
              "starts: Tensor[B, H, G, K, V])",
    outputs=("M", "b", "starts"), cases=_cases, reference=_reference, solution=group_scan_solution, stub=STUB,
    forbidden=("k3lab.ops.kda_chunk.scan_math.group_summaries", "k3lab.ops.kda_chunk.scan_math.scan_starts"),
    hints=(
        "A chunk's map S -> A S + B is affine, and two affine maps in a row are again one affine map. You "
        "can work out that one map without knowing S.",
        "Applying (A1, B1) and then (A2, B2) is (A2 A1, A2 B1 + B2): the later map's A multiplies from the "
        "left. Fold each group's chunks into (M, b) starting from (I, 0); the last group may be shorter. "
        "Then walk the G summaries in order: starts[0] = S0 and starts[j + 1] = M_j starts[j] + b_j.",
        "For each group start s: `M = torch.eye(K, dtype=A.dtype).expand(B, H, K, K)`, "
        "`b = torch.zeros_like(Bc[:, :, 0])`; for c in the group: `M, b = A[:, :, c] @ M, A[:, :, c] @ b + "
        "Bc[:, :, c]`; stack the groups on dim 2. The walk appends S before it applies group j's map.",
    ))
