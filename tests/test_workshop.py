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


def _plain_gated_norm(x, gate, weight, eps):  # the right numbers in PyTorch, no kernel
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


@pytest.mark.follows_gpu
def test_gated_norm_kernel_needs_a_triton_kernel_of_the_learners(capsys):
    assert workshop.check("gated_norm_kernel", lambda **kw: _plain_gated_norm(**kw)) is False
    out = capsys.readouterr().out
    assert "case 1 of 4" in out and "no Triton kernel launched: gated_norm must launch your" in out, out
    fn = workshop.task("gated_norm_kernel", _plain_gated_norm)  # the notebook's cell: not solved, goes on
    assert not fn.passed and "not solved yet" in capsys.readouterr().out

    def launches_nothing(x, gate, weight, eps):  # a kernel over an empty grid runs no program
        y = _plain_gated_norm(x, gate, weight, eps)
        _copy_kernel[(0,)](y, torch.empty_like(y), 1, BLOCK=16)
        return y
    _fails("gated_norm_kernel", launches_nothing, capsys, expect="no Triton kernel launched")

    def copies_with_a_kernel(x, gate, weight, eps):  # a real launch of the learner's: the check goes on
        y = _plain_gated_norm(x, gate, weight, eps)
        out = torch.empty_like(y)
        _copy_kernel[(1,)](y.reshape(-1), out.reshape(-1), y.numel(), BLOCK=triton.next_power_of_2(y.numel()))
        return out
    assert workshop.check("gated_norm_kernel", copies_with_a_kernel)
    capsys.readouterr()

    library = _copy_kernel.fn.__module__
    try:  # the same kernel as if k3lab had defined it: not the learner's
        _copy_kernel.fn.__module__ = "k3lab.ops.some_op"
        _fails("gated_norm_kernel", copies_with_a_kernel, capsys,
               expect="no Triton kernel launched of yours (only k3lab's own: _copy_kernel)")
    finally:
        _copy_kernel.fn.__module__ = library

    def launches_the_answer(x, gate, weight, eps):  # the reference kernel, launched around epilogue.launch
        out = torch.empty_like(x)
        epilogue._gated_norm_kernel[(x.shape[0],)](x, gate, weight, out, x.shape[1], eps,
                                                   BLOCK=triton.next_power_of_2(x.shape[1]))
        return out
    _fails("gated_norm_kernel", launches_the_answer, capsys,
           expect="epilogue._gated_norm_kernel, refused while 'gated_norm_kernel' is graded")


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
def _depth(committed_counts, draft_step_us, verify_us, commit_us, *, truncate=True, bonus=True, shift=0,
           cost=True):
    cycles = sum(committed_counts)
    rates = []
    for k in range(1, len(committed_counts)):
        cap = (k + 1 if bonus else k) if truncate else len(committed_counts)
        committed = sum(n * min(c, cap) for c, n in enumerate(committed_counts, start=1)) / cycles
        cycle = k * draft_step_us + verify_us[k - shift] + commit_us
        rates.append(committed / cycle if cost else committed)
    return max(range(len(rates)), key=rates.__getitem__) + 1


def _depth_from_conditional(committed_counts, draft_step_us, verify_us, commit_us):
    """The log read as per-position acceptance: a_j = the share of cycles that committed j + 1 tokens."""
    cycles = sum(committed_counts)
    acc = [n / cycles for n in committed_counts[1:]]
    rates, committed, survive = [], 1.0, 1.0
    for k in range(1, len(committed_counts)):
        survive *= acc[k - 1]
        committed += survive
        rates.append(committed / (k * draft_step_us + verify_us[k] + commit_us))
    return max(range(len(rates)), key=rates.__getitem__) + 1


