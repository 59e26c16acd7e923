"""Every import in k3lab's modules and notebooks resolves to a dependency pyproject.toml declares, so a
venv made from the declared dependencies alone runs them (a package that only happens to be installed
here, as scipy was, fails this test).

Each import is read with ast (code cells of the notebooks too, their IPython magics left out) and its
top-level module mapped to the distribution that provides it (importlib.metadata). It must be:
- the standard library, or k3lab itself;
- a distribution in [project].dependencies, by its canonical name;
- or optional, loaded only where it is asked for (inside a function, or in a try that catches
  ImportError): a distribution of an optional-dependencies extra, or one of OPTIONAL, named with what
  runs without it;
- or one of BY_DESIGN, undeclared on purpose for the reason given.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# optional packages no extra can install, with what runs without them
OPTIONAL = {
    "aiter": "AMD's kernel library (amd-aiter, built for the ROCm at hand, not on PyPI): without it the MLA "
             "decode peers leave it out and k3lab's own kernel runs (k3lab.ops.mla_decode.peers)",
    "hta": "HolisticTraceAnalysis, pyproject's `hta` extra; its import name is not its distribution's, so "
           "where it is not installed nothing maps one to the other: without it k3lab's own kernel table and "
           "trace diff run (k3lab.profiling.export)",
    "pygments": "code highlighting in the lessons' shown source (nbconvert brings it); without it the "
                "source is shown plain (k3lab.workshop.lesson)",
}
# imported but not declared, on purpose
BY_DESIGN = {
    "triton": "torch's GPU wheels bring it (triton for CUDA, pytorch-triton-rocm for ROCm, under the same "
              "import name); declaring it would replace ROCm's with CUDA's. On a CPU the Makefile installs "
              "it for the interpreter (pyproject.toml says so).",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11+) or tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _names(requirements) -> set[str]:
    return {canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r.strip()).group(0)) for r in requirements}


def declared() -> tuple[set[str], set[str]]:
    """(the canonical names of [project].dependencies, those of every optional-dependencies extra)."""
    project = _project()
    extras = set().union(*(_names(v) for v in project.get("optional-dependencies", {}).values()))
    return _names(project.get("dependencies", [])), extras


def imports(source: str) -> list[tuple[str, int, bool]]:
    """(top-level module, line, optional) of each absolute import in `source`; optional: inside a function
    or in the body of a try that catches ImportError (or a broader class)."""
    tree = ast.parse(source)
    optional: set[int] = set()
    catches = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    for node in ast.walk(tree):
        scope = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = node.body
        elif isinstance(node, ast.Try):
            types = [h.type for h in node.handlers]
            names = {getattr(e, "id", getattr(e, "attr", "")) for t in types if t is not None
                     for e in (t.elts if isinstance(t, ast.Tuple) else [t])}
            if None in types or names & catches:
                scope = node.body
        for stmt in scope:
            optional.update(id(n) for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], node.lineno, id(node) in optional) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno, id(node) in optional))
    return found


def notebook_source(path: Path) -> str:
    """A notebook's code cells as one Python text, IPython magics and shell lines commented out."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    lines = [("# " + ln) if ln.lstrip().startswith(("%", "!")) else ln
             for c in cells for ln in c.splitlines()]
    return "\n".join(lines)


def sources() -> dict[str, str]:
    """Each k3lab module's text and each notebook's code, by path in the tree."""
    found = {str(p.relative_to(REPO)): p.read_text(encoding="utf-8")
             for p in sorted((REPO / "k3lab").rglob("*.py"))}
    found.update({str(p.relative_to(REPO)): notebook_source(p)
                  for p in sorted((REPO / "notebooks").glob("*.ipynb"))})
    return found


def undeclared(files: dict[str, str], required: set[str], extras: set[str]) -> list[str]:
    """One line per import that would not resolve in a venv of the declared dependencies (module
    docstring), naming the file, the line and why."""
    providers = metadata.packages_distributions()
    problems = []
    for where, text in files.items():
        for module, line, optional in imports(text):
            if module in sys.stdlib_module_names or module == "k3lab" or module in BY_DESIGN:
                continue
            dists = {canonical(d) for d in providers.get(module, [])}
            if dists & required:
                continue
            if optional and (dists & extras or module in OPTIONAL):
                continue
            if not dists:
                why = "not installed here and not declared"
            elif dists & extras or module in OPTIONAL:
                why = f"optional ({', '.join(sorted(dists))}) but imported where every run loads it"
            else:
                why = f"{', '.join(sorted(dists))} is not in pyproject.toml's dependencies"
            problems.append(f"{where}:{line}: import {module}: {why}")
    return problems


def test_every_import_of_k3lab_and_the_notebooks_is_declared():
    required, extras = declared()
    files = sources()
    assert any(p.startswith("notebooks/") for p in files) and len(files) > 50
    problems = undeclared(files, required, extras)
    assert not problems, "imports a venv of the declared dependencies lacks:\n" + "\n".join(problems)


def test_an_undeclared_import_fails():
    # the test above must be able to fail: scipy (installed or not) is declared nowhere, and an optional
    # package imported at the top of a module loads on every run
    required, extras = declared()
    assert "scipy" not in required | extras
    problems = undeclared({"x.py": "import numpy\nfrom scipy.optimize import nnls\n",
                           "y.py": "import fla\n",
                           "z.py": ("def f():\n    import fla\n"
                                    "try:\n    import aiter\nexcept ImportError:\n    pass\n")},
                          required, extras)
    assert len(problems) == 2, problems
    assert problems[0].startswith("x.py:2: import scipy:")
    assert problems[1].startswith("y.py:1: import fla: optional")


def test_the_exceptions_still_hold():
    # what OPTIONAL and BY_DESIGN excuse must still be imported somewhere (a stale entry is removed) and
    # never be a declared dependency as well
    required, extras = declared()
    used = {m for text in sources().values() for m, _, _ in imports(text)}
    for name in (*OPTIONAL, *BY_DESIGN):
        assert name in used, f"{name} is excused here but no longer imported"
        assert canonical(name) not in required, f"{name} is declared: drop it from the exceptions"
