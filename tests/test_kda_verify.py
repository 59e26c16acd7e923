"""KDA verification kernels (k3lab.ops.kda_verify) against the fp64 reference, on CPU through
Triton's interpreter (fp32 inputs: bf16 is not trusted there). V is kept small (K must be 128) so
each case runs a few dozen programs."""

import functools

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.ops import kda_verify as kv

K = kv.HEAD_DIM
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the tests' tensors live where the kernels run


def make(B, T, H, V=32, seed=0, N=None):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen)

    x = {
        "q": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1),
        "k": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1),
        "v": rn(B, T, H, V),
        "g": -5.0 * torch.sigmoid(2 * rn(B, T, H, K) - 1),
        "beta": torch.sigmoid(rn(B, T, H)),
        "initial_state": 0.5 * rn(N or B, H, K, V),
    }
    return {name: t.to(DEV) for name, t in x.items()}


def check(o, states, ref_o, ref_states):
    bench.check_all({"o": (o, ref_o), "states": (states, ref_states)}, dtype=torch.float32)


@pytest.mark.parametrize("tile_v, form", [(4, "chunk"), (8, "chunk"), (8, "step"), (8, "tile"), (4, "tile"), (32, None)])
def test_every_position_matches_reference(tile_v, form):
    x = make(2, 3, 2)
    ref_o, ref_s = kv.reference_verify(**x)
    o, states = kv.kda_verify(**x, tile_v=tile_v, form=form)
    assert states.shape == (2, 3, 2, K, 32)
    check(o, states, ref_o, ref_s)
    for t in range(3):  # each saved state on its own, so a wrong early position cannot hide
        bench.check(states[:, t], ref_s[:, t], dtype=torch.float32, name=f"state[{t}]")


def test_before_kernel_matches_reference():
    x = make(2, 3, 2)
    ref_o, ref_s = kv.reference_verify(**x)
    check(*kv.kda_verify_before(**x), ref_o, ref_s)
    check(*kv.kda_verify_before(**x, tile_v=8, num_warps=1), ref_o, ref_s)


@pytest.mark.parametrize("T, form", [(1, "step"), (1, "chunk"), (5, "chunk"), (8, "chunk"), (8, "step"),
                                     (1, "tile"), (5, "tile")])
def test_position_count_limits(T, form):
    # T = 5: the chunk form pads the positions to 8 (a power of two) and must not write the padding
    x = make(1, T, 1, V=16)
    ref_o, ref_s = kv.reference_verify(**x)
    check(*kv.kda_verify(**x, tile_v=8, form=form), ref_o, ref_s)


@pytest.mark.parametrize("fn", [kv.kda_verify, kv.kda_verify_before])
def test_final_state_only_is_the_last_position(fn):
    x = make(2, 4, 1, V=16)
    o_all, states = fn(**x, tile_v=8)
    o_fin, final = fn(**x, tile_v=8, final_state_only=True)
    assert final.shape == (2, 1, K, 16)
    assert torch.equal(o_all, o_fin)
    _, ref_s = kv.reference_verify(**x)
    bench.check(final, ref_s[:, -1], dtype=torch.float32, name="final")


@pytest.mark.parametrize("tile_v", [4, 32])
def test_ragged_cu_seqlens(tile_v):
    lens = [3, 1, 0, 4]
    cu = torch.tensor([0, 3, 4, 4, 8], dtype=torch.int32, device=DEV)
    x = make(1, sum(lens), 2, V=16 if tile_v < 16 else 32, N=len(lens))
    ref_o, ref_s = kv.reference_verify(**x, cu_seqlens=cu)
    for fn in (kv.kda_verify, kv.kda_verify_before):
        o, states = fn(**x, cu_seqlens=cu, tile_v=tile_v)
        check(o, states, ref_o, ref_s)
        o2, final = fn(**x, cu_seqlens=cu, tile_v=tile_v, final_state_only=True, max_seqlen=4)
        # each sequence ends at its last token; the empty one keeps its initial state
        expect = torch.stack([ref_s[0, 2], ref_s[0, 3], x["initial_state"][2].double(), ref_s[0, 7]])
        bench.check(final, expect, dtype=torch.float32, name="final per sequence")
        assert torch.equal(o2, o)