def test_draft_depth_wrong(capsys):
    assert workshop.check("draft_depth", _depth)
    assert workshop.check("draft_depth", _depth, seed=3)
    capsys.readouterr()
    # each mistake first fails on the case whose label names it
    _fails("draft_depth", lambda **kw: _depth(**kw, truncate=False), capsys,
           expect="case 1 of 8 (a log of")  # every depth credited with the K-deep cycles' tokens
    _fails("draft_depth", lambda **kw: _depth(**kw, shift=1), capsys,
           expect="case 2 of 8 (verification steps up past")  # k positions verified, not k + 1
    _fails("draft_depth", lambda **kw: _depth(**kw, cost=False), capsys,
           expect="case 3 of 8 (compute-bound verification")  # committed tokens, not a rate
    _fails("draft_depth", lambda **kw: _depth(**kw, bonus=False), capsys,
           expect="case 4 of 8 (a cycle that accepts all k drafts still commits the target's bonus token)")
    _fails("draft_depth", lambda **kw: _depth(**kw) - 1, capsys, expect="case 1 of 8")  # an index
    _fails("draft_depth", _depth_from_conditional, capsys, expect="depth: expected")


def test_draft_depth_cases_expose_their_mistake_on_other_seeds():
    from k3lab.workshop import serving

    wrong = {"no_truncation": dict(truncate=False), "k_positions": dict(shift=1),
             "most_tokens": dict(cost=False), "bonus_dropped": dict(bonus=False)}
    assert tuple(wrong) == serving.DEPTH_MISTAKES
    for seed in (1, 2, 11):
        cases = workshop.TASKS["draft_depth"].cases(seed, "cpu")
        for i, opts in enumerate(wrong.values()):
            for j, case in enumerate(cases[:i + 1]):  # right before its own case, wrong on it
                right = _depth(**case.inputs, **opts) == serving._depth_reference(case)
                assert right == (j < i), (seed, i, j)


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
def _fix(parts, *, by="saved", gaps=True, none_is_zero=False):
    rows = []
    for p in parts:
        if p["floor_ms"] is None and not none_is_zero:
            continue
        saved = (p["total_ms"] if gaps else p["kernel_ms"]) - (p["floor_ms"] or 0.0)
        key = {"saved": saved, "longest": p["total_ms"], "ratio": p["kernel_vs_floor"] or 0.0}[by]
        rows.append((key, p["part"], saved))
    _, part, saved = max(rows)
    return part, saved


def test_fix_first_wrong(capsys):
    assert workshop.check("fix_first", _fix)
    capsys.readouterr()
    _fails("fix_first", lambda parts: _fix(parts, gaps=False), capsys,
           expect="case 1 of 7 (the gaps before a part's kernels are its time too")
    _fails("fix_first", lambda parts: _fix(parts, by="longest"), capsys,
           expect="case 2 of 7 (the longest part is not the one with the most ms above its floor")
    _fails("fix_first", lambda parts: _fix(parts, by="ratio"), capsys,
           expect="case 3 of 7 (the part furthest from its floor as a ratio has few ms to give")
    _fails("fix_first", lambda parts: _fix(parts, none_is_zero=True), capsys,
           expect="case 4 of 7 (a part with no bytes floor (None) cannot be ranked by this table")
    _fails("fix_first", lambda parts: (_fix(parts)[0], _fix(parts)[1] * 1e3), capsys,  # us, not ms
           expect="saved_ms: expected")
    _fails("fix_first", lambda parts: (_fix(parts)[0], sum(p["total_ms"] for p in parts) - _fix(parts)[1]),
           capsys, expect="case 1 of 7")  # the step's new time, not what it saves
    _fails("fix_first", lambda parts: (_fix(parts)[0].upper(), _fix(parts)[1]), capsys,
           expect="part: expected")


