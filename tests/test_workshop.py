"""k3lab.workshop: every solution passes its task; for every task, plausible wrong answers fail with
one line naming the case and the error; the checker's contract (exceptions, bad names, stubs)."""

from __future__ import annotations

import importlib.util
import sys

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton loads)
import pytest
import torch
import triton
import triton.language as tl

from k3lab import workshop
from k3lab.nn.norms import rms_norm
from k3lab.workshop import epilogue


def _fails(name, fn, capsys, *, expect=None):
    assert workshop.check(name, fn) is False
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and out.startswith(f"{name}: case "), out
    assert "Traceback" not in out
    if expect:
        assert expect in out, out
    return out


def test_nine_tasks_one_per_notebook():
    books = workshop.by_notebook()
    assert sorted(books) == ["01_dcp", "02_moe_sharding", "03_copy_removal", "04_mla_padding", "05_kda_scan",
                             "06_draft_depth", "07_agent_cache", "08_all_together", "09_serving_curve"]
    for t in workshop.TASKS.values():
        assert 10 <= t.minutes <= 20 and t.statement and t.signature


@pytest.mark.follows_gpu  # the kernel task's cases are made on the GPU where there is one (Task.on_device)
@pytest.mark.parametrize("name", sorted(workshop.TASKS))
def test_solution_passes(name, capsys):
    assert workshop.check(name, workshop.solution(name)) is True
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{name}: pass"), out


def test_cases_are_fresh_and_never_zero():
    for name, t in workshop.TASKS.items():
        cases = t.cases(0, "cpu")
        assert len(cases) >= 4, name
        for c in cases:
            for k, v in c.inputs.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    assert bool((v != 0).any()), (name, c.label, k)
        other = t.cases(1, "cpu")
        changed = any(str(x.inputs) != str(y.inputs) for x, y in zip(cases, other))
        assert changed, f"{name}: the seed changes nothing"


# ------------------------------------------------------------------------------------------ 01
def merge_plain_average(o_parts, lse_parts):
    return o_parts.float().mean(0).to(o_parts.dtype), lse_parts.amax(0)


def merge_no_max(o_parts, lse_parts):  # exp(lse) before subtracting anything: overflows in fp32
    w = torch.exp(lse_parts)
    s = w.sum(0)
    return ((w / s)[..., None] * o_parts.to(lse_parts.dtype)).sum(0).to(o_parts.dtype), torch.log(s)


def merge_right(o_parts, lse_parts):  # the learner's own correct merge (the solution is refused in a check)
    acc = torch.float64 if o_parts.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(lse_parts.to(acc), dim=0)
    return (torch.exp(lse_parts.to(acc) - lse)[..., None] * o_parts.to(acc)).sum(0).to(o_parts.dtype), lse


def merge_lse_is_max(o_parts, lse_parts):  # the right o, but lse = the largest piece's lse
    o, _ = merge_right(o_parts, lse_parts)
    return o, lse_parts.amax(0)


def test_dcp_merge_wrong(capsys):
    assert workshop.check("dcp_merge", merge_right)
    capsys.readouterr()
    _fails("dcp_merge", merge_plain_average, capsys, expect="case 1 of 5")
    _fails("dcp_merge", merge_no_max, capsys, expect="large scores")
    _fails("dcp_merge", merge_lse_is_max, capsys, expect="lse")


# ------------------------------------------------------------------------------------------ 02
def tail_wrong_shard(lat, norm_weight, eps, up_rows, shared_partial, rank, world_size):
    out = shared_partial.clone()  # every rank writes the first block of columns
    out[:, :up_rows.shape[0]] += rms_norm(lat, norm_weight, eps, out_dtype=up_rows.dtype) @ up_rows.t()
    return out


def tail_no_norm(lat, norm_weight, eps, up_rows, shared_partial, rank, world_size):
    rows = up_rows.shape[0]
    out = shared_partial.clone()
    out[:, rank * rows:(rank + 1) * rows] += lat.to(up_rows.dtype) @ up_rows.t()
    return out


