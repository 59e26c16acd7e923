"""FP8 dense projections in the decode step (k3lab.engine.fp8, DecodeStep(projections='fp8')).

Tiers of check: the quantizers against e4m3fn's rounding bound, element by element; `fp8_linear`
against the same product on the dequantized operands in fp64 (tight) and against the unquantized
matmul (fp8 tolerance); the whole FP8 step against its plain-PyTorch form (every projection
dequantized and multiplied in fp32: tight, logits and every state the step writes); and the FP8 step
against the full-precision step and K3Model, with bounds derived below. On a GPU: a reduced-depth model
at K3's widths, 8 TP ranks in lockstep, FP8 against bf16, and capture()/replay() against eager.
"""

from __future__ import annotations

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.engine import DecodeStep, RankWeights, fp8, resolve, run_group
from k3lab.studies.decode_step.measure import CPU_CONFIG
from k3lab.engine.weights import FP8_PROJECTIONS
from k3lab.model import K3Model, init_weights

from test_step import BATCH, CONTEXT, CPU_STEP, SMALL, tp8_model_after_prefill
from test_step import _rel_l2 as _rel

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# e4m3fn rounds to 3 mantissa bits: a normal value moves by at most half a unit in the last place,
# 2^-4 of itself; below the smallest normal (2^-6) the spacing is 2^-9, so at most 2^-10 absolute,
# in units of the row's scale. The fp32 division before the cast adds one rounding (the 1e-6 slack).
REL_BOUND, SUBNORMAL_BOUND = 2.0 ** -4, 2.0 ** -10


