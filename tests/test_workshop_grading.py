"""k3lab.workshop.task: the learner's code graded by default, one line saying whose, nothing halts; the
solutions setting grades the references and fails loudly; the library functions that answer a task are
refused while it is graded (a one-line call of each fails, and works again afterwards); the hint ladder."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton loads)
import pytest
import torch
import triton
import triton.language as tl

from k3lab import speculative as spec
from k3lab import workshop
from k3lab.cache.resume import resume_point
from k3lab.nn.mla import latent_attention
from k3lab.nn.norms import gated_rms_norm
from k3lab.ops.kda_chunk.scan_math import group_summaries, scan_starts
from k3lab.ops.mla_decode.merge import merge_partials
from k3lab.ops.moe_experts import latent_tail
from k3lab.serving.curve import knee
from k3lab.studies.decode_step import headroom
from k3lab.workshop import epilogue, grading, guard

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _learner_setting(monkeypatch):
    monkeypatch.delenv(workshop.GRADE_ENV, raising=False)
    grading.reset_hints()
    yield
    grading.reset_hints()


def _one_line(capsys) -> str:
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1, out
    assert "Traceback" not in out
    return out


def _stub_function(name: str, tmp_path: Path):
    """The learner's function as the untouched stub cell defines it (a file: @triton.jit reads source)."""
    path = tmp_path / f"stub_{name}.py"
    path.write_text(workshop.stub(name))
    spec_ = importlib.util.spec_from_file_location(f"stub_{name}", path)
    mod = importlib.util.module_from_spec(spec_)
    sys.modules[spec_.name] = mod
    try:
        spec_.loader.exec_module(mod)
    finally:
        del sys.modules[spec_.name]
    fns = [v for k, v in vars(mod).items() if callable(v) and getattr(v, "__module__", "") == spec_.name
           and not k.startswith("_") and not hasattr(v, "run")]  # a Triton kernel is not the learner's entry
    assert len(fns) == 1, (name, fns)
    return fns[0]


def _plan_resume(prompt_len, mla_reach, kda_checkpoints, mla_block, tail_saved):  # a learner's right answer
    stored = mla_reach if tail_saved else mla_reach - mla_reach % mla_block
    stored = min(stored, prompt_len - 1)
    at = max((c for c in kda_checkpoints if c <= stored), default=0)
    return at, prompt_len - at


# ------------------------------------------------------------------------------------ whose code, go on
def test_learner_code_that_passes_is_what_the_lesson_runs_on(capsys):
    fn = workshop.task("resume_point", _plan_resume)
    line = _one_line(capsys)
    assert line.startswith("resume_point, graded your code: pass (10 cases"), line
    assert fn.passed and fn.uses == "yours" and fn.fn is _plan_resume
    assert fn(prompt_len=3300, mla_reach=3100, kda_checkpoints=[1024, 2048, 3100], mla_block=1024,
              tail_saved=False) == (2048, 1252)


@pytest.mark.follows_gpu  # the kernel task's cases are made on the GPU where there is one
@pytest.mark.parametrize("name", sorted(workshop.TASKS))
def test_untouched_stub_says_not_solved_and_goes_on_with_the_reference(name, tmp_path, capsys):
    stub = _stub_function(name, tmp_path)
    fn = workshop.task(name, stub)  # must not raise
    line = _one_line(capsys)
    assert line.startswith(f"{name}, graded your code: not solved yet: case 1 of "), line
    assert line.endswith("\u2014 " + grading.CONTINUE), line
    if workshop.TASKS[name].skeleton is None:
        assert "NotImplementedError" in line, line
    assert not fn.passed and fn.uses == "the reference solution" and fn.fn is workshop.solution(name)
    assert repr(fn) == f"<{name}: not solved; the lesson runs on the reference solution>"


def test_a_failing_learner_function_never_raises(capsys):
    def crashes(o_parts, lse_parts):
        raise ZeroDivisionError("oops")

    class Weird:  # a result the comparison cannot even look at
        shape = property(lambda self: 1 / 0)

    for fn, expect in ((crashes, "your function raised ZeroDivisionError: oops"),
                       (lambda o_parts, lse_parts: (Weird(), Weird()), "expected a Tensor"),
                       (None, "no function given"), (3, "no function given (got int)")):
        out = workshop.task("dcp_merge", fn)
        assert not out.passed and out.fn is workshop.solution("dcp_merge")
        line = _one_line(capsys)
        assert "not solved yet" in line and expect in line, line


