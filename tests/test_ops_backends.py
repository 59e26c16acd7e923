"""k3lab.ops' one backend contract, checked over every op: a `BACKENDS` table of `Backend` rows, one
chooser answering (name, why), forcing by argument and by K3LAB_<OP>_BACKEND, a bad name refused by the
argument's or the variable's name, `backend=` on every public entry point, and no op reading the
environment itself."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import ops
from k3lab.ops import Backend, BackendUnavailable, Backends

OPS_DIR = Path(ops.__file__).parent
HELPERS = {"_build", "triton_math"}  # shared pieces, not ops with backends
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _op_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(OPS_DIR)]) if m.name not in HELPERS)


def _kda(T=3, H=1, V=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    q = torch.nn.functional.normalize(r(1, T, H, 128), dim=-1)
    k = torch.nn.functional.normalize(r(1, T, H, 128), dim=-1)
    return q, k, r(1, T, H, V), -torch.rand(1, T, H, 128, generator=g).to(DEV), torch.rand(1, T, H,
                                                                                          generator=g).to(DEV)


def _inputs(name: str) -> tuple:
    """What `BACKENDS.choose` verifies for one small call of op `name` on this machine's tensors."""
    if name in ("gemv",):
        return (DEV,)
    if name == "packed_matmul":
        return ()
    if name == "mla_glue":
        return (DEV,)
    if name in ("situ_glu", "moe_experts", "kda_decode"):
        return (DEV, torch.float32)
    if name == "moe_router":
        return (DEV, 4, 2, torch.float32)
    if name == "attn_res_norm":
        return (torch.randn(2, 64, device=DEV), None, torch.randn(3, 2, 64, device=DEV), 2)
    if name == "kda_chunk":
        from k3lab.ops import kda_chunk

        return (*_kda(70), kda_chunk.make_plan([70], 1, device=DEV))
    if name == "kda_verify":
        q, k, v, g, beta = _kda(3, V=16)
        return (q, k, v, g, beta, torch.zeros(1, 1, 128, 16, device=DEV), 8)
    if name == "mla_decode":
        return ("after", torch.randn(1, 1, 12, 576, device=DEV), torch.randn(1, 32, 576, device=DEV),
                torch.tensor([32], device=DEV))
    raise AssertionError(f"no sample inputs for op {name!r}: add them here")


@pytest.mark.parametrize("name", _op_names())
def test_every_op_has_one_table_of_the_one_type(name):
    mod = importlib.import_module(f"k3lab.ops.{name}")
    table = mod.BACKENDS
    assert isinstance(table, Backends) and table.op == name
    assert all(type(b) is Backend for b in table) and len(table) >= 2
    assert mod.BACKEND_ENV == table.env == f"K3LAB_{name.upper()}_BACKEND"
    for b_name, (ok, why) in table.status().items():
        assert b_name in table and isinstance(ok, bool) and isinstance(why, str) and why, (b_name, why)


@pytest.mark.parametrize("name", _op_names())
def test_chooser_answers_name_and_why_and_forcing_works(name, monkeypatch):
    table = importlib.import_module(f"k3lab.ops.{name}").BACKENDS
    monkeypatch.delenv(table.env, raising=False)
    args = _inputs(name)
    chosen, why = table.choose(None, *args)
    assert chosen in table and isinstance(why, str)
    runs = [b.name for b in table if table.check(b.name, *args)[0]]
    assert chosen in runs
    for forced in runs:  # by argument, and by the variable; the argument wins over the variable
        assert table.choose(forced, *args)[0] == forced
        monkeypatch.setenv(table.env, forced)
        assert table.choose(None, *args)[0] == forced
        other = next(n for n in runs if n != forced) if len(runs) > 1 else forced
        assert table.choose(other, *args)[0] == other
        monkeypatch.delenv(table.env)
    for refused in (b.name for b in table if b.name not in runs):  # a forced one that cannot run: why
        with pytest.raises(BackendUnavailable, match=f"backend={refused!r} cannot run here: ."):
            table.choose(refused, *args)
        monkeypatch.setenv(table.env, refused)
        with pytest.raises(ValueError, match=f"{table.env}={refused!r} cannot run here"):
            table.choose(None, *args)
        monkeypatch.delenv(table.env)


