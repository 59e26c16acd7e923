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


@pytest.mark.parametrize("tile_v", [4, 8, 32])
def test_every_position_matches_reference(tile_v):
    x = make(2, 3, 2)
    ref_o, ref_s = kv.reference_verify(**x)
    o, states = kv.kda_verify(**x, tile_v=tile_v)
    assert states.shape == (2, 3, 2, K, 32)
    check(o, states, ref_o, ref_s)
    for t in range(3):  # each saved state on its own, so a wrong early position cannot hide
        bench.check(states[:, t], ref_s[:, t], dtype=torch.float32, name=f"state[{t}]")


def test_before_kernel_matches_reference():
    x = make(2, 3, 2)
    ref_o, ref_s = kv.reference_verify(**x)
    check(*kv.kda_verify_before(**x), ref_o, ref_s)
    check(*kv.kda_verify_before(**x, tile_v=8, num_warps=1), ref_o, ref_s)


@pytest.mark.parametrize("T", [1, 5, 8])
def test_position_count_limits(T):
    x = make(1, T, 1, V=16)
    ref_o, ref_s = kv.reference_verify(**x)
    check(*kv.kda_verify(**x, tile_v=8), ref_o, ref_s)


@pytest.mark.parametrize("fn", [kv.kda_verify, kv.kda_verify_before])
def test_final_state_only_is_the_last_position(fn):
    x = make(2, 4, 1, V=16)
    o_all, states = fn(**x, tile_v=8)
    o_fin, final = fn(**x, tile_v=8, final_state_only=True)
    assert final.shape == (2, 1, K, 16)
    assert torch.equal(o_all, o_fin)
    _, ref_s = kv.reference_verify(**x)
    bench.check(final, ref_s[:, -1], dtype=torch.float32, name="final")


@pytest.mark.parametrize("tile_v", [4, 8, 32])
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


@pytest.mark.parametrize("fn", [kv.kda_verify, functools.partial(kv.kda_verify, backend="triton"),
                                functools.partial(kv.kda_verify, backend="torch"), kv.kda_verify_before])
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


@pytest.mark.parametrize("layout", ["dense", "cu_seqlens", "lengths"])
@pytest.mark.parametrize("final", [False, True])
def test_torch_row_computes_what_the_triton_row_computes(layout, final, monkeypatch):
    """backend='torch' (and the variable) select the reference row, before and after alike; on fresh
    random fp32 inputs it writes the outputs and states the Triton row writes (interpreter on CPU), in
    every layout, a state per position or the final one, a wide tile included."""
    monkeypatch.delenv(kv.BACKEND_ENV, raising=False)
    row = kv.BACKENDS["torch"]
    assert row.after is row.before and row.available()[0]
    if layout == "cu_seqlens":
        x = make(1, 8, 2, V=32, seed=5, N=4)
        extra = {"cu_seqlens": torch.tensor([0, 3, 4, 4, 8], dtype=torch.int32, device=DEV), "max_seqlen": 4}
    else:
        x = make(3, 4, 2, V=32, seed=5)
        extra = {"lengths": torch.tensor([4, 0, 2], device=DEV)} if layout == "lengths" else {}
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    assert kv.BACKENDS.choose("torch", *args, 8)[0] == "torch"
    for tile in (8, 16):
        shape = (*x["initial_state"].shape,) if final else (*x["v"].shape[:3], K, 32)
        o_t, s_t = kv.kda_verify(**x, **extra, tile_v=tile, final_state_only=final,
                                 states_out=torch.full(shape, 7.0, device=DEV), backend="triton")
        o_r, s_r = kv.kda_verify(**x, **extra, tile_v=tile, final_state_only=final,
                                 states_out=torch.full(shape, 7.0, device=DEV), backend="torch")
        assert s_r.shape == s_t.shape and torch.equal(s_r == 7.0, s_t == 7.0), "same positions written"
        bench.check_all({"o": (o_r, o_t), "states": (s_r, s_t)}, dtype=torch.float32)
    monkeypatch.setenv(kv.BACKEND_ENV, "torch")
    o_e, _ = kv.kda_verify(**x, **extra, tile_v=8, final_state_only=final)
    assert torch.equal(o_e, o_r)  # the variable forces the same row: bit-identical to backend='torch'


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
    with pytest.raises(ValueError, match="backend"):
        kv.kda_verify(**x, tile_v=8, backend="wy")
    with pytest.raises(ValueError, match="states_out"):
        kv.kda_verify(**x, states_out=torch.empty(2, 2, 1, K, 8, device=DEV))
    flat = make(1, 4, 1, V=16, N=2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        # does not end at 4
        kv.kda_verify(**flat, cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32, device=DEV))


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


