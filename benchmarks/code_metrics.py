"""Module and function sizes and the import graph of moe/ (every import, function-level included; TYPE_CHECKING
blocks excluded), with its cycles.  python benchmarks/code_metrics.py [ROOT]   (ROOT: a checkout, default .)"""
import ast, pathlib, sys, statistics
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
mods = {}
for f in sorted((root / "moe").rglob("*.py")):
    name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    mods[name] = f
lengths, big_mods, graph, fn_imports = [], [], {}, 0
for name, f in mods.items():
    text = f.read_text(); tree = ast.parse(text)
    n = len(text.splitlines())
    if n > 400: big_mods.append((n, str(f.relative_to(root))))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lengths.append((node.end_lineno - node.lineno + 1, f"{f.relative_to(root)}:{node.lineno} {node.name}"))
    edges = set()
    checking = {id(n) for blk in ast.walk(tree) if isinstance(blk, ast.If) and "TYPE_CHECKING" in ast.unparse(blk.test)
                for n in ast.walk(blk)}
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("moe"):
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("moe")]
        else:
            continue
        for t in targets:
            while t and t not in mods: t = t.rpartition(".")[0]
            if t and t != name: edges.add(t)
    graph[name] = edges
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe"): fn_imports += 1
# cycles among modules (ignoring package __init__ re-export edges to children)
def is_pkg_child(a, b): return b.startswith(a + ".")
sys.setrecursionlimit(10000)
index, low, stack, on, sccs, i = {}, {}, [], set(), [], [0]
def strong(v):
    index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
    for w in graph[v]:
        if is_pkg_child(v, w) or is_pkg_child(w, v): continue
        if w not in index: strong(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: sccs.append(comp)
for v in graph:
    if v not in index: strong(v)
ls = sorted(l for l, _ in lengths)
print(f"modules {len(mods)}, lines {sum(len(f.read_text().splitlines()) for f in mods.values())}")
print(f"functions {len(ls)}: median {statistics.median(ls)}, p90 {ls[int(0.9*len(ls))]}, max {ls[-1]}")
print("functions > 50 lines:", [d for l, d in sorted(lengths, reverse=True) if l > 50])
print("modules > 400 lines:", sorted(big_mods, reverse=True))
print(f"import edges {sum(len(e) for e in graph.values())}, function-level moe imports {fn_imports}")
print("cycles (runtime imports; TYPE_CHECKING blocks and package/child edges excluded):", sccs or "none")