@pytest.mark.parametrize("name", _op_names())
def test_a_bad_name_is_refused_by_the_argument_or_the_variable(name, monkeypatch):
    table = importlib.import_module(f"k3lab.ops.{name}").BACKENDS
    monkeypatch.delenv(table.env, raising=False)
    with pytest.raises(ValueError, match="^backend must be one of"):
        table.choose("no_such_backend", *_inputs(name))
    with pytest.raises(ValueError, match="^experts_backend must be one of"):
        table.choose("no_such_backend", *_inputs(name), arg="experts_backend")
    monkeypatch.setenv(table.env, "no_such_backend")
    with pytest.raises(ValueError, match=f"^{table.env} must be one of"):
        table.choose(None, *_inputs(name))


def test_priority_and_verifier_decide_and_none_running_says_why_for_each():
    calls = []
    table = Backends("toy",
                     Backend("fast", lambda n: 0 if n > 1 else 2, lambda: (True, "here"),
                             lambda n: (n < 10, "" if n < 10 else "takes fewer than 10")),
                     Backend("plain", 1, lambda: (True, "always"), lambda n: calls.append(n) or (True, "")))
    assert table.choose(None, 5) == ("fast", "here")
    assert table.choose(None, 1)[0] == "plain"  # the priority follows the inputs
    name, why = table.choose(None, 20)
    assert name == "plain" and "fast: takes fewer than 10" in why
    with pytest.raises(BackendUnavailable, match="takes fewer than 10"):
        table.choose("fast", 20)
    broken = Backends("toy", Backend("a", 0, lambda: (False, "not built")),
                      Backend("b", 1, lambda: (False, "no GPU")))
    with pytest.raises(BackendUnavailable, match="no toy backend runs here: a: not built; b: no GPU"):
        broken.choose()
    with pytest.raises(ValueError, match="distinct names"):
        Backends("toy", Backend("a", 0, lambda: (True, "")), Backend("a", 1, lambda: (True, "")))


# public entry points: each takes backend= (none takes impl= or kernel= for its backend)
ENTRY_POINTS = {
    "gemv": ["gemv"], "situ_glu": ["situ_glu_stacked"],
    "moe_experts": ["routed_experts", "latent_tail", "mxfp4_routed_experts"],
    "moe_router": ["route_and_sort"], "attn_res_norm": ["after"],
    "kda_chunk": ["kda_chunk", "kda_chunk_before", "kda_chunk_after", "kda_chunk_prologue", "after_launches"],
    "kda_verify": ["kda_verify"], "kda_decode": ["kda_decode", "KDADecodeStep"],
    "mla_decode": ["plan_before", "plan_after", "mla_decode_before", "mla_decode_after"],
    "mla_glue": ["mla_norms", "mla_absorb_q", "mla_out_gate"], "packed_matmul": ["packed_linear"],
}


def test_every_public_op_takes_backend():
    assert sorted(ENTRY_POINTS) == _op_names()
    for name, fns in ENTRY_POINTS.items():
        mod = importlib.import_module(f"k3lab.ops.{name}")
        for fn in fns:
            params = inspect.signature(getattr(mod, fn)).parameters
            assert "backend" in params and not {"impl", "kernel"} & set(params), (name, fn, list(params))