def test_backend_table_and_its_environment_override(monkeypatch):
    monkeypatch.delenv(kv.BACKEND_ENV, raising=False)
    assert [b.name for b in kv.BACKENDS] == ["cuda", "triton", "torch"]
    status = kv.BACKENDS.status()
    assert status["triton"][0] and isinstance(status["cuda"][1], str)
    x = make(1, 2, 1, V=16)  # V = 16 (and CPU tensors here): never the CUDA kernel
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    assert kv.BACKENDS.choose(None, *args, 8)[0] == "triton"
    with pytest.raises(ValueError, match="'cuda' cannot run here"):
        kv.kda_verify(**x, tile_v=8, backend="cuda")
    monkeypatch.setenv(kv.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="'cuda' cannot run here"):
        kv.kda_verify(**x, tile_v=8)
    monkeypatch.setenv(kv.BACKEND_ENV, "triton")
    ref_o, ref_s = kv.reference_verify(**x)
    check(*kv.kda_verify(**x, tile_v=8), ref_o, ref_s)
    monkeypatch.setenv(kv.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=kv.BACKEND_ENV):
        kv.kda_verify(**x, tile_v=8)


def test_study_parses_its_cases():
    from k3lab.studies import kda_verify as study

    assert study.measure._parse("b1_t4.narrow8_w2", 12)["variants"] == [
        ("after", dict(kind="after", tile_v=8, num_warps=2, backend="triton"))]
    assert study.measure._parse("b1_t4.stream16_w4", 12)["variants"][0][1]["kind"] == "before"
    warp = study.measure._parse("b1_t4.cudawarp8_w4", 12)["variants"][0][1]
    assert (warp["backend"], warp["pdl"]) == ("cuda", False)  # the ablation's plain launch
    assert (
        study.kernel_name("after", 8, "cuda") == "cuda_warp"
        and study.kernel_name("after", 8, "triton") == "narrow"
    )
    assert study.kernel_name("after", 16, None) == "stream" and study.kernel_name("fla", 32) == "fla"
    for bad in ("b1_t4.chunk8_w2", "b1_t4.cudawarp8_w1", "b1_t4.narrow16_w1", "b1_t4.tile8_w1"):
        with pytest.raises(ValueError, match="case"):
            study.measure._parse(bad, 12)


# ----------------------------------------------------------------------------------------------
# the CUDA backend (kernels/kda_verify.cu)

def _cuda_ready():
    from k3lab.ops.kda_verify import cuda

    return cuda.available()[0]


needs_cuda_kernel = pytest.mark.skipif(not torch.cuda.is_available() or not _cuda_ready(),
                                       reason="needs a CUDA GPU and kernels/kda_verify.cu built (nvcc)")


def test_pdl_switch_reads_the_environment(monkeypatch):
    from k3lab.ops.kda_verify import cuda

    monkeypatch.delenv(cuda.PDL_ENV, raising=False)
    assert cuda.pdl_default() == cuda.pdl_supported()
    if not torch.cuda.is_available():
        assert not cuda.pdl_supported() and not cuda.pdl_default()  # no griddepcontrol without a CUDA GPU
    monkeypatch.setenv(cuda.PDL_ENV, "0")
    assert cuda.pdl_default() is False
    monkeypatch.setenv(cuda.PDL_ENV, "1")
    assert cuda.pdl_default() is True
    monkeypatch.setenv(cuda.PDL_ENV, "yes")
    with pytest.raises(ValueError, match=cuda.PDL_ENV):
        cuda.pdl_default()


@pytest.mark.skipif(__import__("k3lab.ops._build", fromlist=["x"]).find_toolchain("nvcc") is None,
                    reason="nvcc not installed")
def test_cuda_library_layout_and_registers():
    """Compile kernels/kda_verify.cu for sm_90a (no GPU needed), load it, check that the Python Args
    matches the C struct, and that no instantiation spills registers."""
    import ctypes

    from k3lab.ops import _build
    from k3lab.ops.kda_verify import cuda

    path = _build.compile_kernel("kda_verify", kind="nvcc", target="sm_90a")
    cuda.bind(ctypes.CDLL(str(path)))
    entries = path.with_suffix(".so.log").read_text().split("Compiling entry function")[1:]
    warp = [e for e in entries if "kda_verify_warp_kernel" in e.split("\n")[0]]
    assert len(warp) == 4 * kv.MAX_POSITIONS, "one kernel per (T, q/k/v dtype, g dtype)"
    assert all("0 bytes spill stores" in e for e in warp)


