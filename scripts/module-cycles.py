#!/usr/bin/env python3
"""File-level import graph of one crate's src/ tree, and its cycles (issue 16: no file imports a file
that imports it back).

Usage: python3 scripts/module-cycles.py crates/kvmesh-engine/src [--tests]

Node = module file (`engine::handle`, `p2p`, ...). Edge A -> B when A's code (comments stripped;
`#[cfg(test)] mod tests {..}` bodies dropped unless --tests) names a path into module B:
`crate::b::...`, `super::b::...`, `self::b::...`, or `b::...` for a child module B of A. A path
resolves to the deepest module it names (`crate::engine::EngineHandle` -> `engine`). Prints the
edges and the strongly connected components with more than one node (exit 1 if any)."""
import os, re, sys

from import_cycles import cycles

root = sys.argv[1]
include_tests = "--tests" in sys.argv
mods = {}
for dp, _, fs in os.walk(root):
    for f in fs:
        if not f.endswith(".rs"):
            continue
        p = os.path.join(dp, f)
        parts = os.path.relpath(p, root)[:-3].split(os.sep)
        if parts[-1] == "mod":
            parts = parts[:-1]
        if parts == ["lib"] or parts == ["main"]:
            parts = []
        mods["::".join(parts)] = p
if not include_tests:
    mods = {m: p for m, p in mods.items() if not m.endswith("tests")}

def resolve(segs):
    """Deepest known module named by a path's leading segments."""
    best = None
    for i in range(1, len(segs) + 1):
        cand = "::".join(segs[:i])
        if cand in mods:
            best = cand
    return best

def strip(src):
    if not include_tests:
        i = src.find("#[cfg(test)]\nmod tests {")
        if i >= 0:
            src = src[:i]
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return src

def paths(src):
    """Every `a::b::c` path, with `{..}` use-groups expanded one level."""
    out = []
    for m in re.finditer(r"\b((?:[A-Za-z_][A-Za-z0-9_]*::)+)\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", src):
        base = m.group(1)
        for item in re.split(r",\s*(?![^{]*\})", m.group(2)):
            item = item.strip()
            if item:
                out.append(base + item)
    out += re.findall(r"\b(?:[A-Za-z_][A-Za-z0-9_]*::)+[A-Za-z_][A-Za-z0-9_]*", src)
    return out

edges = {m: set() for m in mods}
for m, p in mods.items():
    me = m.split("::") if m else []
    for path in paths(strip(open(p).read())):
        segs = [s for s in re.split(r"::", path) if s]
        segs = [re.sub(r"\W.*", "", s) for s in segs]
        if segs[0] == "crate":
            target = resolve(segs[1:])
        elif segs[0] == "super":
            base = me[:-1]
            rest = segs[1:]
            while rest and rest[0] == "super":
                base, rest = base[:-1], rest[1:]
            target = resolve(base + rest)
        elif segs[0] == "self":
            target = resolve(me + segs[1:])
        elif "::".join(me + segs[:1]) in mods:
            target = resolve(me + segs)
        else:
            continue
        if target is not None and target != m and target != "":
            edges[m].add(target)

for k in sorted(edges):
    print(f"{k or '(crate root)':26} -> {', '.join(sorted(edges[k]))}")
cyc = cycles(edges)
print("cycles:", cyc if cyc else "none")
sys.exit(1 if cyc else 0)
