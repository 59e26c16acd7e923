"""k3lab.workshop.ladder: every puzzle's solution passes and its stub (the notebook's stub cell, run as the
learner gets it) is "not solved"; a plain function is refused as "no Triton kernel launched"; a kernel that
fails shows its whole error and the learner's line; a load or store outside every tensor is stopped with
its line; the workshop's solutions setting grades the solutions; a compile error from Triton's GPU compiler
is shown whole. Interpreter tests are marked on_a_cpu (on a GPU machine they run in a child that sees no
GPU); the same checks, compiled, run on a GPU where there is one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton loads)
import pytest
import torch

from cpu_child import on_a_cpu
from k3lab.workshop import grading, ladder
from k3lab.workshop.ladder import _grade

ROOT = Path(__file__).resolve().parent.parent
NAMES = sorted(ladder.PUZZLES)
KERNEL_LESSONS = ("01_dcp", "03_copy_removal", "04_mla_padding", "05_kda_scan")


@pytest.fixture(autouse=True)
def _learner_mode(monkeypatch):
    monkeypatch.delenv(grading.GRADE_ENV, raising=False)


def _load(tmp_path: Path, name: str, source: str):
    """A module from source written to a file (Triton reads a kernel's source from its file)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stub_cell(tmp_path: Path, name: str):
    return _load(tmp_path, f"stub_{name}", ladder.stub(name))


def _verdict(capsys) -> str:
    return capsys.readouterr().out.strip()


# ------------------------------------------------------------------------------ the ladder's shape
def test_every_kernel_lesson_has_a_ladder_of_growing_puzzles():
    books = ladder.by_notebook()
    assert len(ladder.PUZZLES) >= 12
    for nb in KERNEL_LESSONS:
        assert 2 <= len(books.get(nb, [])) <= 5, (nb, books.get(nb))
    assert "02_moe_sharding" in books
    for nb, names in books.items():
        steps = [ladder.PUZZLES[n].step for n in names]
        assert steps == list(range(1, len(names) + 1)), (nb, steps)
        minutes = [ladder.PUZZLES[n].minutes for n in names]
        assert minutes[-1] >= minutes[0], (nb, minutes)  # growing: the last rung is not the smallest


@pytest.mark.parametrize("name", NAMES)
def test_cells_are_the_stub_and_a_check_of_its_kernel(name):
    statement, stub, check = ladder.cells(name)
    p = ladder.PUZZLES[name]
    assert statement.startswith("**Ladder ") and len(statement) > 200
    assert stub.startswith(ladder.IMPORTS) and f"def {p.kernel_name}(" in stub and "TODO" in stub
    assert f"def {p.wrapper.__name__}(kernel, " in stub  # the complete wrapper, as the grader runs it
    assert check.endswith(f'ladder.check("{name}", {p.kernel_name});')
    assert "k3lab" not in stub  # the stub cell stands on its own: torch, triton, triton.language


def test_cases_are_fresh_and_never_zero():
    for name, p in ladder.PUZZLES.items():
        a, b = p.cases(0, "cpu"), p.cases(1, "cpu")
        assert len(a) >= 4, name
        for c in a:
            for k, v in c.inputs.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():  # zeros only where a piece is empty
                    assert bool((v != 0).any()) or "empty" in c.label, (name, c.label, k)
        assert any(str(x.inputs) != str(y.inputs) for x, y in zip(a, b)), f"{name}: the seed changes nothing"


# ------------------------------------------------------------------------------ refused without a launch
def plain_torch_lse(x):
    return torch.logsumexp(x.float(), dim=-1)


@pytest.mark.parametrize("fake", [plain_torch_lse, lambda x: x, "row_lse_kernel", None])
def test_a_plain_function_is_refused_as_no_triton_kernel_launched(fake, capsys):
    assert ladder.check("row_lse", fake) is False
    out = _verdict(capsys)
    assert out.startswith("row_lse, graded your kernel (")
    assert "not solved yet: no Triton kernel launched" in out
    assert len(out.splitlines()) == 1 and "Traceback" not in out


def test_unknown_names_and_seeds_are_the_notebooks_mistake():
    with pytest.raises(ValueError, match="name must be one of the ladder's puzzles"):
        ladder.check("no_such_puzzle", plain_torch_lse)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        ladder.check("row_lse", plain_torch_lse, seed=-1)
    with pytest.raises(ValueError, match="notebook must be one of"):
        ladder.ladder("06_draft_depth")


def test_a_launch_over_no_programs_is_not_a_launch():
    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for grid, counted in (((0,), 0), ((4, 0), 0), ((3,), 1), ((2, 2), 1)):
        c = _grade._Counted(Kernel())
        c[grid]()
        assert c.launches == counted, grid


# ------------------------------------------------------------------------------ interpreted (CPU)
@on_a_cpu
@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(name, capsys):
    assert ladder.check(name, ladder.solution(name)) is True
    out = _verdict(capsys)
    assert out.startswith(f"{name}, graded the solution, not your kernel (in Triton's interpreter"), out
    assert ": pass (" in out


@on_a_cpu
@pytest.mark.parametrize("name", NAMES)
def test_stub_runs_and_is_not_solved(name, tmp_path, capsys):
    p = ladder.PUZZLES[name]
    cell = _stub_cell(tmp_path, name)
    kernel = getattr(cell, p.kernel_name)
    getattr(cell, p.wrapper.__name__)(kernel, **p.cases(0, "cpu")[0].inputs)  # the cell's own wrapper runs it
    assert ladder.check(name, kernel) is False
    out = _verdict(capsys)
    assert out.startswith(f"{name}, graded your kernel (in Triton's interpreter on the CPU): not solved yet: "
                          "case 1 of "), out
    assert len(out.splitlines()) == 1 and ladder.CONTINUE in out  # wrong numbers, not an error


@on_a_cpu
def test_the_solutions_setting_grades_the_solutions(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_ENV, "solutions")
    assert ladder.check("merge_two", plain_torch_lse) is True  # the learner's argument is not graded
    out = _verdict(capsys)
    assert out.startswith("merge_two, graded the solution (K3LAB_WORKSHOP_GRADE=solutions, in Triton's "
                          "interpreter on the CPU): pass ("), out


@on_a_cpu
def test_a_failing_solution_under_the_solutions_setting_raises(monkeypatch):
    p = ladder.PUZZLES["row_lse"]
    broken = ladder.Puzzle(**{**p.__dict__, "name": "row_lse_broken", "reference": lambda case: torch.zeros(
        case.inputs["x"].shape[0], dtype=torch.float64) + 1.0})
    monkeypatch.setitem(ladder.PUZZLES, "row_lse_broken", broken)
    monkeypatch.setenv(grading.GRADE_ENV, "solutions")
    with pytest.raises(ladder.SolutionFailed, match="row_lse_broken, graded the solution .*FAILED: case 1"):
        ladder.check("row_lse_broken", None)


BROKEN = '''\
import triton
import triton.language as tl


@triton.jit
def shift(x):
    return x + not_defined_anywhere


@triton.jit
def row_lse_kernel(x_ptr, lse_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=float("-inf"))
    tl.store(lse_ptr + row, shift(tl.max(x, axis=0)))


@triton.jit
def row_lse_no_mask(x_ptr, lse_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0)
    tl.store(lse_ptr + row + cols, x)


@triton.jit
def row_lse_runtime_loop(x_ptr, lse_ptr, N, BLOCK: tl.constexpr):
    acc = 0.0
    for i in range(0, N):
        acc += tl.load(x_ptr + tl.program_id(0) * N + i)
    tl.store(lse_ptr + tl.program_id(0), acc)
'''


@on_a_cpu
def test_a_failing_kernel_shows_its_whole_error_and_the_learners_lines(tmp_path, capsys):
    mod = _load(tmp_path, "broken_kernels", BROKEN)
    assert ladder.check("row_lse", mod.row_lse_kernel) is False
    out = _verdict(capsys)
    lines = out.splitlines()
    assert lines[0].startswith("row_lse, graded your kernel (in Triton's interpreter on the CPU): not solved "
                               "yet: case 1 of 4") and lines[0].endswith("The whole error:")
    assert "NameError: name 'not_defined_anywhere' is not defined" in out
    assert "line 15 of row_lse_kernel: tl.store(lse_ptr + row, shift(tl.max(x, axis=0)))" in out
    assert "line 7 of shift: return x + not_defined_anywhere" in out
    assert "Traceback" not in out


@on_a_cpu
def test_a_store_outside_every_tensor_is_stopped_at_its_line(tmp_path, capsys):
    mod = _load(tmp_path, "oob_kernels", BROKEN)
    assert ladder.check("row_lse", mod.row_lse_no_mask) is False
    out = _verdict(capsys)
    assert "OutOfBounds: a store reaches outside every tensor argument" in out
    assert "past the end of lse_ptr" in out
    assert "line 23 of row_lse_no_mask: tl.store(lse_ptr + row + cols, x)" in out
    # after the check, the interpreter's builder and the kernel's hooks are as they were
    from triton.runtime.interpreter import InterpreterBuilder
    assert InterpreterBuilder.create_masked_store.__qualname__ == "InterpreterBuilder.create_masked_store"
    assert mod.row_lse_no_mask.pre_run_hooks == []


@on_a_cpu
def test_a_loop_to_a_runtime_bound_gets_the_interpreter_hint(tmp_path, capsys):
    mod = _load(tmp_path, "loop_kernels", BROKEN)
    assert ladder.check("row_lse", mod.row_lse_runtime_loop) is False
    out = _verdict(capsys)
    if _grade.RUNTIME_BOUND not in out:
        pytest.skip("this numpy converts a 1-element array to an int: the interpreter runs such loops")
    assert _grade.RUNTIME_BOUND_HINT in out


WRONG = '''\
import triton
import triton.language as tl


@triton.jit
def row_lse_no_max(x_ptr, lse_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
    tl.store(lse_ptr + row, tl.log(tl.sum(tl.exp(x), axis=0)))


@triton.jit
def compose_swapped(a1_ptr, b1_ptr, a2_ptr, b2_ptr, m_ptr, b_ptr, K: tl.constexpr, V: tl.constexpr):
    i = tl.program_id(0)
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    kk = i * K * K + rk[:, None] * K + rk[None, :]
    kv = i * K * V + rk[:, None] * V + rv[None, :]
    a1 = tl.load(a1_ptr + kk)
    a2 = tl.load(a2_ptr + kk)
    b1 = tl.load(b1_ptr + kv)
    b2 = tl.load(b2_ptr + kv)
    tl.store(m_ptr + kk, tl.dot(a1, a2).to(m_ptr.dtype.element_ty))
    tl.store(b_ptr + kv, (tl.dot(a1, b2) + b1.to(tl.float32)).to(b_ptr.dtype.element_ty))


@triton.jit
def rms_over_block(x_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK + eps)
    tl.store(out_ptr + row * D + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
'''


@on_a_cpu
@pytest.mark.parametrize("puzzle, kernel, case", [
    ("row_lse", "row_lse_no_max", "scores near 120"),     # exp before the max: overflows fp32
    ("compose_maps", "compose_swapped", "case 1 of 4"),   # the second map applied first
    ("row_rms", "rms_over_block", "D = 100"),             # the mean over the padded block, not over D
])
def test_plausible_wrong_kernels_fail_on_the_case_that_names_the_pitfall(puzzle, kernel, case, tmp_path,
                                                                          capsys):
    mod = _load(tmp_path, "wrong_kernels", WRONG)
    assert ladder.check(puzzle, getattr(mod, kernel)) is False
    out = _verdict(capsys)
    assert "not solved yet" in out and case in out and len(out.splitlines()) == 1, out


@on_a_cpu
def test_show_draws_which_program_touched_each_element(tmp_path, capsys):
    assert ladder.show("exp_shift") is None
    text = _verdict(capsys)
    assert "out_ptr: [1000] float32: loaded 0 of 1000, stored 1000 of 1000" in text
    assert "    " + "7" * 64 in text  # program 7 stores its block
    cell = _stub_cell(tmp_path, "exp_shift")
    ladder.show("exp_shift", cell.exp_shift_kernel)  # the stub: every program writes block 0
    text = _verdict(capsys)
    assert "stored 128 of 1000; 128 element(s) stored more than once" in text
    assert "    " + "*" * 64 in text
    ladder.show("column_add")
    assert "    " + "." * 16 + "0" * 16 + "." * 32 in _verdict(capsys)  # row 0 of out: its columns only


def test_show_refuses_what_it_cannot_draw(capsys):
    ladder.show("row_lse", plain_torch_lse)
    assert "show takes the @triton.jit kernel (row_lse_kernel)" in _verdict(capsys)


# ------------------------------------------------------------------------------ compiled for a GPU
def test_a_compile_error_from_the_gpu_compiler_is_shown_whole(tmp_path):
    """Triton's NVIDIA compiler, run on this CPU (no driver needed), on a kernel whose tl.dot cannot
    compile: the learner's line shows the whole CompilationError (source excerpt, caret and message),
    not its first line."""
    (tmp_path / "bad_dot.py").write_text(textwrap.dedent('''\
        import triton
        import triton.language as tl


        @triton.jit
        def row_lse_kernel(x_ptr, lse_ptr, N, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0)
            y = tl.dot(x, x)
            tl.store(lse_ptr + row, tl.max(y, axis=0))
        '''))
    script = textwrap.dedent(f'''\
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from k3lab.isa.capture import capture, compile_kernel, compile_spec
        from k3lab.isa.targets import TARGETS
        from k3lab.workshop import ladder
        from k3lab.workshop.ladder import _grade
        import bad_dot
        p = ladder.PUZZLES["row_lse"]
        launches = []
        with capture(launches):
            p.wrapper(bad_dot.row_lse_kernel, **p.cases(0, "cpu")[0].inputs)
        try:
            compile_kernel(compile_spec(launches[0], TARGETS["sm90"]), TARGETS["sm90"])
        except Exception as exc:
            print("RAW", repr(str(exc)))
            print(_grade._failed_launch(exc))
        ''')
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    raw_line, _, shown = done.stdout.partition("\n")
    raw = eval(raw_line.removeprefix("RAW "))  # noqa: S307 - the repr of a str printed just above
    assert len(raw.splitlines()) >= 4, raw  # a real multi-line compile error
    assert shown.startswith("your kernel did not compile:"), shown
    for line in raw.splitlines():
        assert line.rstrip() in shown, (line, shown)


def test_importing_triton_before_k3lab_is_explained():
    """The interpreter is chosen when triton is imported: a notebook that imported triton first cannot run
    tl.max in the interpreter, and the check says what to do instead of failing in Triton's internals."""
    script = textwrap.dedent('''\
        import triton
        import triton.language as tl
        from k3lab.workshop import ladder
        ladder.check("row_lse", ladder.solution("row_lse"))
        ''')
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    env.pop(grading.GRADE_ENV, None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "triton was imported before its interpreter was switched on" in done.stdout, done.stdout


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA or ROCm device")


@pytest.mark.gpu
@gpu
def test_on_the_gpu_solutions_pass_and_stubs_are_not_solved_compiled(tmp_path, capsys):
    for name in NAMES:
        p = ladder.PUZZLES[name]
        assert ladder.check(name, p.solution) is True, _verdict(capsys)
        assert "compiled for" in _verdict(capsys)
        assert ladder.check(name, getattr(_stub_cell(tmp_path, name), p.kernel_name)) is False
        out = _verdict(capsys)
        assert "not solved yet: case 1 of" in out and len(out.splitlines()) == 1, out


@pytest.mark.gpu
@gpu
def test_on_the_gpu_a_compile_error_is_shown_whole(tmp_path, capsys):
    mod = _load(tmp_path, "gpu_bad", BROKEN.replace("return x + not_defined_anywhere", "return tl.dot(x, x)"))
    assert ladder.check("row_lse", mod.row_lse_kernel) is False
    out = _verdict(capsys)
    assert "your kernel did not compile" in out and out.splitlines()[0].endswith("The whole error:")
    assert "^" in out and len(out.splitlines()) >= 5, out  # the source excerpt and its caret came along