def _gpu_inputs(B, T, H, dtype, seed=0, N=None):
    x = make(B, T, H, V=K, seed=seed, N=N)
    out = {n: t.cuda() for n, t in x.items()}
    for n in ("q", "k", "v", "beta"):
        out[n] = out[n].to(dtype)
    return out


def _check_gpu(o, states, ref_o, ref_s):
    bench.check_all({"o": (o, ref_o), "states": (states, ref_s)},
                    dtype={"o": o.dtype, "states": torch.float32})
    for t in range(states.shape[1]):  # each saved state on its own
        bench.check(states[:, t], ref_s[:, t], dtype=torch.float32, name=f"state[{t}]")


@needs_cuda_kernel
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8])
def test_cuda_kernel_every_position_matches_reference(T):
    x = _gpu_inputs(2, T, 3, torch.bfloat16, seed=T)
    ref_o, ref_s = kv.reference_verify(**x)
    o, states = kv.kda_verify(**x, tile_v=8, backend="cuda")
    assert o.dtype == torch.bfloat16 and states.shape == (2, T, 3, K, K)
    _check_gpu(o, states, ref_o, ref_s)
    o2, final = kv.kda_verify(**x, tile_v=8, backend="cuda", final_state_only=True)
    assert torch.equal(o2, o)
    bench.check(final, ref_s[:, -1], dtype=torch.float32, name="final")


@needs_cuda_kernel
def test_cuda_kernel_fp32_inputs_and_bf16_gates():
    x = _gpu_inputs(1, 4, 2, torch.float32, seed=3)
    ref_o, ref_s = kv.reference_verify(**x)
    _check_gpu(*kv.kda_verify(**x, tile_v=8, backend="cuda"), ref_o, ref_s)
    y = dict(x, g=x["g"].bfloat16(), beta=x["beta"].bfloat16())  # bf16 gates: read as their bf16 values
    ref_o, ref_s = kv.reference_verify(**y)
    _check_gpu(*kv.kda_verify(**y, tile_v=8, backend="cuda"), ref_o, ref_s)


@needs_cuda_kernel
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cuda_kernel_ragged_batches(index_dtype):
    lens = [3, 1, 0, 4]
    cu = torch.tensor([0, 3, 4, 4, 8], dtype=index_dtype, device="cuda")
    x = _gpu_inputs(1, sum(lens), 2, torch.bfloat16, seed=5, N=len(lens))
    ref_o, ref_s = kv.reference_verify(**x, cu_seqlens=cu)
    o, states = kv.kda_verify(**x, cu_seqlens=cu, tile_v=8, backend="cuda")
    bench.check_all({"o": (o, ref_o), "states": (states, ref_s)},
                    dtype={"o": torch.bfloat16, "states": torch.float32})
    o2, final = kv.kda_verify(**x, cu_seqlens=cu, max_seqlen=4, tile_v=8, backend="cuda",
                              final_state_only=True)
    expect = torch.stack([ref_s[0, 2], ref_s[0, 3], x["initial_state"][2].double(), ref_s[0, 7]])
    bench.check(final, expect, dtype=torch.float32, name="final per sequence (the empty one keeps h0)")
    assert torch.equal(o2, o)
    # padded layout with lengths: positions past a length are not written, their o rows are zeros
    y = _gpu_inputs(3, 4, 1, torch.bfloat16, seed=6)
    lengths = torch.tensor([4, 1, 2], dtype=index_dtype, device="cuda")
    ref_o, ref_s = kv.reference_verify(**y, lengths=lengths)
    buf = torch.full((3, 4, 1, K, K), float("nan"), device="cuda")
    o, states = kv.kda_verify(**y, lengths=lengths, states_out=buf, tile_v=8, backend="cuda")
    live = ~ref_s.isnan()
    assert torch.equal(states.isnan(), ~live), "positions past a length must not be written"
    bench.check(states[live], ref_s[live], dtype=torch.float32, name="live states")
    bench.check(o, ref_o, dtype=torch.bfloat16, name="o (padding rows are 0)")


