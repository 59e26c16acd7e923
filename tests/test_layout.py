"""The room rules of k3lab's layout, read from the imports of every module (ast, relative imports resolved;
imports inside functions count as much as those at the top).

A room is a top-level package or module of k3lab (`ops`, `engine`, `bench`, `runtime`, `config`, ...).
The rules:
- nn/ never imports ops/: the references stay independent of the kernels they check.
- runtime/ (checking a result, capturing a graph) imports no other room, so every room may import it.
- bench/ (timing, floors, records) is the measuring harness: it imports only env, files and runtime, never
  a study, an op or the engine.
- The rooms that run a model (nn, ops, engine, parallel, runtime) never import bench/ or studies/: what
  they need while they run (check, capture_graph) lives in runtime/, and measuring code lives in studies/.
- ops/ never imports engine/: a kernel and the formats it reads (the MXFP4 weights, for one) sit below the
  step that composes them, so an op is usable, tested and compiled without the engine.
- No library room (the running rooms, and config, env, files, model, agentx, cache, speculative, serving)
  imports studies/: studies/ composes the library, never the other way; serving/ reads its records itself.
Every study of k3lab.studies.STUDIES and PROBES is a package of one shape: a folder holding `__init__.py`,
`measure.py` and `tables.py` (k3lab.studies' docstring says what each holds).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "k3lab"

RUNNING = ("nn", "ops", "engine", "parallel", "runtime")
# the rooms studies/ composes; isa/, profiling/, workshop/, report/, optimizations and cli sit beside or
# above studies/ and may call a study
LIBRARY = (*RUNNING, "config", "env", "files", "model", "agentx", "cache", "speculative", "serving")
# room -> the rooms it must not import
FORBIDDEN = {room: {"studies"} for room in LIBRARY}
for room in RUNNING:
    FORBIDDEN[room] |= {"bench"}
FORBIDDEN["nn"] |= {"ops"}
FORBIDDEN["ops"] |= {"engine"}
# room -> the only rooms it may import
ALLOWED = {
    "runtime": set(),
    "bench": {"env", "files", "runtime"},
}


def room_of(path: str) -> str:
    """'k3lab/ops/mla_decode/triton.py' -> 'ops'; 'k3lab/config.py' -> 'config'."""
    parts = Path(path).with_suffix("").parts
    return parts[1] if len(parts) > 1 else parts[0]


def imported_rooms(path: str, source: str) -> set[str]:
    """The k3lab rooms that `source` (the text of the module at `path`, relative to the repository)
    imports, relative imports resolved against the module's package."""
    here = list(Path(path).with_suffix("").parts)
    package = here if here[-1] == "__init__" else here[:-1]
    if package and package[-1] == "__init__":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            # `from k3lab import bench`, `from . import checks`: the names may be rooms themselves
            names = [module] if node.module and module != "k3lab" else []
            names += [f"{module}.{a.name}" for a in node.names if not node.module or module == "k3lab"]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "k3lab" and len(parts) > 1:
                found.add(parts[1])
    return found - {room_of(path)}


def broken_rules(files: dict[str, str]) -> list[tuple[str, str, str]]:
    """(file, imported room, rule) for each import that breaks a room rule (module docstring)."""
    broken = []
    for path, source in files.items():
        room = room_of(path)
        for target in sorted(imported_rooms(path, source)):
            if target in FORBIDDEN.get(room, set()):
                broken.append((path, target, f"{room}/ never imports {target}/"))
            elif room in ALLOWED and target not in ALLOWED[room]:
                allowed = ", ".join(sorted(ALLOWED[room]))
                broken.append((path, target, f"{room}/ imports only {allowed}" if allowed else
                               f"{room}/ imports no other room"))
    return broken


def sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_room_keeps_its_rules():
    files = sources()
    assert len(files) > 100 and "k3lab/runtime/__init__.py" in files
    broken = broken_rules(files)
    assert not broken, "imports that break a room rule:\n" + "\n".join(f"{f}: imports {t}: {why}"
                                                                         for f, t, why in broken)