def test_the_reference_passed_as_the_learners_code_is_labelled(capsys):
    fn = workshop.task("curve_bend", workshop.solution("curve_bend"))
    line = _one_line(capsys)
    assert line.startswith("curve_bend, graded the reference solution, not your code: pass"), line
    assert fn.passed and fn.uses == "the reference solution"


@pytest.mark.follows_gpu
@pytest.mark.parametrize("name", sorted(workshop.TASKS))
def test_solutions_setting_grades_the_reference(name, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(workshop.GRADE_ENV, "solutions")
    stub = _stub_function(name, tmp_path)
    fn = workshop.task(name, stub)  # the stub is not run: the reference is graded
    line = _one_line(capsys)
    said = f"{name}, graded the reference solution (K3LAB_WORKSHOP_GRADE=solutions): pass ("
    assert line.startswith(said), line
    assert fn.passed and fn.fn is workshop.solution(name)


def test_solutions_setting_fails_loudly_on_a_broken_reference(monkeypatch, capsys):
    monkeypatch.setenv(workshop.GRADE_ENV, "solutions")
    broken = dataclasses.replace(workshop.TASKS["curve_bend"],
                                 solution=lambda concurrency, **kw: int(concurrency[0]))
    monkeypatch.setitem(workshop.TASKS, "curve_bend", broken)
    with pytest.raises(workshop.SolutionFailed, match=r"curve_bend, graded the reference solution .*FAILED: "
                                                      r"case 1 of 6 .*concurrency: expected"):
        workshop.task("curve_bend", None)


def test_grade_setting_values(monkeypatch):
    for value, mode in (("", "learner"), ("learner", "learner"), ("Solutions", "solutions")):
        monkeypatch.setenv(workshop.GRADE_ENV, value)
        assert workshop.grade_mode() == mode
    monkeypatch.setenv(workshop.GRADE_ENV, "teacher")
    with pytest.raises(ValueError, match="K3LAB_WORKSHOP_GRADE must be one of .*'teacher'"):
        workshop.task("curve_bend", None)
    monkeypatch.delenv(workshop.GRADE_ENV)
    with pytest.raises(ValueError, match="name must be one of"):
        workshop.task("no_such_task", None)


# ------------------------------------------------------------------------------------ the library refuses
def _acceptance(committed_counts):  # the conditional acceptance a log of committed tokens implies
    surv = [sum(committed_counts[j:]) / sum(committed_counts) for j in range(len(committed_counts))]
    return [surv[j] / surv[j - 1] if surv[j - 1] else 0.0 for j in range(1, len(surv))]


def _front(concurrency, input_tokens, output_tokens, hit_rate, fixed_us, per_sequence_us,
           per_history_token_us, prefill_us_per_token):  # the learner's own rates, for the one-line knee
    mean_in, mean_out = sum(input_tokens) / len(input_tokens), sum(output_tokens) / len(output_tokens)
    prefill = mean_in * (1 - hit_rate) * prefill_us_per_token
    user = [1e6 / (fixed_us + c * (per_sequence_us + per_history_token_us * (mean_in + mean_out / 2)
                                   + prefill / mean_out)) for c in concurrency]
    return user, [c * u * (mean_in + mean_out) / mean_out / 8 for c, u in zip(concurrency, user)]


ONE_LINE = {  # each task answered by one call of the library the notebooks import
    "dcp_merge": lambda o_parts, lse_parts: merge_partials(o_parts, lse_parts, "torch"),
    "moe_rank_tail": lambda lat, norm_weight, eps, up_rows, shared_partial, rank, world_size: latent_tail(
        lat, norm_weight, eps, up_rows, shared_partial.clone(), rank * up_rows.shape[0]),
    "gated_norm_kernel": lambda x, gate, weight, eps: gated_rms_norm(x, gate, weight, eps),
    "mla_pad_heads": lambda q, cache, lengths, scale, mma16: [  # two token calls of the unit, then the answer
        mma16(torch.zeros(16, 1), torch.zeros(1, 1)) for _ in "ab"] and latent_attention(q, cache, lengths,
                                                                                         scale=scale),
    "kda_group_scan": lambda A, Bc, S0, group_size: (
        *group_summaries(A, Bc, group_size), scan_starts(*group_summaries(A, Bc, group_size), S0)),
    "draft_depth": lambda committed_counts, draft_step_us, verify_us, commit_us: spec.best_depth(
        _acceptance(committed_counts),
        spec.CycleCosts(draft_step_us=draft_step_us, verify_us=tuple(verify_us), commit_us=commit_us)).depth,
    "resume_point": lambda prompt_len, mla_reach, kda_checkpoints, mla_block, tail_saved: (
        lambda at: (at, prompt_len - at))(resume_point(mla_reach, kda_checkpoints, mla_block=mla_block,
                                                       tail_saved=tail_saved, limit=prompt_len - 1)),
    "fix_first": lambda parts: (lambda first: (first["part"], first["headroom_ms"]))(headroom(parts)[0]),
    "curve_bend": lambda **kw: knee(kw["concurrency"], *_front(**kw)),
}
CALLED = {"dcp_merge": "merge_partials", "moe_rank_tail": "latent_tail",
          "gated_norm_kernel": "gated_rms_norm", "mla_pad_heads": "latent_attention",
          "kda_group_scan": "group_summaries", "draft_depth": "best_depth",
          "resume_point": "resume_point", "fix_first": "headroom", "curve_bend": "knee"}


def test_one_line_calls_cover_every_task():
    assert sorted(ONE_LINE) == sorted(workshop.TASKS) == sorted(CALLED)


@pytest.mark.follows_gpu
@pytest.mark.parametrize("name", sorted(ONE_LINE))
def test_the_library_call_that_answers_a_task_is_refused(name, capsys):
    task = workshop.TASKS[name]
    cases = grading.cases(task, 0)
    # no guard: the one line gives the right numbers (the kernel task's numbers, without its launch check)
    plain = dataclasses.replace(task, run=None) if task.skeleton is not None else task
    ok, line = workshop.grade(plain, ONE_LINE[name], cases)
    assert ok, line
    fn = workshop.task(name, ONE_LINE[name])
    line = _one_line(capsys)
    assert not fn.passed and fn.fn is task.solution
    assert f"{name}, graded your code: not solved yet: case 1 of" in line, line
    assert f".{CALLED[name]}, refused while {name!r} is graded" in line, line
    assert workshop.check(name, ONE_LINE[name]) is False  # the old check refuses it too
    capsys.readouterr()
    ok, line = workshop.grade(plain, ONE_LINE[name], cases)  # ... and afterwards the library works again
    assert ok, line


def test_the_solution_and_the_reference_are_refused_inside_the_learners_function(capsys):
    def borrows(**kw):
        return workshop.solution("curve_bend")(**kw)
    workshop.task("curve_bend", borrows)
    assert "workshop.solution('curve_bend'), refused while 'curve_bend' is graded" in _one_line(capsys)

    def reads_the_key(**kw):
        return workshop.TASKS["curve_bend"].reference(workshop.Case("x", kw, workshop.EXACT))
    workshop.task("curve_bend", reads_the_key)
    assert "the reference of 'curve_bend', refused" in _one_line(capsys)


@pytest.mark.follows_gpu
def test_the_reference_kernel_is_refused_at_launch(capsys):
    def launches_it(x, gate, weight, eps):
        return epilogue.launch(epilogue._gated_norm_kernel, x, gate, weight, eps)
    workshop.task("gated_norm_kernel", launches_it)
    assert "epilogue._gated_norm_kernel, refused while 'gated_norm_kernel'" in _one_line(capsys)
    assert workshop.check("gated_norm_kernel", launches_it, verbose=False) is False
    assert workshop.check("gated_norm_kernel", workshop.solution("gated_norm_kernel"), verbose=False)


def test_an_interrupt_inside_the_learners_function_puts_the_library_back(capsys):
    def interrupted(**kw):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):  # the learner's Ctrl-C is not swallowed as "not solved"
        workshop.task("curve_bend", interrupted)
    assert knee([1, 2, 4], [10.0, 9.0, 3.0], [10.0, 18.0, 12.0]) == 2