def tail_routed_only(lat, norm_weight, eps, up_rows, shared_partial, rank, world_size):
    rows = up_rows.shape[0]  # the routed slice in a fresh buffer: the shared partial is dropped
    out = torch.zeros_like(shared_partial)
    y = rms_norm(lat, norm_weight, eps, out_dtype=up_rows.dtype)
    out[:, rank * rows:(rank + 1) * rows] = y @ up_rows.t()
    return out


def tail_slice_only(lat, norm_weight, eps, up_rows, shared_partial, rank, world_size):
    return rms_norm(lat, norm_weight, eps, out_dtype=up_rows.dtype) @ up_rows.t()  # [N, H/W]


def test_moe_rank_tail_wrong(capsys):
    _fails("moe_rank_tail", tail_wrong_shard, capsys, expect="max_rel")
    _fails("moe_rank_tail", tail_no_norm, capsys, expect="max_rel")
    _fails("moe_rank_tail", tail_routed_only, capsys)
    _fails("moe_rank_tail", tail_slice_only, capsys, expect="rank 0 must return its")


# ------------------------------------------------------------------------------------------ 03
@triton.jit
def _norm_over_block(x_ptr, gate_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK + eps)  # the padded columns counted
    tl.store(out_ptr + row * D + cols, (x * rstd * w * tl.sigmoid(g)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_before_norm(x_ptr, gate_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    xg = x * tl.sigmoid(g)  # gated first, then normalised (another model's gated norm)
    rstd = 1.0 / tl.sqrt(tl.sum(xg * xg, axis=0) / D + eps)
    tl.store(out_ptr + row * D + cols, (xg * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@pytest.mark.follows_gpu
def test_gated_norm_kernel_wrong(capsys):
    def over_block(x, gate, weight, eps):
        return epilogue.launch(_norm_over_block, x, gate, weight, eps)

    def gate_first(x, gate, weight, eps):
        return epilogue.launch(_gate_before_norm, x, gate, weight, eps)
    _fails("gated_norm_kernel", over_block, capsys, expect="D = 100")
    _fails("gated_norm_kernel", gate_first, capsys, expect="case 1 of")


@pytest.mark.follows_gpu
def test_gated_norm_skeleton_runs_and_is_wrong(tmp_path, capsys):
    path = tmp_path / "learner_kernel.py"  # @triton.jit needs its source in a file (a notebook cell is one)
    path.write_text(workshop.skeleton("gated_norm_kernel"))
    spec = importlib.util.spec_from_file_location("learner_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["learner_kernel"] = mod
    try:
        spec.loader.exec_module(mod)
        _fails("gated_norm_kernel", mod.gated_norm, capsys, expect="max_rel")
    finally:
        del sys.modules["learner_kernel"]


# ------------------------------------------------------------------------------------------ 04
def _padded(q, cache, lengths, scale, mma16, *, see_own=True, causal=True):
    B, Tq, H, D = q.shape
    q16 = torch.zeros(B, Tq, 16, D, dtype=q.dtype)
    q16[:, :, :H] = q
    s = mma16(q16, cache.transpose(1, 2)[:, None]) * scale
    L = cache.shape[1]
    qpos = lengths[:, None] - (Tq - torch.arange(Tq)[None, :] if causal else 1)
    pos = torch.arange(L)[None, None, :]
    visible = pos <= qpos[:, :, None] if see_own else pos < qpos[:, :, None]
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = mma16(torch.softmax(s, -1), cache[:, None, :, :512])
    return o[:, :, :H], lse[:, :, :H]


def test_mla_pad_heads_wrong(capsys):
    _fails("mla_pad_heads", lambda **kw: _padded(**kw, see_own=False), capsys, expect="max_rel")  # off by one
    _fails("mla_pad_heads", lambda **kw: _padded(**kw, causal=False), capsys, expect="verification group")

    def all_16(**kw):
        o, lse = _padded(**kw)
        q = kw["q"]
        return torch.cat([o, o[:, :, :16 - q.shape[2]]], 2), lse
    _fails("mla_pad_heads", all_16, capsys, expect="expected shape")

    def no_unit(q, cache, lengths, scale, mma16):  # right numbers in plain torch, never on the matrix unit
        return _padded(q, cache, lengths, scale, lambda a, b: a @ b)
    _fails("mla_pad_heads", no_unit, capsys, expect="mma16 was called 0 time(s)")

    def twelve_rows(q, cache, lengths, scale, mma16):  # the unpadded tile is refused by the unit
        return mma16(q, cache.transpose(1, 2)[:, None]), None
    _fails("mla_pad_heads", twelve_rows, capsys, expect="mma16: a must be [..., 16, K]")


# ------------------------------------------------------------------------------------------ 05
def _scan(A, Bc, S0, group_size, *, reverse=False, after=False, whole_groups=False):
    B, H, n, K, _ = A.shape
    stop = n - n % group_size if whole_groups else n
    Ms, bs = [], []
    for s in range(0, stop, group_size):
        M, b = torch.eye(K, dtype=A.dtype).expand(B, H, K, K), torch.zeros_like(Bc[:, :, 0])
        for c in range(s, min(s + group_size, n)):
            if reverse:  # "A1 then A2" written as A1 @ A2
                M, b = M @ A[:, :, c], b + M @ Bc[:, :, c]
            else:
                M, b = A[:, :, c] @ M, A[:, :, c] @ b + Bc[:, :, c]
        Ms.append(M)
        bs.append(b)
    starts, S = [], S0
    for M, b in zip(Ms, bs):
        if not after:
            starts.append(S)
        S = M @ S + b
        if after:  # the state after each group: every start one group late
            starts.append(S)
    return torch.stack(Ms, 2), torch.stack(bs, 2), torch.stack(starts, 2)


def test_kda_group_scan_wrong(capsys):
    assert workshop.check("kda_group_scan", _scan)
    capsys.readouterr()
    _fails("kda_group_scan", lambda **kw: _scan(**kw, reverse=True), capsys, expect="M (fp64)")
    _fails("kda_group_scan", lambda **kw: _scan(**kw, after=True), capsys, expect="starts")
    _fails("kda_group_scan", lambda **kw: _scan(**kw, whole_groups=True), capsys, expect="expected shape")


# ------------------------------------------------------------------------------------------ 06
def _depth(acceptance, draft_step_us, verify_us, commit_us, *, bonus=True, shift=0, cost=True):
    rates = []
    committed, survive = (1.0 if bonus else 0.0), 1.0
    for k in range(1, len(acceptance) + 1):
        survive *= acceptance[k - 1]
        committed += survive
        cycle = k * draft_step_us + verify_us[k - shift] + commit_us
        rates.append(committed / cycle if cost else committed)
    return max(range(len(rates)), key=rates.__getitem__) + 1


def test_draft_depth_wrong(capsys):
    assert workshop.check("draft_depth", _depth)
    capsys.readouterr()
    # verification of k positions instead of k + 1
    _fails("draft_depth", lambda **kw: _depth(**kw, shift=1), capsys, expect="depth: expected")
    _fails("draft_depth", lambda **kw: _depth(**kw, bonus=False), capsys)  # the recovery/bonus token left out
    _fails("draft_depth", lambda **kw: _depth(**kw, cost=False), capsys)  # committed tokens, not a rate
    _fails("draft_depth", lambda **kw: _depth(**kw) - 1, capsys)  # an index, not a depth


# ------------------------------------------------------------------------------------------ 07
def _resume(prompt_len, mla_reach, kda_checkpoints, mla_block, tail_saved, *, floor=True, strict=False,
            limit=True):
    stored = mla_reach if (tail_saved or not floor) else mla_reach // mla_block * mla_block
    if limit:
        stored = min(stored, prompt_len - 1)
    ok = [c for c in kda_checkpoints if (c < stored if strict else c <= stored)]
    at = max(ok, default=0)
    return at, prompt_len - at


def test_resume_point_wrong(capsys):
    assert workshop.check("resume_point", _resume)
    capsys.readouterr()
    _fails("resume_point", lambda **kw: _resume(**kw, floor=False), capsys, expect="case 1 of")
    _fails("resume_point", lambda **kw: _resume(**kw, strict=True), capsys, expect="expected 3100, got 2048")
    _fails("resume_point", lambda **kw: _resume(**kw, limit=False), capsys, expect="whole prompt cached")


# ------------------------------------------------------------------------------------------ 08
def _floor(config, batch, context_len, dense_weight_bytes, bandwidth_tbs, *, distinct=True, rw=2, unit=1e6):
    c = config
    E, k = c.num_experts, c.num_experts_per_token
    chosen = E * (1 - (1 - k / E) ** batch) if distinct else min(batch * k, E)
    total = (dense_weight_bytes
             + c.num_moe_layers * chosen * 3 * c.moe_intermediate_size * c.routed_expert_hidden_size * 2
             + c.num_mla_layers * batch * (context_len + 2) * c.mla_latent_dim * 2
             + c.num_kda_layers * batch * rw * c.kda_state_bytes_per_sequence()
             + c.num_kda_layers * batch * rw * c.kda_conv_state_values_per_sequence() * 2)
    return total / (bandwidth_tbs * unit)


def test_step_floor_wrong(capsys):
    assert workshop.check("step_floor", _floor)
    capsys.readouterr()
    _fails("step_floor", lambda **kw: _floor(**kw, distinct=False), capsys, expect="B = 64")
    _fails("step_floor", lambda **kw: _floor(**kw, rw=1), capsys, expect="relative error")
    _fails("step_floor", lambda **kw: _floor(**kw, unit=1e12), capsys, expect="case 1 of")


# ------------------------------------------------------------------------------------------ the checker
def test_raising_function_is_one_line(capsys):
    def broken(o_parts, lse_parts):
        raise RuntimeError("shapes do not line up\nsecond line of detail")
    out = _fails("dcp_merge", broken, capsys)
    assert out.endswith("your function raised RuntimeError: shapes do not line up")


def test_wrong_return_type_is_one_line(capsys):
    _fails("dcp_merge", lambda o_parts, lse_parts: o_parts[0], capsys, expect="must be a tuple (o, lse)")
    _fails("resume_point", lambda **kw: (1.5, 2), capsys, expect="expected an int")
    _fails("step_floor", lambda **kw: float("nan"), capsys, expect="relative error nan")


def test_learner_writing_into_inputs_changes_nothing(capsys):
    def scribbles(o_parts, lse_parts):
        out = merge_right(o_parts, lse_parts)
        o_parts.zero_()
        lse_parts.fill_(3.0)
        return out
    assert workshop.check("dcp_merge", scribbles)


def test_bad_names_refused():
    with pytest.raises(ValueError, match="dcp_merge"):
        workshop.check("dcp-merge", lambda: None)
    for fn in (workshop.solution, workshop.stub, workshop.skeleton):
        with pytest.raises(ValueError, match="name must be one of"):
            fn("nope")
    with pytest.raises(ValueError, match="has no Triton skeleton.*gated_norm_kernel"):
        workshop.skeleton("dcp_merge")
    with pytest.raises(ValueError, match="seed"):
        workshop.check("dcp_merge", workshop.solution("dcp_merge"), seed=-1)
    assert workshop.check("dcp_merge", 3, verbose=False) is False


@pytest.mark.parametrize("name", sorted(n for n, t in workshop.TASKS.items() if t.skeleton is None))
def test_stub_is_python_that_raises_not_implemented(name, capsys):
    namespace: dict = {}
    exec(compile(workshop.stub(name), f"<stub {name}>", "exec"), namespace)
    fns = [v for k, v in namespace.items() if callable(v) and not k.startswith("__")]
    assert len(fns) == 1, name
    _fails(name, fns[0], capsys, expect="NotImplementedError")


def test_other_seeds_pass_and_tolerances_follow_dtype(capsys):
    for name in ("dcp_merge", "moe_rank_tail", "kda_group_scan", "draft_depth"):
        assert workshop.check(name, workshop.solution(name), seed=7, verbose=False), name
    dts = {str(c.dtype) for c in workshop.TASKS["dcp_merge"].cases(0, "cpu")}
    assert {"torch.float16", "torch.float32", "torch.float64"} <= dts