def _rows(seed: int, m: int, k: int) -> torch.Tensor:
    """Rows of very different sizes (1e-3 .. 1e3), one of them all zero."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m).unsqueeze(1)
    t[m // 2] = 0.0
    return t


def test_quantize_rows_round_trip_is_within_e4m3_rounding():
    t = _rows(0, 9, 100)
    q, scale = fp8.quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape
    assert scale.dtype == torch.float32 and scale.shape == (9, 1) and bool(torch.isfinite(scale).all())
    back = q.float() * scale
    err = (back - t).abs()
    bound = REL_BOUND * t.abs() + SUBNORMAL_BOUND * scale + 1e-6 * t.abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert bool((back[4] == 0).all())  # the zero row stays zero
    nonzero = [r for r in range(9) if r != 4]
    assert bool((q.float().abs().amax(1)[nonzero] == fp8.FP8_MAX).all())  # each row's amax maps to 448
    assert 0.01 < _rel(back, t) < REL_BOUND  # it did quantize: about 2.6% rms


def test_quantize_weight_pads_to_16_and_dequantizes():
    w = _rows(1, 37, 40)
    lin = fp8.quantize_weight(w, chunk_rows=8)  # several chunks
    assert lin.wq.shape == (48, 48) and lin.scale.shape == (1, 48) and lin.shape == (37, 40)
    assert bool((lin.wq[37:].float() == 0).all()) and bool((lin.wq[:, 40:].float() == 0).all())
    assert bool((lin.scale[0, 37:] == 1).all())
    err = (lin.dequantize() - w).abs()
    bound = REL_BOUND * w.abs() + SUBNORMAL_BOUND * lin.scale[0, :37, None] + 1e-6 * w.abs()
    assert bool((err <= bound).all())
    assert lin.nbytes() == 48 * 48 + 48 * 4
    with pytest.raises(ValueError, match="w must be a 2-D float weight"):
        fp8.quantize_weight(torch.zeros(3, 4, 5))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("emulated", (False, True), ids=("scaled_mm", "emulated"))
def test_fp8_linear_equals_the_dequantized_product(dtype, emulated):
    """M = 3 tokens (no padding needed), K = 40 and N = 37 (both padded to 48)."""
    if not emulated and not fp8.fp8_status("cpu", dtype)[0]:
        pytest.skip(f"no CPU e4m3fn product in this torch: {fp8.fp8_status('cpu', dtype)[1]}")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 40, generator=g).to(dtype)
    w = torch.randn(37, 40, generator=g) * 40 ** -0.5
    lin = fp8.quantize_weight(w, emulated=emulated)
    y = fp8.fp8_linear(x, lin)
    assert y.dtype == dtype and y.shape == (3, 37)
    xq, sx = fp8.quantize_rows(x)
    want = (xq.double() * sx.double()) @ lin.dequantize().double().t()
    bench.check(y, want, dtype=dtype, name="fp8_linear vs the dequantized product")
    bench.check(y, x.double() @ w.double().t(), dtype="fp8", name="fp8_linear vs the unquantized matmul")
    xin = fp8.quantize_input(x, lin)  # quantized once, read by two projections of the same width
    assert torch.equal(fp8.linear(xin, lin), y) and fp8.quantize_input(x, w) is x
    with pytest.raises(ValueError, match=r"x must be \[M, 40\]"):
        fp8.fp8_linear(x[:, :32], lin)
    with pytest.raises(ValueError, match="weight is a plain tensor"):
        fp8.linear(xin, w)
    with pytest.raises(ValueError, match="quantized for 40 input features"):
        fp8.fp8_linear(xin, fp8.quantize_weight(w[:, :32]))


def test_fp8_status_and_resolution_on_the_cpu():
    ok, why = fp8.fp8_status("cpu", torch.float32)
    assert isinstance(ok, bool) and (ok == (why == ""))
    ran, note = fp8.resolve_projections("fp8", "cpu", torch.float32)
    assert (ran, note == "") == (("fp8", True) if ok else ("fp8_emulated", False))
    assert fp8.resolve_projections("bf16", "cpu", torch.float32) == ("fp32", "")
    assert fp8.resolve_projections("bf16", "cpu", torch.bfloat16) == ("bf16", "")
    assert not fp8.fp8_status("meta")[0]


def test_fp8_that_cannot_run_falls_back_and_says_so(monkeypatch):
    """Where FP8 cannot run (an older GPU, a torch without e4m3fn products): a GPU step runs its own
    dtype with a note, or raises with strict=True; a CPU step runs the plain-PyTorch emulation."""
    monkeypatch.setattr(fp8, "fp8_status", lambda device, dtype=torch.bfloat16: (False, "no FP8 here"))
    ran, note = fp8.resolve_projections("fp8", "cuda", torch.bfloat16)
    assert ran == "bf16" and note.startswith("no FP8 here") and "run in bf16" in note
    with pytest.raises(ValueError, match=r"projections='fp8' cannot run here \(no FP8 here\)"):
        fp8.resolve_projections("fp8", "cuda", torch.bfloat16, strict=True)
    ran, note = fp8.resolve_projections("fp8", "cpu", torch.float32)
    assert ran == "fp8_emulated" and "for CPU tests only" in note
    assert fp8.resolve_projections("bf16", "cuda", torch.bfloat16) == ("bf16", "")


@CPU_STEP
def test_cpu_step_without_e4m3_products_runs_the_emulation(monkeypatch):
    w = RankWeights.random(CPU_CONFIG, distinct_layers=1, dtype=torch.float32)
    ids = torch.tensor([[3], [7]])
    real = DecodeStep(CPU_CONFIG, BATCH, CONTEXT, weights=w, projections="fp8")
    monkeypatch.setattr(fp8, "fp8_status", lambda device, dtype=torch.bfloat16: (False, "no FP8 here"))
    emul = DecodeStep(CPU_CONFIG, BATCH, CONTEXT, weights=w, projections="fp8")
    assert emul.resolved.projections == "fp8_emulated" and emul.describe()["projections"] == "fp8_emulated"
    assert "emulation" in emul.resolved.notes["projections"] and emul.weights.layers[0].attn.w_in.emulated
    assert any(line.startswith("projections: fp8_emulated") for line in emul.resolved.describe())
    with pytest.raises(ValueError, match="cannot run here"):
        DecodeStep(CPU_CONFIG, BATCH, CONTEXT, weights=w, projections="fp8", strict=True)
    with pytest.raises(ValueError, match="convert the unconverted RankWeights with to_fp8"):
        DecodeStep(CPU_CONFIG, BATCH, CONTEXT, weights=real.weights, projections="fp8")
    bench.check(_first_step(emul, ids)[0], _first_step(real, ids)[0], dtype="fp32", rel_l2=1e-5, max_rel=1e-2,
                name="emulated vs torch._scaled_mm logits")


@pytest.mark.parametrize("bad", ("int8", "FP8", True, 8))
def test_bad_projections_value_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="projections must be one of"):
        DecodeStep(SMALL, 1, 4, device="cpu", projections=bad)
    with pytest.raises(ValueError, match="projections must be one of"):
        resolve("all", "cpu", torch.float32, 1, projections=bad)


@CPU_STEP
def test_weights_in_fp8_and_a_bf16_step_do_not_mix():
    w = RankWeights.random(CPU_CONFIG, distinct_layers=2, dtype=torch.float32)
    q = w.to_fp8()
    assert q.projections == "fp8" and w.projections == "bf16"
    assert q.nbytes()["total"] < w.nbytes()["total"] and q.nbytes()["experts"] == w.nbytes()["experts"]
    assert q.layers[0].attn is q.layers[2].attn and q.layers[1].mlp is q.layers[3].mlp  # rotation kept
    assert q.layers[1].norms is w.layers[1].norms and q.layers[1].mlp.w1 is w.layers[1].mlp.w1
    assert isinstance(q.layers[1].mlp.gate, torch.Tensor) and isinstance(q.lm_head, torch.Tensor)
    stored = sum(getattr(part, n).nbytes() for lw in q.layers for part in (lw.attn, lw.mlp)
                 for n in FP8_PROJECTIONS.get(type(part).__name__, ()) if getattr(part, n) is not None)
    assert q.projection_bytes("fp8") == w.projection_bytes("fp8") == stored  # from shapes = as stored
    plain = sum(getattr(part, n).numel() * 4 for lw in w.layers for part in (lw.attn, lw.mlp)
                for n in FP8_PROJECTIONS.get(type(part).__name__, ()) if getattr(part, n) is not None)
    assert q.projection_bytes("bf16") == w.projection_bytes("bf16") == plain
    for form in ("fp8", "bf16"):  # the attribution's per-part figures sum to the whole
        parts = w.projection_bytes(form, by_part=True)
        assert set(parts) == {"kda", "mla", "moe", "dense"} and all(v > 0 for v in parts.values()), parts
        assert sum(parts.values()) == w.projection_bytes(form)
    with pytest.raises(ValueError, match="projections are fp8 already"):
        q.to_fp8()
    with pytest.raises(ValueError, match="weights hold fp8 projections but this step runs fp32"):
        DecodeStep(CPU_CONFIG, 2, 4, weights=q)
    with pytest.raises(ValueError, match="weights hold fp8 projections but this step runs gemv"):
        DecodeStep(CPU_CONFIG, 1, 4, weights=q, projections="gemv")
    g = w.to_gemv()  # GEMV weights a step converted earlier: a later GEMV step takes them as they are
    assert DecodeStep(CPU_CONFIG, 1, 4, weights=g, projections="gemv").weights is g


def _first_step(step: DecodeStep, ids) -> tuple[torch.Tensor, dict]:
    with torch.no_grad():
        logits = step(ids).clone()
    return logits, step.save_state()


@CPU_STEP
@pytest.mark.parametrize("q_len", (1, 3), ids=("decode", "verify"))
def test_fp8_step_equals_its_plain_pytorch_form(q_len):
    """The bench's CPU configuration (a TP2 slice, random weights): the FP8 step (torch._scaled_mm
    where this torch has CPU e4m3fn products) against the same step with every projection dequantized
    and multiplied in fp32. Same quantized operands, fp32 accumulation in both: only the order of the
    sums differs, so the bound is fp32's (rel_l2 1e-5) on the logits and every state the step writes."""
    w = RankWeights.random(CPU_CONFIG, distinct_layers=2, dtype=torch.float32)
    ids = torch.randint(0, CPU_CONFIG.vocab_size, (BATCH, q_len), generator=torch.Generator().manual_seed(4))
    fast = DecodeStep(CPU_CONFIG, BATCH, CONTEXT, weights=w, q_len=q_len, projections="fp8")
    plain = DecodeStep(CPU_CONFIG, BATCH, CONTEXT, weights=w.to_fp8(emulated=True), q_len=q_len,
                       projections="fp8")
    assert (
        plain.resolved.projections == "fp8_emulated"
        and "emulated=True" in plain.resolved.notes["projections"]
    )
    assert fast.resolved.projections == ("fp8" if fp8.fp8_status("cpu", torch.float32)[0] else "fp8_emulated")
    assert fast.describe()["projections"] == fast.resolved.projections
    assert fast.resolved.label().endswith(f"{fast.resolved.projections} projections")
    got, got_state = _first_step(fast, ids)
    want, want_state = _first_step(plain, ids)
    bench.check(got, want, dtype="fp32", rel_l2=1e-5, max_rel=1e-2, name="logits")
    for name, t in want_state.items():
        bench.check(got_state[name], t, dtype="fp32", rel_l2=1e-5, max_rel=1e-2, name=name)