@pytest.mark.parametrize("fn", [kv.kda_verify, functools.partial(kv.kda_verify, form="step"),
                                functools.partial(kv.kda_verify, form="tile"), kv.kda_verify_before])
def test_ragged_lengths_leave_padding_untouched(fn):
    x = make(3, 4, 1, V=16)
    lengths = torch.tensor([4, 1, 2], device=DEV)
    ref_o, ref_s = kv.reference_verify(**x, lengths=lengths)
    buf = torch.full((3, 4, 1, K, 16), float("nan"), device=DEV)
    o, states = fn(**x, lengths=lengths, states_out=buf, tile_v=8)
    assert states.data_ptr() == buf.data_ptr()
    live = ~ref_s.isnan()
    assert torch.equal(states.isnan(), ~live), "positions past a length must not be written"
    bench.check(states[live], ref_s[live], dtype=torch.float32, name="live states")
    bench.check(o, ref_o, dtype=torch.float32, name="o (padding rows are 0)")


@pytest.mark.parametrize("tile_v", [4, 8])
def test_uniform_path_equals_ragged_path(tile_v):
    x = make(3, 4, 2, V=16)
    o_u, s_u = kv.kda_verify(**x, tile_v=tile_v)
    flat = {n: (t.reshape(1, 12, *t.shape[2:]) if n != "initial_state" else t) for n, t in x.items()}
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=DEV)
    o_r, s_r = kv.kda_verify(**flat, cu_seqlens=cu, max_seqlen=4, tile_v=tile_v)
    assert torch.equal(o_u, o_r.view_as(o_u))
    assert torch.equal(s_u, s_r.view_as(s_u))
    o_l, s_l = kv.kda_verify(**x, lengths=torch.tensor([4, 4, 4], device=DEV), tile_v=tile_v)
    assert torch.equal(o_u, o_l) and torch.equal(s_u, s_l)


def test_select_accepted_rolls_back():
    x = make(3, 4, 1, V=16)
    _, states = kv.kda_verify(**x, tile_v=8)
    kept = kv.select_accepted(states, torch.tensor([1, 4, 2], device=DEV))
    assert torch.equal(kept, torch.stack([states[0, 0], states[1, 3], states[2, 1]]))


def test_caller_buffer_is_written():
    x = make(1, 2, 1, V=16)
    buf = torch.zeros(1, 2, 1, K, 16, device=DEV)
    _, states = kv.kda_verify(**x, states_out=buf, tile_v=8)
    assert states is buf and buf.abs().sum() > 0


@pytest.mark.parametrize("change, word", [
    (lambda x: x.update(initial_state=x["initial_state"].double()), "initial_state"),
    (lambda x: x.update(initial_state=x["initial_state"].bfloat16()), "initial_state"),
    (lambda x: x.update(initial_state=x["initial_state"][:, :, :, :8]), "initial_state"),
    (lambda x: x.update(q=x["q"][..., :64], k=x["k"][..., :64], g=x["g"][..., :64]), "K"),
    (lambda x: x.update(k=x["k"][:, :1]), "k"),
    (lambda x: x.update(beta=x["beta"].unsqueeze(-1)), "beta"),
    (lambda x: x.update(v=x["v"][:, :, :1]), "v"),
])
def test_bad_input_names_the_argument(change, word):
    x = make(1, 2, 2, V=16)
    change(x)
    with pytest.raises(ValueError, match=word):
        kv.kda_verify(**x, tile_v=8)


@pytest.mark.parametrize("T", [0, 9])
def test_positions_outside_1_to_8(T):
    x = make(1, T, 1, V=16)
    with pytest.raises(ValueError, match="T"):
        kv.kda_verify(**x)
    with pytest.raises(ValueError, match="T"):
        kv.kda_verify_before(**x)


