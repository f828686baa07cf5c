"""The cycles of a file-level import graph: the strongly connected components with more than
one node (Tarjan). Shared by module-cycles.py (Rust) and py-import-cycles.py (Python)."""
import sys


def cycles(edges):
    """Sorted node lists of the components of `edges` (node -> iterable of nodes) with >1 node."""
    idx, low, st, on, sccs, c = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        idx[v] = low[v] = c[0]
        c[0] += 1
        st.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in idx:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = st.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    for v in list(edges):
        if v not in idx:
            visit(v)
    return [sorted(s) for s in sccs if len(s) > 1]
