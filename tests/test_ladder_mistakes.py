"""The usual mistake per ladder puzzle that docs/instructor.md names, written out: each is the puzzle's own
solution with one edit, and the check must say "not solved yet" on the case the guide names for it.
(row_lse, row_rms and compose_maps are in tests/test_ladder.py.) CPU only: the interpreter's bounds guard
is what stops the out-of-bounds mistakes with a message instead of a crash: on a GPU machine these run in a
child that sees no GPU (tests/cpu_child.py)."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton loads)
import pytest
from cpu_child import on_a_cpu

from k3lab.workshop import ladder

pytestmark = on_a_cpu

HEADER = "import triton\nimport triton.language as tl\n\n\n"

# puzzle: (edits to the solution's source (old, new), the case the guide names); HELPERS: the @triton.jit
# helpers a kernel calls, copied beside it (and edited with it)
MISTAKES = {
    "exp_shift": ([("tl.program_id(0) * BLOCK + ", "")], "n = 1000"),
    "merge_two": ([("tl.exp(l1 - m)", "tl.exp(l1)"), ("tl.exp(l2 - m)", "tl.exp(l2)"),
                   ("m + tl.log(s)", "tl.log(s)")], "scores near 100"),
    "merge_pieces": ([('other=float("-inf")', "other=0.0")], "N_PAD 4"),
    "column_add": ([("row * H + col0 + r", "row * H + r")], "TP4 rank 1"),
    "tail_row": ([("tl.sum(ss, axis=0) / LAT", "tl.sum(ss, axis=0) / BLOCK_K")], "LAT = 96"),
    "depth_mix": ([('logits = tl.where(i < S, logits, float("-inf"))', "")], "3 sources"),
    "attn_res_norm": ([("h = h * alpha + p * v", "h = h + p * v"), ("s = s * alpha + p", "s = s + p")],
                      "3 sources"),
    "dot16": ([("mask=(rm < M)[:, None], other=0.0)", ")")], "12 rows"),
    "tile_attention": ([('s = tl.where((pos < L)[None, :], s, float("-inf"))',
                         "s = tl.where((pos < L)[None, :], s, 0.0)")], "12 masked"),
    "online_softmax": ([("denom = denom * alpha + ", "denom = denom + "),
                        ("acc = acc * alpha[:, None] + ", "acc = acc + ")], "80 positions"),
    "padded_decode": ([("while n0 < length:", "while n0 < L:"),
                       ("pmask = (pos < length)", "pmask = (pos < L)"),
                       ("tl.where((pos < length)", "tl.where((pos < L)")], "two requests of 40 and 23"),
    "linear_scan": ([("return a_r * a_l, a_r * b_l + b_r", "return a_r * a_l, a_l * b_r + b_l")],
                    "3 rows of 64 steps"),
    "group_summaries": ([("end = tl.minimum(c + GROUP, n)", "end = c + GROUP")], "7 chunks in groups of 3"),
    "group_starts": ([("        tl.store(out_ptr + j * K * V + kv, S.to(out_ptr.dtype.element_ty))\n", ""),
                      ("tl.load(b_ptr + j * K * V + kv).to(tl.float32)\n",
                       "tl.load(b_ptr + j * K * V + kv).to(tl.float32)\n"
                       "        tl.store(out_ptr + j * K * V + kv, S.to(out_ptr.dtype.element_ty))\n")],
                     "7 chunks in groups of 3"),
}
HELPERS = {"linear_scan": ("_then",)}


def _source(fn) -> str:
    return inspect.getsource(getattr(fn, "fn", fn))


def _wrong_kernel(tmp_path: Path, name: str):
    edits, _ = MISTAKES[name]
    sol = ladder.solution(name)
    module = inspect.getmodule(getattr(sol, "fn", sol))
    source = "".join(_source(getattr(module, h)) + "\n\n" for h in HELPERS.get(name, ())) + _source(sol)
    for old, new in edits:
        assert source.count(old) == 1, f"{name}: the edit's text {old!r} is not once in the solution"
        source = source.replace(old, new)
    path = tmp_path / f"wrong_{name}.py"
    path.write_text(HEADER + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, getattr(sol, "fn", sol).__name__)


def test_every_puzzle_without_a_tested_mistake_has_one_here():
    tested_elsewhere = {"row_lse", "row_rms", "compose_maps"}
    assert set(MISTAKES) | tested_elsewhere == set(ladder.PUZZLES)


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_the_usual_mistake_fails_on_the_case_the_guide_names(name, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("K3LAB_WORKSHOP_GRADE", raising=False)
    kernel = _wrong_kernel(tmp_path, name)
    assert ladder.check(name, kernel) is False
    first = capsys.readouterr().out.strip().splitlines()[0]
    assert "not solved yet" in first and MISTAKES[name][1] in first, first
    guide = (Path(__file__).resolve().parent.parent / "docs" / "instructor.md").read_text()
    head = f"| {ladder.PUZZLES[name].notebook[:2]} | `{name}` |"
    row = next(line for line in guide.splitlines() if line.startswith(head))
    assert MISTAKES[name][1] in row, f"docs/instructor.md's row for {name} names another case: {row}"