def test_every_forbidden_path_names_a_function_or_the_launch_checked_kernel():
    for name, task in workshop.TASKS.items():
        assert task.forbidden, name
        for path in task.forbidden:
            obj = guard.resolve(path)
            assert guard.target(obj) is not None or obj is epilogue._gated_norm_kernel, (name, path)
    with pytest.raises(ValueError, match="does not resolve"):
        guard.resolve("k3lab.cache.resume.no_such_function")
    with pytest.raises(ValueError, match="dotted path"):
        guard.resolve("resume_point")


def test_refusal_swaps_code_with_free_variables_and_restores_it():
    def make(k):
        def inner(x):
            return x + k
        return inner
    f = make(3)
    with guard.refusing("demo", also={"the closure": f}):
        with pytest.raises(guard.Refused, match="the closure, refused while 'demo' is graded"):
            f(1)
        with guard.refusing("demo", also={"the closure": f}):  # nested: the outer block keeps it
            pass
        with pytest.raises(guard.Refused):
            f(1)
    assert f(1) == 4 and guard.refusal(f) is None


# ------------------------------------------------------------------------------------ hints
def test_every_task_has_three_distinct_hints():
    seen = set()
    for name, task in workshop.TASKS.items():
        assert len(task.hints) == 3 and len(set(task.hints)) == 3, name
        assert all(len(h) > 60 for h in task.hints), name  # a sentence at least, not a placeholder
        assert not seen & set(task.hints), name  # no hint copied from another task
        seen |= set(task.hints)
    with pytest.raises(ValueError, match="three distinct"):
        dataclasses.replace(workshop.TASKS["curve_bend"], hints=("a", "a", "b"))


