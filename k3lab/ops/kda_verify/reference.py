"""The plain PyTorch reference of KDA verification (k3lab.nn.kda.kda_recurrent, one position at a
time) and the rollback helper every backend's states feed."""

from __future__ import annotations

import torch

from k3lab.nn.kda import kda_recurrent


def select_accepted(states: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """The state to keep after verification: states [B, T, H, K, V], num_accepted [B]
    in 1..T (accepted drafts + the bonus/recovery token) -> [B, H, K, V]."""
    if states.dim() != 5:
        raise ValueError(f"states must be [B, T, H, K, V], got {tuple(states.shape)}")
    if num_accepted.shape != states.shape[:1]:
        raise ValueError(f"num_accepted must be [B={states.shape[0]}], got {tuple(num_accepted.shape)}")
    idx = (num_accepted.long() - 1).view(-1, 1, 1, 1, 1).expand(-1, 1, *states.shape[2:])
    return states.gather(1, idx).squeeze(1)


def reference_verify(q, k, v, g, beta, initial_state, *, scale=None, cu_seqlens=None, lengths=None,
                     dtype=torch.float64):
    """Per-position outputs and states from k3lab.nn.kda.kda_recurrent, one position at a time, in
    `dtype` (fp64 by default) on the inputs' device. Same layouts as `kda_verify`; ragged positions
    past a length get o = 0 and state = NaN, so a comparison that reads them fails."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    cast = [t.detach().to(dtype) for t in (q, k, v, g, beta)]
    o = torch.zeros(B, T, H, V, dtype=dtype, device=dev)
    states = torch.full((B, T, H, K, V), float("nan"), dtype=dtype, device=dev)
    if cu_seqlens is None and lengths is None:  # uniform: the whole batch steps together
        S = (torch.zeros(B, H, K, V, dtype=dtype, device=dev) if initial_state is None
             else initial_state.detach().to(dtype))
        for t in range(T):
            out, S = kda_recurrent(*[x[:, t:t + 1] for x in cast], scale=scale, initial_state=S)
            o[:, t], states[:, t] = out[:, 0], S
        return o, states
    if cu_seqlens is not None:
        bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        seqs = [(0, a, b - a) for a, b in bounds]  # (batch row, first token, length)
    else:
        seqs = [(i, 0, int(n)) for i, n in enumerate(lengths.tolist())]
    h0 = (torch.zeros(len(seqs), H, K, V, dtype=dtype, device=dev) if initial_state is None
          else initial_state.detach().to(dtype))
    for n, (row, start, length) in enumerate(seqs):
        S = h0[n:n + 1]
        for t in range(start, start + length):
            out, S = kda_recurrent(*[x[row:row + 1, t:t + 1] for x in cast], scale=scale, initial_state=S)
            o[row, t], states[row, t] = out[0, 0], S[0]
    return o, states


def reference_into(x, tile_v: int = 0, num_warps=None, pdl=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 'torch' row of kda_verify's table: `reference_verify` in fp32 on `prepare`d inputs x
    (k3lab.ops.kda_verify.inputs.VerifyInputs), written where the kernels write: x.o (padded positions
    0) and x.hs, a state per live position (positions past a length untouched) or, for
    final_state_only, each sequence's last state (its initial state when it is empty). The launch
    options (tile_v, num_warps, pdl) do not change the result and are ignored. One host read of the
    sequence bounds (a reference, not a graph-captured path)."""
    ragged = {1: {"cu_seqlens": x.seq_info}, 2: {"lengths": x.seq_info}}.get(x.mode, {})
    o, states = reference_verify(x.q, x.k, x.v, x.g, x.beta, x.h0, scale=x.scale, dtype=torch.float32,
                                 **ragged)
    x.o.copy_(o)
    B, T = x.q.shape[:2]
    if x.mode == 1:  # one flattened row: (row, first token, length) per sequence
        bounds = x.seq_info.tolist()
        seqs = [(0, a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        lens = x.seq_info.tolist() if x.mode == 2 else [T] * B
        seqs = [(n, 0, int(n_len)) for n, n_len in enumerate(lens)]
    for n, (row, start, length) in enumerate(seqs):
        if x.all_states:
            x.hs[row, start:start + length] = states[row, start:start + length]
        else:
            x.hs[n] = states[row, start + length - 1] if length else x.h0[n]
    return x.o, x.hs
