"""Which @triton.jit functions k3lab's source holds, and which of them the ISA report compiles.

Read from the source with `ast` (nothing imported): every function decorated with `triton.jit` (bare or
called) under k3lab/, by qualified name (module.function, nested ones as outer.<locals>.inner), with the
names of the jit functions its body refers to. A launched kernel is compiled by a case; a helper is
compiled inside every kernel that calls it. `uncovered(launched)` lists the jit functions reached by no
launched kernel: a kernel added without a compile entry in `k3lab.isa.cases`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the k3lab package


def _is_jit(dec: ast.expr) -> bool:
    node = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(node, ast.Attribute) and node.attr == "jit" and isinstance(node.value, ast.Name) \
        and node.value.id == "triton"


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.Module, module: str) -> dict[str, str]:
    """name -> module.name for `from X import name` of k3lab modules (relative ones resolved)."""
    out = {}
    pkg = module.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level] + ([node.module] if node.module else [])
                src = ".".join(base)
            else:
                src = node.module or ""
            if src.startswith("k3lab"):
                for a in node.names:
                    out[a.asname or a.name] = f"{src}.{a.name}"
    return out


def jit_functions(root: Path = ROOT) -> dict[str, set[str]]:
    """{qualified name: qualified names of the jit functions its body refers to} for all of k3lab."""
    found: dict[str, tuple[str, ast.FunctionDef, dict]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = _imports(tree, module)

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}{child.name}"
                    if any(_is_jit(d) for d in child.decorator_list):
                        found[f"{module}.{qual}"] = (module, child, imports)
                    visit(child, f"{qual}.<locals>.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(tree, "")
    by_module: dict[str, dict[str, str]] = {}
    for qual, (module, fn, _) in found.items():
        by_module.setdefault(module, {})[fn.name] = qual
    graph = {}
    for qual, (module, fn, imports) in found.items():
        names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} - {fn.name}
        refs = set()
        for n in names:
            if n in by_module.get(module, {}):
                refs.add(by_module[module][n])
            elif n in imports and imports[n] in found:
                refs.add(imports[n])
        graph[qual] = refs
    return graph


def reached(launched: set[str], graph: dict[str, set[str]]) -> set[str]:
    """The launched kernels and every jit function they call, transitively."""
    seen, stack = set(), [k for k in launched if k in graph]
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        stack.extend(graph[k] - seen)
    return seen


def uncovered(launched: set[str], root: Path = ROOT) -> list[str]:
    """jit functions of k3lab that no launched kernel reaches (sorted)."""
    graph = jit_functions(root)
    return sorted(set(graph) - reached(set(launched), graph))