def test_bad_ragged_and_launch_arguments():
    x = make(2, 2, 1, V=16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kv.kda_verify(**x, cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32, device=DEV))  # needs B = 1
    with pytest.raises(ValueError, match="lengths"):
        kv.kda_verify(**x, lengths=torch.tensor([1, 3], device=DEV))
    with pytest.raises(ValueError, match="tile_v"):
        kv.kda_verify(**x, tile_v=6)
    with pytest.raises(ValueError, match="form"):
        kv.kda_verify(**x, tile_v=8, form="wy")
    with pytest.raises(ValueError, match="states_out"):
        kv.kda_verify(**x, states_out=torch.empty(2, 2, 1, K, 8, device=DEV))
    flat = make(1, 4, 1, V=16, N=2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kv.kda_verify(**flat, cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32, device=DEV))  # does not end at 4


def test_tile_rule_follows_units_and_backend():
    # 12 heads x 128 columns: one sequence on an H200 (132 SMs) -> 8 columns (32-byte rows);
    # on an MI355X (256 CUs) -> the seed's 4 columns; enough sequences -> wider tiles.
    assert kv.choose_tile_v(1, 12, compute_units=132, backend="cuda") == 8
    assert kv.choose_tile_v(8, 12, compute_units=132, backend="cuda") == 8
    assert kv.choose_tile_v(32, 12, compute_units=132, backend="cuda") == 16
    assert kv.choose_tile_v(1, 12, compute_units=256, backend="rocm") == 4
    assert kv.choose_tile_v(512, 12, compute_units=256, backend="rocm") == 32
    assert kv.workgroups(1, 12, 32) == 48 and kv.workgroups(1, 12, 4) == 384
    assert kv.choose_num_warps(4, wave_width=32) == 1 and kv.choose_num_warps(8, wave_width=64) == 1
    assert kv.choose_num_warps(32, wave_width=32) == 2
    assert kv.before_num_warps(32) == 4 and kv.before_num_warps(64) == 2
    # chunk form: waves grow with the positions (its [T, K, tile] products), as measured on the H200
    assert [kv.choose_num_warps(8, wave_width=32, form="chunk", positions=t) for t in (1, 2, 4, 8)] == [4, 2, 2, 4]


def test_every_form_agrees_on_a_ragged_batch():
    lens = [2, 4, 1]
    cu = torch.tensor([0, 2, 6, 7], dtype=torch.int32, device=DEV)
    x = make(1, sum(lens), 1, V=8, N=len(lens))
    ref_o, ref_s = kv.reference_verify(**x, cu_seqlens=cu)
    for form in kv.NARROW_FORMS:
        if form in kv.CUDA_FORMS:  # the CUDA kernel needs V = 128 on a GPU: its own tests below
            continue
        check(*kv.kda_verify(**x, cu_seqlens=cu, tile_v=8, form=form), ref_o, ref_s)


def test_study_names_each_form_of_the_narrow_kernel():
    from k3lab import bench
    from k3lab.studies import kda_verify as study

    assert study._parse("b1_t4.tile8_w1", 12)["variants"] == [
        ("after", dict(kind="after", tile_v=8, num_warps=1, form="tile"))]
    assert study._parse("b1_t4.narrow8_w2", 12)["variants"][0][1]["form"] == "step"
    with pytest.raises(ValueError, match="tile form"):
        study._parse("b1_t4.tile16_w1", 12)
    recs = [bench.Record(study=study.NAME, case=f"b1_t4.{tail}", variant="after", device="d", backend="cuda",
                         versions={}, commit="x", date="", shape={"B": 1, "T": 4, "H": 12}, dtype="bfloat16",
                         median_us=us, p20_us=us, p80_us=us, mode="graph", extra={"tile_v": 8, "num_warps": 1})
            for tail, us in (("narrow8_w1", 4.2), ("chunk8_w1", 6.0), ("tile8_w1", 3.5))]
    table = study.form_table(recs)
    assert dict(zip(table["form"], table["median_us"])) == {"step": 4.2, "chunk": 6.0, "tile": 3.5}


def _vk(x):
    """The same inputs with the initial state stored [V, K]."""
    return dict(x, initial_state=x["initial_state"].transpose(-1, -2).contiguous())


@pytest.mark.parametrize("form", ["step", "tile"])
@pytest.mark.parametrize("T, final_only", [(1, False), (4, False), (5, True), (8, False)])
def test_vk_state_layout_matches_the_reference(form, T, final_only):
    x = make(2, T, 2, V=16, seed=T)
    ref_o, ref_s = kv.reference_verify(**x)
    if final_only:
        ref_s = ref_s[:, -1]
    o, states = kv.kda_verify(**_vk(x), tile_v=8, form=form, state_layout="vk", final_state_only=final_only)
    assert states.shape[-2:] == (16, K)
    check(o, states.transpose(-1, -2), ref_o, ref_s)


