"""Inputs and an error measure shared by the tests of the hand-written KDA prefill kernels."""

import torch


def _inputs(B, T, H, seed=0, gate_low=-5.0, device="cuda"):
    """bf16 q, k (normalised), v; fp32 gates with per-channel rates down to `gate_low` per token; beta."""
    gen = torch.Generator().manual_seed(seed)
    K = 128
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    bias = torch.linspace(-9, 0, K)[torch.randperm(K, generator=gen)]
    g = gate_low * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) + bias)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    bf = torch.bfloat16
    return (q.to(device, bf), k.to(device, bf), v.to(device, bf), g.to(device), beta.to(device))


def _rel(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_ragged_against_fp64(o, S, inputs, cu, S0):
    """o and every final state of a packed ragged call (cu_seqlens `cu`, initial states S0) against
    k3lab.nn.kda.kda_chunked in fp64, sequence by sequence (rel. L2 within 1e-2)."""
    from k3lab.nn.kda import kda_chunked

    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        ro, rS = kda_chunked(*(t[:, a:b].double() for t in inputs), initial_state=S0[n : n + 1].double())
        assert _rel(o[:, a:b], ro) < 1e-2, f"o of sequence {n}"
        assert _rel(S[n], rS[0]) < 1e-2, f"state of sequence {n}"