@CPU_STEP
def test_fp8_step_is_near_the_model():
    """SMALL (KDA + the dense MLP, MLA + MoE) from a K3Model, against the model's own forward. Bounds:
    layer 0's new conv column is one projection from the same input, each quantized factor within 2^-4
    (about 2.6% rms) and their product about 3.7% rms: <= 6%, and so is its state (one rank-1 update
    of it); the columns shifted along are the model's exactly. Later quantities take several
    projections in series (~4% each): layer 1's new latent row (three) <= 15%, the logits (four, plus
    the depth mix) <= 20%. Seeds 0-3 give 3.6-4.1% (new conv columns), 1.7-2.4% (state), 5.7-8.4%
    (latent) and 7-11% (logits). The full-precision step matches the model to ~1e-6 (test_step); the
    FP8 one must be at least 1% away (FP8 did run)."""
    model = init_weights(K3Model(SMALL), 3).eval()
    ids = torch.randint(0, SMALL.vocab_size, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, cache = model.prefill(ids[:, :CONTEXT])
        ref, ref_cache = model(ids[:, CONTEXT:], cache)
        step = DecodeStep.from_model(model, BATCH, CONTEXT, projections="fp8")
        step.load_cache(cache)
        logits = step(ids[:, CONTEXT:])
    assert (
        step.resolved.projections.startswith("fp8")
        and step.describe()["projections"] == step.resolved.projections
    )
    got, want = step.cache_entries(), ref_cache.entries()
    for name in ("layers.0.conv_q", "layers.0.conv_k", "layers.0.conv_v"):
        assert torch.equal(got[name][..., :-1], want[name][..., :-1]), name
        assert _rel(got[name][..., -1], want[name][..., -1]) <= 0.06, (
            name,
            _rel(got[name][..., -1], want[name][..., -1]),
        )
    assert _rel(got["layers.0.state"], want["layers.0.state"]) <= 0.06
    latent = _rel(got["layers.1.latent"][:, CONTEXT:], want["layers.1.latent"][:, CONTEXT:])
    assert latent <= 0.15, latent
    assert 0.01 <= _rel(logits, ref) <= 0.20, _rel(logits, ref)
    assert bool(torch.isfinite(logits).all())


# ------------------------------------------------------------------ GPU (not yet run on a GPU)
def _needs_fp8() -> None:
    ok, why = fp8.fp8_status("cuda")
    if not ok:
        pytest.skip(f"FP8 matmul cannot run on this GPU: {why}")


@GPU
def test_gpu_fp8_linear_equals_the_dequantized_product():
    """K3's widths: 7,168 in, 6,284 out (a KDA layer's stacked input projection, padded to 6,288);
    bf16 output against the dequantized product in fp64 (bf16 tolerance: the output's rounding)."""
    _needs_fp8()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(3, 7168, device="cuda", generator=g).bfloat16()
    w = torch.randn(6284, 7168, device="cuda", generator=g).mul_(7168 ** -0.5).bfloat16()
    lin = fp8.quantize_weight(w)
    y = fp8.fp8_linear(x, lin)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 6284)
    xq, sx = fp8.quantize_rows(x)
    bench.check(y, (xq.double() * sx.double()) @ lin.dequantize().double().t(), dtype=torch.bfloat16,
                name="fp8_linear vs the dequantized product")


