#!/usr/bin/env python3
"""File-level import graph of the Python sources under a directory, and its cycles (issue 16,
issue 34: no file imports a file that imports it back). The Python sibling of module-cycles.py.

Usage: python3 scripts/py-import-cycles.py python

Node = module file, named as Python would import it: `kvmesh_vllm.connector` for a file inside a
package (directories with `__init__.py`, named from the outermost one), the bare file name for a
script directory without one (`tests/tiny_model.py` -> `tiny_model`, found first from its own
directory, as `sys.path[0]` does). Edge A -> B for every `import` / `from ... import` in A that
names B, wherever it is written: at module level, inside a function (a function-local import
still makes A depend on B; hiding a circle in one is what this check is for) or under
`if TYPE_CHECKING:`. `import a.b.c` names the deepest module of `a.b.c` that is a file here;
`from p import x` names `p.x` when that is a module file, else `p` itself when `p/__init__.py`
binds `x` (anything else, e.g. a compiled extension `p._native`, is outside the graph). A child
module is not taken to import its package `__init__`. Prints the edges and the strongly connected
components with more than one node, each edge of them with its line (exit 1 if any)."""
import ast
import os
import sys

from import_cycles import cycles

root = sys.argv[1] if len(sys.argv) > 1 else "python"


def package_of(directory):
    """Dotted package name of a directory (None when it holds no `__init__.py`)."""
    parts = []
    d = os.path.abspath(directory)
    while os.path.isfile(os.path.join(d, "__init__.py")):
        parts.append(os.path.basename(d))
        d = os.path.dirname(d)
    return ".".join(reversed(parts)) or None


# Module name -> file, and file -> (its module name, its package, the script dir it sits in).
mods, info = {}, {}
for dp, dns, fs in os.walk(root):
    dns[:] = sorted(d for d in dns if not d.startswith((".", "__pycache__")) and d != "build")
    pkg = package_of(dp)
    for f in sorted(fs):
        if not f.endswith(".py"):
            continue
        p = os.path.join(dp, f)
        stem = f[:-3]
        if pkg is None:
            name = stem
        else:
            name = pkg if stem == "__init__" else f"{pkg}.{stem}"
        if name in mods:
            # Two script directories with a file of one name: keep them apart by path.
            name = f"{name}@{os.path.relpath(dp, root)}"
        mods[name] = p
        is_pkg = stem == "__init__"
        info[p] = (name, name if is_pkg else pkg, None if pkg else dp)

trees = {p: ast.parse(open(p, encoding="utf-8").read(), filename=p) for p in mods.values()}


def binds(module, attr):
    """Whether `module`'s file binds `attr` at its top level."""
    tree = trees.get(mods.get(module, ""))
    if tree is None:
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == attr for a in node.names):
                return True
    return False


by_path = {p: name for name, p in mods.items()}


def resolve_dotted(dotted, script_dir):
    """The deepest module of `a.b.c` that is a file here: a script's sibling files first (as
    `sys.path[0]`), then modules of packages."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if script_dir is not None:
            sibling = by_path.get(os.path.join(script_dir, *parts[:i]) + ".py")
            if sibling is not None:
                return sibling
        cand = ".".join(parts[:i])
        if cand in mods and info[mods[cand]][2] is None:
            return cand
    return None


def targets(node, me_pkg, script_dir):
    """Modules an import statement names."""
    if isinstance(node, ast.Import):
        return [resolve_dotted(a.name, script_dir) for a in node.names]
    base = node.module or ""
    if node.level:
        if me_pkg is None:
            return []
        up = me_pkg.split(".")
        up = up[: len(up) - (node.level - 1)]
        base = ".".join(up + ([base] if base else []))
    out = []
    for a in node.names:
        sub = resolve_dotted(f"{base}.{a.name}", script_dir)
        if sub is not None and sub.count(".") == base.count(".") + 1:
            out.append(sub)
            continue
        mod = resolve_dotted(base, script_dir)
        if mod is None:
            continue
        # `from package import name` that the package does not bind: a submodule that is not
        # a file here (a compiled extension such as `_native`), outside the graph.
        if os.path.basename(mods[mod]) == "__init__.py" and a.name != "*" and not binds(mod, a.name):
            continue
        out.append(mod)
    return out


edges = {m: {} for m in mods}
for m, p in mods.items():
    _, me_pkg, script_dir = info[p]
    for node in ast.walk(trees[p]):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for t in targets(node, me_pkg, script_dir):
                if t is not None and t != m:
                    edges[m].setdefault(t, node.lineno)

for k in sorted(edges):
    print(f"{k:34} -> {', '.join(sorted(edges[k]))}")

cyc = cycles(edges)
for comp in cyc:
    for a in comp:
        for b, line in sorted(edges[a].items()):
            if b in comp:
                print(f"  {mods[a]}:{line} imports {b}")
print("cycles:", cyc if cyc else "none")
sys.exit(1 if cyc else 0)