def test_hint_ladder_shows_the_next_hint_and_stops_at_the_last(capsys):
    hints = workshop.TASKS["draft_depth"].hints

    def show(*args) -> str:
        assert workshop.hint(*args) is None  # printed once, nothing more for a cell to display
        return _one_line(capsys)
    shown = [show("draft_depth") for _ in range(4)]
    assert [s.split(" (")[0] for s in shown] == ["draft_depth, hint 1 of 3", "draft_depth, hint 2 of 3",
                                                 "draft_depth, hint 3 of 3", "draft_depth, hint 3 of 3"]
    assert "(a nudge): " + hints[0] in shown[0] and "(the idea): " + hints[1] in shown[1]
    assert "(nearly the code): " + hints[2] in shown[2] and "the last hint" in shown[3]
    assert hints[0] in show("draft_depth", 1)
    assert "hint 1 of 3" in show("resume_point")  # each task has its own ladder
    grading.reset_hints()
    assert "hint 1 of 3" in show("draft_depth")
    for bad in (0, 4, True, "2"):
        with pytest.raises(ValueError, match="level must be"):
            workshop.hint("draft_depth", bad)


def test_instructor_guide_mirrors_the_hints():
    doc = (REPO / "docs" / "instructor.md").read_text()
    assert grading.HINTS_BEGIN in doc, "docs/instructor.md has no generated hints section"
    assert grading.with_hints(doc, workshop.TASKS) == doc, (
        "docs/instructor.md's hints differ from the task definitions: python -m k3lab.workshop.hints "
        "docs/instructor.md")
    for name, task in workshop.TASKS.items():
        assert f"`{name}`" in doc and all(h in doc for h in task.hints), name


# ------------------------------------------------------------------------------------ Triton launches
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU


@triton.jit
def _double(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


def test_kernel_launches_records_what_ran_and_puts_triton_back():
    from k3lab.workshop._core import _kernel_classes, kernel_launches

    runs = {cls: cls.__dict__["run"] for cls in _kernel_classes()}
    x = torch.ones(5, device=DEV)
    with kernel_launches() as outer:
        _double[(1,)](x, 5, BLOCK=8)
        with kernel_launches() as inner:
            _double[(0,)](x, 5, BLOCK=8)  # an empty grid: no program ran
            _double[lambda meta: (1,)](x, 5, BLOCK=8)
        _double.warmup(x, 5, BLOCK=8, grid=(1,))  # compiles (on a GPU), runs nothing
        with pytest.raises(Exception):  # noqa: B017 - Triton's own error for a missing argument
            _double[(1,)](x, BLOCK=8)
    assert x.tolist() == [4.0] * 5  # the two launches that ran, and only those
    assert outer.names() == ["_double", "_double"] and len(inner) == 1
    assert [launch.programs for launch in outer] == [1, None] and outer.launches[0].kernel is _double
    assert outer.outside("k3lab") == outer.launches  # this file's kernel is not the library's
    assert outer.launches[0].module == __name__ and not outer.outside(__name__.split(".")[0])
    assert {cls: cls.__dict__["run"] for cls in _kernel_classes()} == runs  # put back after the last block
    _double[(1,)](x, 5, BLOCK=8)  # and launches go on as before
    assert x.tolist() == [8.0] * 5


def test_a_refused_kernel_refuses_to_launch_inside_a_block():
    from k3lab.workshop._core import kernel_launches

    x = torch.ones(4, device=DEV)
    with guard.refusing("demo", also={"the demo kernel": _double}), kernel_launches() as seen:
        with pytest.raises(guard.Refused, match="the demo kernel, refused while 'demo' is graded"):
            _double[(1,)](x, 4, BLOCK=4)
    assert len(seen) == 0 and x.tolist() == [1.0] * 4
    _double[(1,)](x, 4, BLOCK=4)  # outside the block and the guard it launches again
    assert x.tolist() == [2.0] * 4