@GPU
def test_gpu_one_row_fp8_linear_reads_the_weight_with_its_scales():
    """Decode at batch 1: one row takes the W8A16 path (k3lab.ops.gemv on the e4m3fn weight and its row
    scales, the activation unquantized): equal to x @ the dequantized weight (fp64), with no activation
    quantized (`quantize_input` hands x back); three rows still quantize the activation."""
    _needs_fp8()
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(1, 7168, device="cuda", generator=g).bfloat16()
    w = torch.randn(6284, 7168, device="cuda", generator=g).mul_(7168 ** -0.5).bfloat16()
    lin = fp8.quantize_weight(w)
    assert fp8.one_row(x, lin) and fp8.quantize_input(x, lin) is x
    assert isinstance(fp8.quantize_input(x.repeat(3, 1), lin), fp8.Fp8Input)
    y = fp8.fp8_linear(x, lin)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 6284)
    bench.check(y, x.double() @ lin.dequantize().double().t(), dtype=torch.bfloat16,
                name="one-row fp8_linear vs the dequantized weight's product")


@GPU
def test_gpu_tp8_slice_fp8_near_bf16_and_graph_equals_eager():
    """Four layers at K3's widths (KDA x3, MLA; 16 experts so that 8 ranks' weights fit one GPU), every
    switch on, 8 ranks in lockstep: FP8 projections against bf16 ones. Layer 0 (KDA and the dense MLP,
    no router) is one projection deep as in test_fp8_step_is_near_the_model, with bf16's own ~1% on
    top: its new conv columns and its state <= 8%. The logits pass three MoE routers that read the
    FP8-perturbed stream, where
    a near-tie picks another expert: a one-rank model at the TP8 slice's widths gives 7-18% on a CPU
    (seeds 0-3, fp32), so their bound, 35%, catches O(1) errors (a wrong scale or operand), not drift.
    Then rank 0's FP8 step alone (stand-in collectives) captured as one CUDA graph: a replay from the
    saved state equals the eager step (the same kernels; bf16 tolerance)."""
    _needs_fp8()
    model, ids, cache = tp8_model_after_prefill()
    out = {}
    with torch.no_grad():
        for proj in ("bf16", "fp8"):
            steps = [DecodeStep.from_model(model, 1, 64, tp=8, rank=r, projections=proj, strict=True)
                     for r in range(8)]
            for st in steps:
                st.load_cache(cache)
            logits = run_group(steps, ids[:, 64:])
            assert steps[0].resolved.projections == proj, steps[0].resolved.notes
            out[proj] = (logits[0].clone(), {k: v.clone() for k, v in steps[0].cache_entries().items()
                                             if k.startswith("layers.0.")})
            del steps, logits
        torch.cuda.empty_cache()
        for name, t in out["bf16"][1].items():
            new = (..., -1) if "conv" in name else (...,)  # the conv column this step wrote; the whole state
            err = _rel(out["fp8"][1][name][new], t[new])
            assert err <= 0.08, (name, err)
        assert _rel(out["fp8"][0], out["bf16"][0]) <= 0.35, _rel(out["fp8"][0], out["bf16"][0])
        step = DecodeStep.from_model(model, 1, 64, tp=8, rank=0, projections="fp8", strict=True)
        step.load_cache(cache)
        assert step.capturable() == (True, "")
        saved = step.save_state()
        eager = step(ids[:, 64:]).clone()
        step.capture()
        for _ in range(2):
            step.restore_state(saved)
            bench.check(step.replay().clone(), eager, dtype=torch.bfloat16, name="graph replay vs eager")
