"""k3lab.ops.mla_glue compiled on a GPU: the three launches against the torch backend on the same GPU at
TP8's MLA shape (bf16: equal or within 1 ulp, as in the interpreter; fp32: a few fp32 ulps), and the
three calls captured in a CUDA graph and replayed. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from test_mla_glue import BT, EPS, POS, _agree, _inputs
from k3lab.ops import mla_glue as mg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _cuda(d: dict) -> dict:
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def _glue(d, latent, q_buf, backend):
    T = d["T"]
    qa_n = mg.mla_norms(d["qa"], d["ckv"], d["q_a_norm"], d["kv_a_norm"], EPS, latent[:, POS:POS + T],
                        backend=backend)
    mg.mla_absorb_q(d["q"], d["w_uk"], q_buf, backend=backend)
    return qa_n, mg.mla_out_gate(d["o_lat"], d["w_uv"], d["g"], backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T", BT, ids=["b1t1", "b1t2", "b2t1"])
def test_compiled_glue_matches_the_torch_backend(B, T, dtype):
    stacked = _inputs("tp8", B, T, dtype)
    d = _cuda({k: v for k, v in stacked.items() if k not in ("qa", "ckv", "g")})
    big = torch.cat([stacked["qa"], stacked["ckv"], stacked["g"]], dim=-1).cuda()
    d["qa"], d["ckv"], d["g"] = big.split([d["Q"], d["LAT"] + d["ROPE"], d["H"] * d["V"]], dim=-1)
    outs = {}
    for backend in ("triton", "torch"):
        latent, q_buf = d["latent"].clone(), torch.full_like(d["q_buf"], float("nan"))
        latent[:, POS:POS + T] = float("nan")
        outs[backend] = (*_glue(d, latent, q_buf, backend), latent, q_buf)
    for name, got, want in zip(("qa_normed", "o", "latent", "q_buf"), outs["triton"], outs["torch"]):
        _agree(got, want, name)


def test_the_three_calls_replay_in_a_cuda_graph():
    d = _cuda(_inputs("tp8", 1, 1, torch.bfloat16))
    latent, q_buf = d["latent"].clone(), d["q_buf"].clone()
    eager = _glue(d, latent, q_buf, "triton")  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    latent2, q_buf2 = d["latent"].clone(), torch.zeros_like(d["q_buf"])
    with torch.cuda.graph(graph):
        captured = _glue(d, latent2, q_buf2, "triton")
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip((*eager, latent, q_buf), (*captured, latent2, q_buf2)):
        assert torch.equal(a, b)