def test_vk_state_layout_on_ragged_batches():
    lens = [2, 4, 1]
    cu = torch.tensor([0, 2, 6, 7], dtype=torch.int32, device=DEV)
    x = make(1, sum(lens), 1, V=8, N=len(lens))
    ref_o, ref_s = kv.reference_verify(**x, cu_seqlens=cu)
    o, states = kv.kda_verify(**_vk(x), cu_seqlens=cu, tile_v=8, state_layout="vk")
    check(o, states.transpose(-1, -2), ref_o, ref_s)
    y = make(3, 4, 1, V=16, seed=9)
    lengths = torch.tensor([4, 1, 2], device=DEV)
    ref_o, ref_s = kv.reference_verify(**y, lengths=lengths)
    o, states = kv.kda_verify(**_vk(y), lengths=lengths, tile_v=8, state_layout="vk")
    for b, n in enumerate(lengths.tolist()):  # the live positions; padded ones are not written
        check(o[b, :n], states[b, :n].transpose(-1, -2), ref_o[b, :n], ref_s[b, :n])


@pytest.mark.parametrize("kw,match", [(dict(state_layout="kvk"), "state_layout"),
                                      (dict(state_layout="vk", form="chunk", tile_v=8), "step and tile"),
                                      (dict(state_layout="vk", tile_v=32), "step and tile")])
def test_vk_state_layout_bad_requests_are_refused(kw, match):
    x = make(1, 2, 1, V=32)
    with pytest.raises(ValueError, match=match):
        kv.kda_verify(**_vk(x), **kw)
    with pytest.raises(ValueError, match="state_layout 'vk'"):  # a [K, V] state given as 'vk'
        kv.kda_verify(**make(1, 2, 1, V=16), tile_v=8, state_layout="vk")


def test_study_checks_and_times_the_tile_and_vk_sweep_points(monkeypatch):
    """The GPU sweep points run on CPU too once named: each is checked against fp64 (the vk one on its
    state stored [V, K]) before it is timed, and says its layout."""
    from k3lab.studies import kda_verify as study

    extra = ["b1_t4.vk8_w1", "b1_t4.tile8_w1"]
    names = study.case_names()
    monkeypatch.setattr(study, "case_names", lambda preset=None: names + extra)
    recs = {r.case: r for r in study.run(cases=extra)}
    assert recs["b1_t4.vk8_w1"].extra["state_layout"] == "vk" and recs["b1_t4.tile8_w1"].extra["form"] == "tile"
    for r in recs.values():
        assert r.error["states"]["max_rel"] < 1e-5 and r.median_us > 0


# ----------------------------------------------------------------------------------------------
# the hand-written CUDA kernel (kernels/kda_verify.cu, forms 'cuda' and 'cuda_chunk')

def _cuda_ready():
    from k3lab.ops import kda_verify_cuda as kc

    return kc.available()


needs_cuda_kernel = pytest.mark.skipif(not torch.cuda.is_available() or not _cuda_ready(),
                                       reason="needs a CUDA GPU and kernels/kda_verify.cu built (nvcc)")