def test_only_ops_init_reads_the_environment_and_nobody_reads_triton_interpret():
    for path in OPS_DIR.rglob("*.py"):
        if path != OPS_DIR / "__init__.py":
            assert "os.environ" not in path.read_text(), path
    pattern = re.compile(r"environ(\.get)?\(?\[?\s*[\"']TRITON_INTERPRET")
    for path in Path(k3lab.__file__).parent.rglob("*.py"):
        if path.name != "env.py" and path != Path(k3lab.__file__):
            assert not pattern.search(path.read_text()), f"{path}: use env.triton_interpreted()"


# ------------------------------------------------------------------ rows carry callables; faces call them

def _toy_rows():
    ref = lambda x: ("ref", x)  # noqa: E731
    return Backends("toy",
                    Backend("fast", 0, lambda: (True, "fast here"), parts={"after": lambda x: ("fast", x)}),
                    Backend("slow", 1, lambda: (True, "slow here"), parts={"before": lambda x: ("slow", x)}),
                    Backend("torch", 2, lambda: (True, "reference"), parts={"before": ref, "after": ref}))


def test_a_row_is_picked_by_the_callable_it_must_provide(monkeypatch):
    table = _toy_rows()
    monkeypatch.delenv(table.env, raising=False)
    assert table.pick(need="after").after(1) == ("fast", 1)
    assert table.pick(need="before").before(2) == ("slow", 2)  # 'fast' has no before: skipped
    row, why = table.select(need="before")
    assert row.name == "slow" and why == "slow here"
    assert table.choose(None, need="after") == ("fast", "fast here")
    with pytest.raises(BackendUnavailable, match="backend='fast' cannot run here: backend 'fast' provides no "
                                                 "before"):
        table.pick("fast", need="before")
    with pytest.raises(AttributeError, match="provides no 'before'"):
        table["fast"].before  # noqa: B018
    monkeypatch.setenv(table.env, "torch")  # the variable forces the rows that provide the callable
    assert table.pick(need="after").after(3) == ("ref", 3)
    monkeypatch.setenv(table.env, "fast")  # ... and forces nothing for one its row lacks
    assert table.pick(need="before").before(4) == ("slow", 4)
    with pytest.raises(BackendUnavailable, match="no toy backend provides plan_after and runs here"):
        table.pick(need="plan_after")


@pytest.mark.parametrize("name", _op_names())
def test_every_rows_callables_are_named_in_the_one_vocabulary(name):
    """Each row carries callables; a reference row named 'torch' carries before and after alike."""
    table = importlib.import_module(f"k3lab.ops.{name}").BACKENDS
    for row in table:
        assert row.parts and all(callable(f) for f in row.parts.values()), (name, row.name)
        if row.name == "torch" and "after" in row.parts:
            assert row.parts["before"] is row.parts["after"], name


ENGINE_DIR = OPS_DIR.parent / "engine"
NAMES = {b.name for op in _op_names() for b in importlib.import_module(f"k3lab.ops.{op}").BACKENDS} | {
    "before", "after"}  # every row's name, and the two sides of every op
# where a name is compared on purpose, not to choose: peers.require_lse refuses a *forced* 'aiter' for
# callers that merge by lse (its decode writes none)
ALLOWED = {("ops/mla_decode/peers.py", "require_lse")}


