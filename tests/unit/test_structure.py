"""The package's shape, read from the source with `ast` (nothing is imported): no import cycle, no arrow upward
through the layers, nothing imports the training entry, the remote-code files stand alone, no module grows past
600 lines, each shared helper has one home, logging is configured once and no module edits `sys.path` (except
the training entry's script guard). The data flow the layers follow: data -> states -> train -> evaluation ->
export."""

import ast
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOT_MODULES = ("push_to_hub", "configuration_dspark", "modeling_dspark")
REMOTE_CODE = ("configuration_dspark", "modeling_dspark")
MAX_LINES = 600
LONG_ALLOWED = {"modeling_dspark"}  # the remote-code model is one file by design (copied into every export)

# The layers, lowest first: a module may import its own layer and the ones below, never one above. A module's
# layer is that of the longest entry its dotted name starts with. Equal ranks are peers.
LAYERS = {
    "trainer": (0, "the package __init__: a docstring, it imports nothing"),
    "trainer.errors": (0, "error types and the one Parser: every layer raises them"),
    "trainer.files": (0, "file helpers (atomic writes, JSONL reading): used by every layer that writes or reads"),
    "trainer.config": (1, "the run config: every layer reads it, so it knows none of them"),
    "trainer.contract": (1, "the checkpoint contract: what a servable folder holds; training writes it, export checks it"),
    "trainer.serving": (2, "the vLLM transport: talks to a server, knows nothing of data, states or training"),
    "trainer.verifier": (2, "loading the verifier and its teacher: below everything that runs it"),
    "trainer.data": (3, "chat rows -> packed rows: needs the verifier's tokenizer, not its states"),
    "trainer.states": (4, "hidden states for the packed rows: the loss is not its business"),
    "trainer.train": (5, "the objective, the optimizer, the Trainer: consumes data and states"),
    "trainer.evaluation": (6, "measures a trained drafter against its verifier"),
    "trainer.export": (7, "a checkpoint and its evaluation -> a servable folder with its card"),
    "trainer.run": (8, "the training entry (`accelerate launch trainer/run.py`): nothing imports it"),
    "push_to_hub": (8, "the export command"),
}
BELOW_ALL = set(REMOTE_CODE)  # the remote-code files: any layer may import them, they import no layer

# Each has exactly one home (a top-level def, class or assignment) across trainer/ and the root modules.
ONE_HOME = {
    "write_json_atomic": "atomic writes: one durability policy",
    "fsync_dir": "atomic writes: one durability policy",
    "DRAFT_METHODS": "the draft methods every evaluator and the model accept",
    "read_jsonl_objects": "the strict JSONL reader",
    "is_hub_id": "the local-path-or-Hub-id rule",
}
SCRIPT_ENTRY = "trainer.run"  # run as `accelerate launch trainer/run.py`: may fix sys.path when __package__ is empty


# ------------------------------------------------------------------------------------------------ reading
@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module under trainer/ and the root modules (a package's __init__.py is
    the package's own name)."""
    found = {}
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for name in ROOT_MODULES:
        found[name] = ROOT / f"{name}.py"
    return found


@cache
def tree(name: str) -> ast.Module:
    path = modules()[name]
    return ast.parse(path.read_text(), filename=str(path))


def package_of(name: str) -> str:
    """The package a module's relative imports start from."""
    return name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]


def imports(name: str) -> list[tuple[str, int]]:
    """Every module `name` imports, anywhere in the file (inside functions, `if` blocks and `try` too), as
    (dotted target, line). `from a.b import c` is `a.b.c` when that is a module, else `a.b`; importing a package
    is importing its __init__."""
    known = modules()
    out = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(name)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = ".".join(p for p in (base, node.module) if p)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in known else base, node.lineno))
    return out


def internal(target: str) -> str | None:
    """The parsed module `target` resolves to (the longest known prefix), None for anything else."""
    known = modules()
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


@cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {imported parsed module: first line}."""
    edges: dict[str, dict[str, int]] = {}
    for name in modules():
        edges[name] = {}
        for target, line in imports(name):
            hit = internal(target)
            if hit and hit != name:
                edges[name].setdefault(hit, line)
    return edges


def layer(name: str) -> int | None:
    best = None
    for prefix in LAYERS:
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else LAYERS[best][0]


def where(name: str, line: int) -> str:
    return f"{modules()[name].relative_to(ROOT)}:{line}"


# ------------------------------------------------------------------------------------------------ cycles
def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One concrete cycle (a -> b -> ... -> a, as a list of modules) per strongly connected component."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    counter = [0]

    def strong(v):  # Tarjan, iterative enough for a few hundred modules
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    found = []
    for component in components:
        start = min(component)
        seen = {start}
        # walk inside the component until we come back to the start (breadth-first: the shortest such cycle)
        frontier = [[start]]
        cycle = None
        while frontier and cycle is None:
            next_frontier = []
            for path in frontier:
                for w in sorted(edges[path[-1]]):
                    if w == start:
                        cycle = path + [start]
                        break
                    if w in component and w not in seen:
                        seen.add(w)
                        next_frontier.append(path + [w])
                if cycle:
                    break
            frontier = next_frontier
        found.append(cycle or sorted(component))
    return found


def test_no_import_cycle_among_trainer_modules():
    edges = {m: {t: line for t, line in e.items() if t.startswith("trainer")}
             for m, e in graph().items() if m.startswith("trainer")}
    found = cycles(edges)
    assert not found, "import cycles (each a -> b -> ... -> a):\n" + "\n".join(
        "  " + " -> ".join(c) + "   (" + ", ".join(where(a, edges[a][b]) for a, b in zip(c, c[1:])) + ")"
        for c in found)


def test_no_arrow_upward_through_the_layers():
    unlisted = [m for m in modules() if m not in BELOW_ALL and layer(m) is None]
    assert not unlisted, f"modules with no layer in LAYERS (add their package with a reason): {unlisted}"
    upward = []
    for name, targets in graph().items():
        for target, line in targets.items():
            if name in BELOW_ALL or target in BELOW_ALL:
                continue  # the remote-code files have their own test
            if layer(target) > layer(name):
                upward.append(f"  {name} (layer {layer(name)}) imports {target} (layer {layer(target)}) at "
                              f"{where(name, line)}")
    assert not upward, "imports upward through the layers (lower may not import higher):\n" + "\n".join(upward)


def test_nothing_imports_the_training_entry():
    importers = [where(name, targets[SCRIPT_ENTRY]) for name, targets in graph().items() if SCRIPT_ENTRY in targets]
    assert not importers, f"trainer/run.py is the training entry, not a library; imported at {importers}"


def test_remote_code_files_import_only_torch_transformers_stdlib_and_each_other():
    allowed = {"torch", "transformers", "__future__", *sys.stdlib_module_names, *REMOTE_CODE}
    bad = [f"{where(name, line)} imports {target}" for name in REMOTE_CODE for target, line in imports(name)
           if target.split(".")[0] not in allowed]
    assert not bad, "the remote-code files run in users' processes through trust_remote_code:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------------ size
def test_no_module_over_600_lines():
    long = {str(path.relative_to(ROOT)): n for name, path in modules().items() if name not in LONG_ALLOWED
            and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along their concerns): {long}"


# ------------------------------------------------------------------------------------------------ one home
def top_level_names(node: ast.Module) -> list[tuple[str, int]]:
    out = []
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append((stmt.name, stmt.lineno))
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                out += [(n.id, stmt.lineno) for n in ast.walk(target) if isinstance(n, ast.Name)]
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign) and isinstance(stmt.target, ast.Name):
            out.append((stmt.target.id, stmt.lineno))
    return out


def test_each_shared_helper_has_one_home():
    homes = {helper: [] for helper in ONE_HOME}
    for name in modules():
        for defined, line in top_level_names(tree(name)):
            if defined in homes:
                homes[defined].append(where(name, line))
    wrong = {f"{helper} ({ONE_HOME[helper]})": found for helper, found in homes.items() if len(found) != 1}
    assert not wrong, f"each of these is defined exactly once (import it elsewhere): {wrong}"


def is_attribute(node: ast.AST, dotted: str) -> bool:
    """`node` is the expression `dotted` (e.g. `logging.basicConfig`, `sys.path`)."""
    *head, last = dotted.split(".")
    if not head:
        return isinstance(node, ast.Name) and node.id == last
    return isinstance(node, ast.Attribute) and node.attr == last and is_attribute(node.value, ".".join(head))


def test_logging_is_configured_at_most_once():
    calls = [where(name, node.lineno) for name in modules() for node in ast.walk(tree(name))
             if isinstance(node, ast.Call) and is_attribute(node.func, "logging.basicConfig")]
    assert len(calls) <= 1, f"logging.basicConfig is called in {len(calls)} places (configure logging once): {calls}"


def sys_path_edits(node: ast.AST) -> list[int]:
    """Lines of `sys.path.insert/append/extend/...(...)`, `sys.path = ...`, `sys.path[...] = ...` and
    `sys.path += ...` under `node`."""
    lines = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and is_attribute(n.func.value, "sys.path"):
            if n.func.attr in {"insert", "append", "extend", "remove", "pop", "clear"}:
                lines.append(n.lineno)
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            if is_attribute(t, "sys.path") or (isinstance(t, ast.Subscript) and is_attribute(t.value, "sys.path")):
                lines.append(n.lineno)
    return lines


def is_script_guard(stmt: ast.stmt) -> bool:
    """`if __package__ ...:` at the top level of a module (the script-entry guard)."""
    return isinstance(stmt, ast.If) and any(isinstance(n, ast.Name) and n.id == "__package__"
                                            for n in ast.walk(stmt.test))


def test_no_sys_path_edits_but_the_training_entry_guard():
    edits = []
    for name in modules():
        if not name.startswith("trainer"):
            continue
        body = tree(name).body
        guards = [stmt for stmt in body if is_script_guard(stmt) and sys_path_edits(stmt)] if name == SCRIPT_ENTRY \
            else []
        allowed = {line for stmt in guards[:1] for line in sys_path_edits(stmt)}
        edits += [where(name, line) for line in sys_path_edits(tree(name)) if line not in allowed]
    assert not edits, ("sys.path is edited outside trainer/run.py's script-entry guard (run modules with "
                       f"`python -m`, or import them): {edits}")


def test_the_training_entry_fixes_the_path_before_importing_trainer():
    body = tree(SCRIPT_ENTRY).body
    guards = [i for i, stmt in enumerate(body) if is_script_guard(stmt) and sys_path_edits(stmt)]
    assert len(guards) == 1, f"trainer/run.py has {len(guards)} `if __package__ ...:` guards editing sys.path, not 1"
    early = sorted({line for target, line in imports(SCRIPT_ENTRY) if internal(target) and line < body[guards[0]].lineno})
    assert not early, (f"trainer/run.py imports the package's modules before its script guard fixes sys.path "
                       f"(lines {early}): as `python trainer/run.py` they are then not importable, or trainer/ "
                       f"shadows them")