def test_cuda_forms_are_refused_by_name_where_they_cannot_run():
    x = make(1, 2, 1, V=16)  # CPU tensors (and V = 16): never the CUDA kernel
    for form in kv.CUDA_FORMS:
        with pytest.raises(ValueError, match=form):
            kv.kda_verify(**x, tile_v=8, form=form)
    with pytest.raises(ValueError, match="state_layout"):
        kv.kda_verify(**_vk(x), tile_v=8, form="cuda", state_layout="vk")
    assert kv.choose_form(*(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")), 8, 2) == kv.NARROW_FORM


def test_default_form_and_its_environment_override(monkeypatch):
    monkeypatch.delenv(kv.FORM_ENV, raising=False)
    assert kv.default_form(8, backend="cpu") == kv.NARROW_FORM
    monkeypatch.setenv(kv.FORM_ENV, "tile")
    assert kv.default_form(8, backend="cpu") == "tile"
    monkeypatch.setenv(kv.FORM_ENV, "cuda")  # named, but the .cu runs only on CUDA devices
    assert kv.default_form(8, backend="cpu") == kv.NARROW_FORM
    assert kv.default_form(8, backend="rocm") == kv.NARROW_FORM
    monkeypatch.setenv(kv.FORM_ENV, "fast")
    with pytest.raises(ValueError, match=kv.FORM_ENV):
        kv.default_form(8, backend="cpu")


def test_pdl_switch_reads_the_environment(monkeypatch):
    from k3lab.ops import kda_verify_cuda as kc

    monkeypatch.delenv(kc.PDL_ENV, raising=False)
    assert kc.pdl_default() == (kc.PDL_DEFAULT and kc.pdl_supported())
    if not torch.cuda.is_available():
        assert not kc.pdl_supported() and not kc.pdl_default()  # no griddepcontrol without a CUDA GPU
    monkeypatch.setenv(kc.PDL_ENV, "0")
    assert kc.pdl_default() is False
    monkeypatch.setenv(kc.PDL_ENV, "1")
    assert kc.pdl_default() is True
    monkeypatch.setenv(kc.PDL_ENV, "yes")
    with pytest.raises(ValueError, match=kc.PDL_ENV):
        kc.pdl_default()


def test_cuda_warps_rule(monkeypatch):
    monkeypatch.delenv(kv.WARPS_ENV, raising=False)
    assert [kv.cuda_warps("cuda", t) for t in (1, 4, 8)] == [4, 4, 4]
    assert [kv.cuda_warps("cuda_chunk", t) for t in (1, 4, 5, 8)] == [8, 8, 8, 8]
    assert [kv.cuda_warps("cuda_warp", t) for t in (1, 4, 8)] == [kv.CUDA_WARP_WARPS] * 3
    assert kv.choose_num_warps(8, form="cuda_chunk", positions=8) == 8
    monkeypatch.setenv(kv.WARPS_ENV, "2")
    assert kv.cuda_warps("cuda_warp") == 2
    monkeypatch.setenv(kv.WARPS_ENV, "3")
    with pytest.raises(ValueError, match=kv.WARPS_ENV):
        kv.cuda_warps("cuda_warp")


@pytest.mark.skipif(__import__("k3lab.ops._build", fromlist=["x"]).find_toolchain("nvcc") is None,
                    reason="nvcc not installed")
def test_cuda_library_layout_and_configs():
    """Compile kernels/kda_verify.cu for sm_90a (no GPU needed), load it, and check that the Python Args
    matches the C struct and that every config the launch rules can ask for is compiled."""
    import ctypes

    from k3lab.ops import _build
    from k3lab.ops import kda_verify_cuda as kc

    lib = kc.bind(ctypes.CDLL(str(_build.compile_kernel("kda_verify", kind="nvcc", target="sm_90a"))))
    have = kc.configs_of(lib)
    for form in kv.CUDA_FORMS:
        for t in range(1, kv.MAX_POSITIONS + 1):
            assert (8, kv.cuda_warps(form, t), form) in have
    assert (4, 2, "cuda") in have  # the MI355X-style 4-column tile (4 x 4 spilled at T = 4)
    # the launch rules assume no register spills in the warp form (255 registers at most, one warp)
    log = _build.compile_kernel("kda_verify", kind="nvcc", target="sm_90a").with_suffix(".so.log").read_text()
    entries = log.split("Compiling entry function")[1:]
    warp = [e for e in entries if "kda_verify_warp_kernel" in e.split("\n")[0]]
    assert len(warp) == 2 * 4 * kv.MAX_POSITIONS, "one warp kernel per (warps 1 / 4, T, q/k/v dtype, g dtype)"
    assert all("0 bytes spill stores" in e.split("Compiling entry function")[0] for e in warp)


def test_study_names_the_cuda_sweep_points():
    from k3lab.studies import kda_verify as study

    assert study._parse("b1_t4.cuda8_w4", 12)["variants"] == [
        ("after", dict(kind="after", tile_v=8, num_warps=4, form="cuda", pdl=False))]
    assert study._parse("b1_t8.cudachunk8_w8", 12)["variants"][0][1]["form"] == "cuda_chunk"
    assert study.kernel_name("after", 8, "cuda_chunk") == "cuda_chunk"
    with pytest.raises(ValueError, match="cuda form"):
        study._parse("b1_t4.cuda16_w4", 12)
    assert all(study._is_sweep(c, ("cuda", "cudachunk", "cudawarp")) for c in study.CUDA_SWEEP)
    warp = study._parse("b1_t4.cudawarp8_w1_pdl", 12)["variants"][0][1]
    assert (warp["form"], warp["num_warps"], warp["pdl"]) == ("cuda_warp", 1, True)
    assert study._parse("b1_t4.cudawarp8_w1", 12)["variants"][0][1]["pdl"] is False  # plain, whatever the default
    assert study._pdl_used(warp) and not study._pdl_used(dict(warp, form="step"))
    assert study._parse("b1_t4.cudawarp8_w4", 12)["variants"][0][1]["num_warps"] == 4
    assert study._parse("b1_t4.cuda8_w4_pdl", 12)["variants"][0][1]["pdl"]
    with pytest.raises(ValueError, match="_pdl"):
        study._parse("b1_t4.narrow8_w1_pdl", 12)


def _gpu_inputs(B, T, H, dtype, seed=0, N=None):
    x = make(B, T, H, V=K, seed=seed, N=N)
    out = {n: t.cuda() for n, t in x.items()}
    for n in ("q", "k", "v", "beta"):
        out[n] = out[n].to(dtype)
    return out


def _check_gpu(o, states, ref_o, ref_s):
    bench.check_all({"o": (o, ref_o), "states": (states, ref_s)}, dtype={"o": o.dtype, "states": torch.float32})
    for t in range(states.shape[1]):  # each saved state on its own
        bench.check(states[:, t], ref_s[:, t], dtype=torch.float32, name=f"state[{t}]")


@needs_cuda_kernel
@pytest.mark.parametrize("form, tile_v, warps", [("cuda", 8, 4), ("cuda", 8, 8), ("cuda", 4, 2), ("cuda_chunk", 8, 8),
                                                 ("cuda_warp", 8, 1), ("cuda_warp", 8, 4)])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8])