def test_a_broken_rule_is_found():
    # the rules above must be able to fail, for each way of writing an import
    files = {
        "k3lab/nn/x.py": "from k3lab.ops import mla_decode\n",
        "k3lab/engine/y.py": "def f():\n    from k3lab import bench\n",
        "k3lab/parallel/z.py": "import k3lab.studies.dcp\n",
        "k3lab/runtime/w.py": "from k3lab.env import detect\nfrom . import checks\n",
        "k3lab/bench/v.py": "from ..ops import m\nfrom .timing import f\nfrom k3lab import runtime\n",
        "k3lab/ops/fine.py": "from k3lab import runtime\nfrom k3lab.nn import mla\nfrom .inputs import x\n",
        "k3lab/ops/moe_experts/u.py": "from k3lab.engine.mxfp4 import Mxfp4Weight\n",
        "k3lab/ops/t.py": "def f():\n    from ..engine import rows\n",
        "k3lab/serving/s.py": "def f():\n    from k3lab.studies.serving import inputs\n",
        "k3lab/cache/r.py": "from ..studies import agent_cache\n",
        "k3lab/config.py": "import k3lab.studies\n",
        "k3lab/engine/fine.py": "from k3lab.ops.moe_experts import mxfp4\nfrom k3lab import serving\n",
        "k3lab/report/fine.py": "from k3lab.studies import load_study\nfrom k3lab.engine import rows\n",
    }
    assert broken_rules(files) == [
        ("k3lab/nn/x.py", "ops", "nn/ never imports ops/"),
        ("k3lab/engine/y.py", "bench", "engine/ never imports bench/"),
        ("k3lab/parallel/z.py", "studies", "parallel/ never imports studies/"),
        ("k3lab/runtime/w.py", "env", "runtime/ imports no other room"),
        ("k3lab/bench/v.py", "ops", "bench/ imports only env, files, runtime"),
        ("k3lab/ops/moe_experts/u.py", "engine", "ops/ never imports engine/"),
        ("k3lab/ops/t.py", "engine", "ops/ never imports engine/"),
        ("k3lab/serving/s.py", "studies", "serving/ never imports studies/"),
        ("k3lab/cache/r.py", "studies", "cache/ never imports studies/"),
        ("k3lab/config.py", "studies", "config/ never imports studies/"),
    ]


def test_relative_imports_resolve_to_their_room():
    assert imported_rooms("k3lab/ops/mla_decode/__init__.py", "from ..situ_glu import f\n") == set()
    assert imported_rooms("k3lab/ops/mla_decode/__init__.py", "from ...config import C\n") == {"config"}
    assert imported_rooms("k3lab/ops/mla_decode/triton.py", "from ...engine import rows\n") == {"engine"}
    assert imported_rooms("k3lab/studies/dcp/measure.py", "from .cases import c\n") == set()


def test_bench_names_runtimes_checks_and_capture():
    # the measuring API includes checking a result: the studies, tests and notebooks reach runtime's own
    # objects through bench, not copies of them
    from k3lab import bench, runtime

    names = ("check", "check_all", "TOLERANCES", "Tolerance", "CheckFailed", "tolerance_for", "capture_graph")
    assert all(getattr(bench, n) is getattr(runtime, n) for n in names)
    assert set(names) <= set(bench.__all__) and set(names) <= set(runtime.__all__)


STUDY_FILES = ("__init__.py", "measure.py", "tables.py")


def study_shape_problems(studies: dict[str, str], root: Path = REPO) -> list[str]:
    """What keeps each study of `studies` (name -> module path, as k3lab.studies.STUDIES) from the package
    shape, under the tree at `root`: a single module, a missing folder, or a folder lacking STUDY_FILES."""
    out = []
    for name, module in studies.items():
        folder = root.joinpath(*module.split("."))
        if not folder.is_dir():
            single = folder.with_suffix(".py").relative_to(root)
            out.append(f"{name}: {single} is a single module, not a package" if (root / single).is_file()
                       else f"{name}: no folder {folder.relative_to(root)}")
            continue
        missing = [f for f in STUDY_FILES if not (folder / f).is_file()]
        if missing:
            out.append(f"{name}: {folder.relative_to(root)} lacks {', '.join(missing)}")
    return out


def _studies() -> dict[str, str]:
    from k3lab.studies import PROBES, STUDIES

    return {**STUDIES, **PROBES}


@pytest.mark.parametrize("name", list(_studies()))
def test_every_study_is_a_package_of_one_shape(name):
    assert study_shape_problems({name: _studies()[name]}) == []


def _probes() -> dict[str, str]:
    from k3lab.studies import PROBES

    return PROBES


@pytest.mark.parametrize("name", list(_probes()))
def test_every_probe_keeps_the_study_contract(name):
    # the report's studies are held to it by k3lab.studies.load_study; a probe, which the report does not
    # load, answers the same calls
    import importlib

    module = importlib.import_module(_probes()[name])
    assert [a for a in ("NAME", "case_names", "run", "profile_targets") if not hasattr(module, a)] == []
    assert module.NAME == name


def test_a_study_out_of_shape_is_found(tmp_path):
    # a single-file study, a package lacking tables.py, a registered study with nothing on disk, and one
    # in the shape, planted in a temporary tree
    studies = tmp_path / "k3lab" / "studies"
    (studies / "whole").mkdir(parents=True)
    for f in STUDY_FILES:
        (studies / "whole" / f).write_text("")
    (studies / "single.py").write_text("NAME = 'single'\n")
    (studies / "half").mkdir()
    for f in ("__init__.py", "measure.py"):
        (studies / "half" / f).write_text("")
    planted = {n: f"k3lab.studies.{n}" for n in ("whole", "single", "half", "absent")}
    assert study_shape_problems(planted, root=tmp_path) == [
        "single: k3lab/studies/single.py is a single module, not a package",
        "half: k3lab/studies/half lacks tables.py",
        "absent: no folder k3lab/studies/absent",
    ]