@needs_cuda_kernel
def test_cuda_kernel_uniform_equals_ragged_and_one_beta():
    x = _gpu_inputs(3, 4, 1, torch.bfloat16, seed=7)
    o_u, s_u = kv.kda_verify(**x, tile_v=8, backend="cuda")
    flat = {n: (t.reshape(1, 12, *t.shape[2:]) if n != "initial_state" else t) for n, t in x.items()}
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device="cuda")
    o_r, s_r = kv.kda_verify(**flat, cu_seqlens=cu, max_seqlen=4, tile_v=8, backend="cuda")
    assert torch.equal(o_u, o_r.view_as(o_u)) and torch.equal(s_u, s_r.view_as(s_u))
    one = _gpu_inputs(1, 1, 1, torch.bfloat16, seed=8)  # beta has one element
    ref_o, ref_s = kv.reference_verify(**one)
    _check_gpu(*kv.kda_verify(**one, tile_v=8, backend="cuda"), ref_o, ref_s)


@needs_cuda_kernel
def test_cuda_kernel_is_the_default_and_replays_in_a_graph(monkeypatch):
    monkeypatch.delenv(kv.BACKEND_ENV, raising=False)
    x = _gpu_inputs(1, 4, 12, torch.bfloat16, seed=9)
    assert kv.BACKENDS.choose(None, *(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")),
                              8)[0] == "cuda"
    buf = torch.empty(1, 4, 12, K, K, device="cuda")
    o_eager, _ = kv.kda_verify(**x, states_out=buf)
    s_eager = buf.clone()
    static = {n: t.clone() for n, t in x.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kv.kda_verify(**static, states_out=buf)  # warm up (build, load) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, _ = kv.kda_verify(**static, states_out=buf)
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
def test_cuda_kernel_misaligned_buffers_fall_back_or_are_refused(monkeypatch):
    monkeypatch.delenv(kv.BACKEND_ENV, raising=False)
    x = _gpu_inputs(1, 2, 1, torch.bfloat16, seed=11)
    store = torch.empty(x["q"].numel() + 1, dtype=torch.bfloat16, device="cuda")
    q = store[1:].view_as(x["q"])  # 2-byte offset: not 16-byte aligned
    q.copy_(x["q"])
    y = dict(x, q=q)
    assert kv.BACKENDS.choose(None, *(y[n] for n in ("q", "k", "v", "g", "beta", "initial_state")),
                              8)[0] == "triton"
    with pytest.raises(ValueError, match="aligned"):
        kv.kda_verify(**y, tile_v=8, backend="cuda")
    ref_o, ref_s = kv.reference_verify(**x)
    _check_gpu(*kv.kda_verify(**y, tile_v=8), ref_o, ref_s)  # the default falls back to the Triton kernel
    states = torch.empty(2 * K * K + 1, device="cuda")[1:].view(1, 2, 1, K, K)  # 4-byte offset
    with pytest.raises(ValueError, match="states is not 16-byte aligned"):
        kv.kda_verify(**x, tile_v=8, backend="cuda", states_out=states)
    _check_gpu(*kv.kda_verify(**x, tile_v=8, states_out=states), ref_o, ref_s)


@needs_cuda_kernel
def test_cuda_kernel_as_a_programmatic_dependent_launch():
    """pdl=True changes only how the launch waits for the previous kernel: the same bits, eager and
    replayed in a graph right after kernels that write its inputs."""
    x = _gpu_inputs(1, 4, 12, torch.bfloat16, seed=12)
    kw = dict(backend="cuda", tile_v=8)
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
    with pytest.raises(ValueError, match="num_warps"):
        kv.kda_verify(**x, **kw, num_warps=1)


@pytest.mark.follows_gpu  # the study puts its tensors on the GPU where there is one
def test_study_run_checks_and_records_what_ran():
    from k3lab.studies import kda_verify as study

    recs = study.run(cases=["b1_t4", "b1_t4.ragged"])
    after = {r.case: r for r in recs if r.variant == "after"}
    assert set(after) == {"b1_t4", "b1_t4.ragged"} and {r.variant for r in recs} >= {"before", "after"}
    for r in after.values():
        assert r.extra["kernel"] in ("narrow", "cuda_warp", "stream") and r.error["states"]["max_rel"] < 2e-4
    assert after["b1_t4.ragged"].extra["path"] == "ragged"