def test_cuda_kernel_every_position_matches_reference(form, tile_v, warps, T):
    if form == "cuda_chunk" and warps == 4 and T > 4:
        warps = 8  # the launch rule (cuda_warps): 4 groups would spill at T > 4
    x = _gpu_inputs(2, T, 3, torch.bfloat16, seed=T)
    ref_o, ref_s = kv.reference_verify(**x)
    o, states = kv.kda_verify(**x, tile_v=tile_v, num_warps=warps, form=form)
    assert o.dtype == torch.bfloat16 and states.shape == (2, T, 3, K, K)
    _check_gpu(o, states, ref_o, ref_s)
    o2, final = kv.kda_verify(**x, tile_v=tile_v, num_warps=warps, form=form, final_state_only=True)
    assert torch.equal(o2, o)
    bench.check(final, ref_s[:, -1], dtype=torch.float32, name="final")


@needs_cuda_kernel
@pytest.mark.parametrize("form", kv.CUDA_FORMS)
def test_cuda_kernel_fp32_inputs_and_bf16_gates(form):
    x = _gpu_inputs(1, 4, 2, torch.float32, seed=3)
    ref_o, ref_s = kv.reference_verify(**x)
    _check_gpu(*kv.kda_verify(**x, form=form), ref_o, ref_s)
    y = dict(x, g=x["g"].bfloat16(), beta=x["beta"].bfloat16())  # bf16 gates: read as their bf16 values
    ref_o, ref_s = kv.reference_verify(**y)
    _check_gpu(*kv.kda_verify(**y, form=form), ref_o, ref_s)