def test_fix_first_tables_are_rescaled_records_in_the_pages_columns():
    from k3lab.studies import decode_step as ds
    from k3lab.workshop import serving

    cases, other = (workshop.TASKS["fix_first"].cases(seed, "cpu") for seed in (0, 1))
    page, _ = ds.attribution_rows("b1_1k", "all_on")
    for case in cases:
        parts = case.inputs["parts"]
        assert {p["part"] for p in parts} == {r["part"] for r in page}  # the step's parts, every one
        for p in parts:
            assert tuple(p) == serving.FIX_COLUMNS
            assert p["total_ms"] == pytest.approx(p["kernel_ms"] + p["gap_ms"])
            assert p["floor_ms"] is None or 0 < p["floor_ms"] < p["kernel_ms"]
        assert sum(p["share"] for p in parts) == pytest.approx(1.0)
        assert not any(p == r for p in parts for r in page)  # no row is the page's
    assert [c.inputs for c in cases] != [c.inputs for c in other]
    gains = ds.headroom(page)  # the reference: parts with a floor, the most ms above it first
    assert {r["part"] for r in gains} == {r["part"] for r in page if r["floor_ms"] is not None}
    assert all(a["headroom_ms"] >= b["headroom_ms"] for a, b in zip(gains, gains[1:]))
    assert gains[0]["headroom_ms"] == pytest.approx(gains[0]["total_ms"] - gains[0]["floor_ms"])


# ------------------------------------------------------------------------------------------ 09
def _bend(concurrency, input_tokens, output_tokens, hit_rate, fixed_us, per_sequence_us, per_history_token_us,
          prefill_us_per_token, *, prefill="batch", hits=True, history="half", relative=True):
    mean_in, mean_out = sum(input_tokens) / len(input_tokens), sum(output_tokens) / len(output_tokens)
    one = mean_in * (1 - (hit_rate if hits else 0.0)) * prefill_us_per_token
    held = mean_in + (mean_out / 2 if history == "half" else 0.0)
    user, gpu = [], []
    for c in concurrency:
        stall = {"batch": c * one / mean_out, "one": one / mean_out, None: 0.0}[prefill]
        step = fixed_us + c * (per_sequence_us + per_history_token_us * held) + stall
        user.append(1e6 / step)
        gpu.append(c * user[-1] * (mean_in + mean_out) / mean_out / 8)
    for i in range(len(concurrency) - 1):
        gain = gpu[i + 1] / gpu[i] - 1 if relative else gpu[i + 1] - gpu[i]
        loss = 1 - user[i + 1] / user[i] if relative else user[i] - user[i + 1]
        if gain < loss:
            return int(concurrency[i])
    return int(concurrency[-1])


def test_curve_bend_wrong(capsys):
    assert workshop.check("curve_bend", _bend)
    assert workshop.check("curve_bend", _bend, seed=4)
    capsys.readouterr()
    for prefill in (None, "one"):  # no prefill stall, or one request's instead of the batch's
        _fails("curve_bend", lambda **kw: _bend(**kw, prefill=prefill), capsys,
               expect="case 1 of 6 (RAG: ")
        assert "each request's prefill stalls the batch's every sequence" in _fails(
            "curve_bend", lambda **kw: _bend(**kw, prefill=prefill), capsys)
    _fails("curve_bend", lambda **kw: _bend(**kw, hits=False), capsys,
           expect="case 2 of 6 (agent turns: ")  # cached input prefilled anyway
    assert "cached input is not prefilled" in _fails("curve_bend", lambda **kw: _bend(**kw, hits=False),
                                                     capsys)
    _fails("curve_bend", lambda **kw: _bend(**kw, history="input"), capsys,
           expect="a sequence's history grows as it answers")
    _fails("curve_bend", lambda **kw: _bend(**kw, relative=False), capsys, expect="concurrency: expected")
    _fails("curve_bend", lambda concurrency, **kw: int(concurrency[-1]), capsys,
           expect="concurrency: expected")


# ------------------------------------------------------------------------------------------ the checker
def test_raising_function_is_one_line(capsys):
    def broken(o_parts, lse_parts):
        raise RuntimeError("shapes do not line up\nsecond line of detail")
    out = _fails("dcp_merge", broken, capsys)
    assert out.endswith("your function raised RuntimeError: shapes do not line up")


def test_wrong_return_type_is_one_line(capsys):
    _fails("dcp_merge", lambda o_parts, lse_parts: o_parts[0], capsys, expect="must be a tuple (o, lse)")
    _fails("resume_point", lambda **kw: (1.5, 2), capsys, expect="expected an int")
    _fails("fix_first", lambda parts: ("moe", float("nan")), capsys, expect="relative error nan")
    _fails("fix_first", lambda parts: (3, 1.0), capsys, expect="part: expected a str")


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