def _name_comparisons(path: Path, root: Path = OPS_DIR.parent, allowed=ALLOWED) -> list[str]:
    """`path`'s comparisons of a backend's or a side's name (x == "torch", x in ("a", "b"); not "a" in
    parts), outside ALLOWED; devices and platforms (x.type, detect(), info.backend) are not names."""
    import ast

    text = path.read_text()
    tree = ast.parse(text)
    funcs = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    rel = path.relative_to(root).as_posix()
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        left = ast.get_source_segment(text, node.left) or ""
        if left.endswith(".type") or "detect()" in left or left == "info.backend":  # devices, platforms
            continue
        lits = []
        member = isinstance(node.ops[0], (ast.In, ast.NotIn))
        sides = node.comparators if member else (node.left, *node.comparators)
        for side in sides:
            elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            lits += [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if NAMES & set(lits):
            inside = {f for a, b, f in funcs if a <= node.lineno <= b}
            if not any((rel, f) in allowed for f in inside):
                hits.append(f"{rel}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return hits


def test_no_op_or_engine_compares_backend_or_variant_names():
    """A face calls the row it picked, and the step the rows `resolve` bound: no comparison of a
    backend's or a side's name in k3lab/ops or k3lab/engine."""
    paths = sorted([*OPS_DIR.rglob("*.py"), *ENGINE_DIR.rglob("*.py")])
    assert any(p.parent == ENGINE_DIR for p in paths) and any(p.parent.name == "moe_experts" for p in paths)
    hits = [h for path in paths for h in _name_comparisons(path)]
    assert not hits, hits


def test_the_name_scan_catches_a_planted_comparison(tmp_path):
    """The scan can fail: the form string the engine once branched on, planted in a copy of engine/rows.py
    (and a comparison with a row's name), is found; in an allowed function it is not."""
    text = (ENGINE_DIR / "rows.py").read_text() + (
        '\n\ndef experts_by_form(form):\n    if form == "torch":\n        return None\n'
        '    return {"gemv": 1}[form]\n\n\ndef loop_row(row):\n    return row.name in ("mxfp4_torch",)\n')
    copy = tmp_path / "engine" / "rows.py"
    copy.parent.mkdir()
    copy.write_text(text)
    found = [h.split(": ", 1)[1] for h in _name_comparisons(copy, tmp_path)]
    assert found == ['form == "torch"', 'row.name in ("mxfp4_torch",)'], found
    allowed = ALLOWED | {("engine/rows.py", "experts_by_form")}
    assert [h.split(": ", 1)[1] for h in _name_comparisons(copy, tmp_path, allowed)] == [
        'row.name in ("mxfp4_torch",)']


def test_expect_names_the_argument_and_what_was_expected():
    t = torch.zeros(2, 3, dtype=torch.float16)
    assert ops.expect("x", t, shape=(2, None), dtype=(torch.float16, torch.float32), device="cpu",
                      contiguous=True) is t
    cases = [
        (dict(t=[1.0]), r"^x must be a torch.Tensor \[N, D\], got list$", {"what": "[N, D]"}),
        (dict(t=t), r"^x must be a 3-D tensor, got shape \(2, 3\)$", {"shape": 3}),
        (dict(t=t), r"^x must be \[2, 4\], got \(2, 3\)$", {"shape": (2, 4)}),
        (dict(t=t), r"^x must be \[\*, 3, \*\], got \(2, 3\)$", {"shape": (None, 3, None)}),
        (dict(t=t), r"^x must be bfloat16 or float32, got torch.float16$",
         {"dtype": (torch.bfloat16, torch.float32)}),
        (dict(t=t), r"^x must be on meta, got cpu$", {"device": "meta"}),
        (dict(t=t.int()), r"^x must be a floating-point tensor, got torch.int32$", {"dtype": "float"}),
        (dict(t=t.t()), r"^x must be contiguous, got strides \(1, 3\)", {"contiguous": True}),
        (dict(t=t.t()), r"^x must have a stride-1 last dim, got strides \(1, 3\)$", {"contiguous": "last"}),
    ]
    for arg, pattern, kw in cases:
        with pytest.raises(ValueError, match=pattern):
            ops.expect("x", arg["t"], **kw)
    with pytest.raises(TypeError, match="^y must be a torch.Tensor, got int$"):  # the wrong type
        ops.expect("y", 3)
    with pytest.raises(ValueError, match="^y must be a torch.Tensor"):  # and still a refused argument
        ops.expect("y", None, shape=2)
    assert ops.expect("x", t[:, :1].t().t(), contiguous="last") is not None  # a size-1 last dim passes
    assert ops.expect("x", t.to(torch.float8_e4m3fn), dtype="float") is not None