@needs_cuda_kernel
@pytest.mark.parametrize("form", kv.CUDA_FORMS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cuda_kernel_ragged_batches(form, index_dtype):
    lens = [3, 1, 0, 4]
    cu = torch.tensor([0, 3, 4, 4, 8], dtype=index_dtype, device="cuda")
    x = _gpu_inputs(1, sum(lens), 2, torch.bfloat16, seed=5, N=len(lens))
    ref_o, ref_s = kv.reference_verify(**x, cu_seqlens=cu)
    o, states = kv.kda_verify(**x, cu_seqlens=cu, form=form)
    bench.check_all({"o": (o, ref_o), "states": (states, ref_s)},
                    dtype={"o": torch.bfloat16, "states": torch.float32})
    o2, final = kv.kda_verify(**x, cu_seqlens=cu, max_seqlen=4, form=form, final_state_only=True)
    expect = torch.stack([ref_s[0, 2], ref_s[0, 3], x["initial_state"][2].double(), ref_s[0, 7]])
    bench.check(final, expect, dtype=torch.float32, name="final per sequence (the empty one keeps h0)")
    assert torch.equal(o2, o)
    # padded layout with lengths: positions past a length are not written, their o rows are zeros
    y = _gpu_inputs(3, 4, 1, torch.bfloat16, seed=6)
    lengths = torch.tensor([4, 1, 2], dtype=index_dtype, device="cuda")
    ref_o, ref_s = kv.reference_verify(**y, lengths=lengths)
    buf = torch.full((3, 4, 1, K, K), float("nan"), device="cuda")
    o, states = kv.kda_verify(**y, lengths=lengths, states_out=buf, form=form)
    live = ~ref_s.isnan()
    assert torch.equal(states.isnan(), ~live), "positions past a length must not be written"
    bench.check(states[live], ref_s[live], dtype=torch.float32, name="live states")
    bench.check(o, ref_o, dtype=torch.bfloat16, name="o (padding rows are 0)")


@needs_cuda_kernel
@pytest.mark.parametrize("form", kv.CUDA_FORMS)
def test_cuda_kernel_uniform_equals_ragged_and_odd_beta(form):
    x = _gpu_inputs(3, 4, 1, torch.bfloat16, seed=7)  # 12 beta values; then one (an odd count)
    o_u, s_u = kv.kda_verify(**x, form=form)
    flat = {n: (t.reshape(1, 12, *t.shape[2:]) if n != "initial_state" else t) for n, t in x.items()}
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device="cuda")
    o_r, s_r = kv.kda_verify(**flat, cu_seqlens=cu, max_seqlen=4, form=form)
    assert torch.equal(o_u, o_r.view_as(o_u)) and torch.equal(s_u, s_r.view_as(s_u))
    one = _gpu_inputs(1, 1, 1, torch.bfloat16, seed=8)  # beta has one element: the half-word copy
    ref_o, ref_s = kv.reference_verify(**one)
    _check_gpu(*kv.kda_verify(**one, form=form), ref_o, ref_s)


@needs_cuda_kernel
def test_cuda_kernel_as_the_default_replays_in_a_graph(monkeypatch):
    monkeypatch.setenv(kv.FORM_ENV, "cuda")
    x = _gpu_inputs(1, 4, 12, torch.bfloat16, seed=9)
    assert kv.choose_form(*(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")), 8, 4) == "cuda"
    buf = torch.empty(1, 4, 12, K, K, device="cuda")
    o_eager, _ = kv.kda_verify(**x, tile_v=8, states_out=buf)
    s_eager = buf.clone()
    static = {n: t.clone() for n, t in x.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kv.kda_verify(**static, tile_v=8, states_out=buf)  # warm up (build, load) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, _ = kv.kda_verify(**static, tile_v=8, states_out=buf)
    y = _gpu_inputs(1, 4, 12, torch.bfloat16, seed=10)
    for n, t in y.items():
        static[n].copy_(t)
    graph.replay()
    ref_o, ref_s = kv.reference_verify(**y)
    _check_gpu(o_graph, buf, ref_o, ref_s)
    for n, t in x.items():
        static[n].copy_(t)
    graph.replay()
    assert torch.equal(o_graph, o_eager) and torch.equal(buf, s_eager)


@needs_cuda_kernel
def test_cuda_kernel_misaligned_input_falls_back_or_is_refused(monkeypatch):
    monkeypatch.setenv(kv.FORM_ENV, "cuda")
    x = _gpu_inputs(1, 2, 1, torch.bfloat16, seed=11)
    store = torch.empty(x["q"].numel() + 1, dtype=torch.bfloat16, device="cuda")
    q = store[1:].view_as(x["q"])  # 2-byte offset: not 16-byte aligned
    q.copy_(x["q"])
    y = dict(x, q=q)
    assert kv.choose_form(*(y[n] for n in ("q", "k", "v", "g", "beta", "initial_state")), 8, 2) == kv.NARROW_FORM
    with pytest.raises(ValueError, match="aligned"):
        kv.kda_verify(**y, tile_v=8, form="cuda")
    ref_o, ref_s = kv.reference_verify(**x)
    _check_gpu(*kv.kda_verify(**y, tile_v=8), ref_o, ref_s)  # the default falls back to the Triton step form
    monkeypatch.setenv(kv.FORM_ENV, "step")
    assert kv.choose_form(*(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")), 8, 2) == "step"


@needs_cuda_kernel
@pytest.mark.parametrize("form, warps", [("cuda", 4), ("cuda_warp", 1), ("cuda_warp", 4)])
def test_cuda_kernel_as_a_programmatic_dependent_launch(form, warps):
    """pdl=True changes only how the launch waits for the previous kernel: the same bits, eager and
    replayed in a graph right after kernels that write its inputs."""
    x = _gpu_inputs(1, 4, 12, torch.bfloat16, seed=12)
    kw = dict(form=form, num_warps=warps, tile_v=8)
    ref_o, ref_s = kv.reference_verify(**x)
    o_plain, s_plain = kv.kda_verify(**x, **kw, pdl=False)
    _check_gpu(o_plain, s_plain, ref_o, ref_s)
    o_pdl, s_pdl = kv.kda_verify(**x, **kw, pdl=True)
    assert torch.equal(o_pdl, o_plain) and torch.equal(s_pdl, s_plain)
    static = {n: t.clone() for n, t in x.items()}
    fresh = _gpu_inputs(1, 4, 12, torch.bfloat16, seed=13)
    buf = torch.empty_like(s_plain)
    kv.kda_verify(**static, **kw, pdl=True, states_out=buf)  # loaded outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for n in ("v", "initial_state"):  # the kernels before it write what it reads
            torch.mul(fresh[n], 1, out=static[n])
        o_graph, _ = kv.kda_verify(**static, **kw, pdl=True, states_out=buf)
    graph.replay()
    ref_o, ref_s = kv.reference_verify(**dict(x, v=fresh["v"], initial_state=fresh["initial_state"]))
    _check_gpu(o_graph, buf, ref_o, ref_s)


@needs_cuda_kernel
def test_cuda_warp_form_refuses_or_falls_back_on_a_misaligned_states_buffer(monkeypatch):
    monkeypatch.setenv(kv.FORM_ENV, "cuda_warp")
    x = _gpu_inputs(1, 2, 1, torch.bfloat16, seed=14)
    store = torch.empty(2 * K * K + 1, device="cuda")
    buf = store[1:].view(1, 2, 1, K, K)  # 4-byte offset: the warp form stores 16 bytes at a time
    with pytest.raises(ValueError, match="states is not 16-byte aligned"):
        kv.kda_verify(**x, form="cuda_warp", states_out=buf)
    ref_o, ref_s = kv.reference_verify(**x)
    _check_gpu(*kv.kda_verify(**x, tile_v=8, states_out=buf), ref_o, ref_s)  # the default: the Triton step form


@needs_cuda_kernel
def test_cuda_warp_form_is_the_default_where_it_builds(monkeypatch):
    for name in (kv.FORM_ENV, kv.WARPS_ENV):
        monkeypatch.delenv(name, raising=False)
    x = _gpu_inputs(1, 4, 12, torch.bfloat16, seed=15)
    assert kv.default_form(8) == kv.CUDA_FORM == "cuda_warp"
    assert kv.choose_form(*(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")), 8, 4) == "cuda_warp"
    assert kv.cuda_warps("cuda_warp") == kv.CUDA_WARP_WARPS
    ref_o, ref_s = kv.reference_verify(**x)
    _check_gpu(*kv.kda_verify(**x), ref_o, ref_s)
