"""The package's import graph: no module uses another module's private names, and no two modules import each other
(directly or round a circle), counting imports inside functions too: a circle that only works because an import is
deferred is still a circle in the design."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "finetune"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(modules of the package that `name` imports, private names it takes from other modules)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("finetune"):
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if full in known:  # `from finetune.x import module`
                    targets.add(full)
                    aliases[alias.asname or alias.name] = full
                elif module in known:
                    targets.add(module)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{name} imports {alias.name} from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    targets.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
    for node in ast.walk(tree):  # module._name
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            owner = aliases[node.value.id]
            if node.attr.startswith("_") and not node.attr.startswith("__") and owner != name:
                private.append(f"{name} uses {owner}.{node.attr}")
    targets.discard(name)
    return targets, private


@functools.cache  # the package's files do not change during a run; several tests read the graph
def graph() -> tuple[dict[str, set[str]], list[str]]:
    known = modules()
    edges, private = {}, []
    for name, path in known.items():
        edges[name], found = imports(name, path, known)
        private += found
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_uses_another_modules_private_names():
    _, private = graph()
    assert not private, "\n".join(private)


def test_no_import_circles():
    edges, _ = graph()
    found = circles(edges)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def package_of(module: str, packages: set[str]) -> str:
    """finetune.plan.memory -> finetune.plan; a module of the top package stands for itself."""
    head = ".".join(module.split(".")[:2])
    return head if head in packages else module


def test_no_circles_between_subpackages():
    """Between subpackages imports go one way only, round any number of them (config <- data <- plan <- artifacts <-
    distributed <- launch <- infer <- rollout <- methods), and the rank's engines reach neither the planner nor the
    launcher's side."""
    edges, _ = graph()
    packages = {f"finetune.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    between = {}
    for a, targets in edges.items():
        for b in targets:
            pa, pb = package_of(a, packages), package_of(b, packages)
            if pa != pb and pa in packages and pb in packages:
                between.setdefault((pa, pb), []).append(f"{a} -> {b}")
    both = [between[(x, y)][0] + " and " + between[(y, x)][0] for x, y in between if x < y and (y, x) in between]
    assert not both, "; ".join(both)
    packaged = {}
    for x, y in between:
        packaged.setdefault(x, set()).add(y)
    longer = circles(packaged)  # round three or more subpackages
    assert not longer, "subpackages in a circle: " + "; ".join(" <-> ".join(c) for c in longer)
    engines = [e for (x, y), es in between.items() if x == "finetune.distributed" for e in es if y in (
        "finetune.plan", "finetune.launch")]  # fmt: skip
    assert not engines, engines
    rank_side = [f"{a} -> {b}" for a in ("finetune.rank", "finetune.train") for b in edges.get(a, ())]
    assert not [e for e in rank_side if e.split(" -> ")[1].startswith("finetune.launch")], rank_side


def test_the_checker_sees_a_circle_and_a_private_import(tmp_path):
    """The checker itself: a circle of three and a private name are found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    known = {"finetune.x": tmp_path / "x.py", "finetune.y": tmp_path / "y.py"}
    known["finetune.y"].write_text("from finetune import x\nfrom finetune.x import _hidden\nx._other()\n")
    targets, private = imports("finetune.y", known["finetune.y"], known)
    assert targets == {"finetune.x"} and len(private) == 2


def test_only_the_run_folder_module_joins_its_names_to_a_path():
    """`x / "result.json"` (or "checkpoints", f"step-...", a checkpoint's "state.json", ...), or `x.name ==
    "checkpoints"`, outside finetune/artifacts/run.py: a second place that knows the run folder's layout. Every entry
    ft writes there is named by RunFolder."""
    import fnmatch

    from finetune.artifacts.run import CHECKPOINT_STATE, TRACKERS, WRITTEN

    names = [n for n in WRITTEN if n not in TRACKERS] + [CHECKPOINT_STATE]  # a tracker's name is also its config value
    starts = [n.split("*")[0] for n in names if "*" in n] + ["step-", ".tmp-step-"]  # and the checkpoints' folders

    def named(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if any(fnmatch.fnmatch(node.value, n) for n in names) else None
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text = str(node.values[0].value)  # f"step-{step:08d}": its literal start
            return text if any(text.startswith(s) for s in starts) else None
        return None

    # errors.py writes its traceback log in the run folder or the temporary folder (it imports nothing of ft's);
    # ft generate's launch.txt is in its own output's parts folder, and data/rows.py's state.json in a prepared data
    # set's cache entry, not in a run folder
    elsewhere = {"finetune.errors", "finetune.infer.generate", "finetune.data.rows"}
    found = []
    for name, path in modules().items():
        if name == "finetune.artifacts.run" or name in elsewhere:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and (text := named(node.right)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {text!r}")
            if isinstance(node, ast.Compare):  # path.name == "checkpoints"
                found += [f"{path.relative_to(REPO)}:{node.lineno} {t!r}" for c in node.comparators if (t := named(c))]
    assert not found, "run folder names outside RunFolder: " + "; ".join(found)


def test_no_test_file_imports_another():
    """Test files share builders through tests/helpers.py and tests/*_helpers.py, never by importing one another: a
    test file imported elsewhere runs its module-level code (skips, marks, fixtures) in the importer too."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.startswith("tests.test_")]
    assert not found, "test files importing test files: " + "; ".join(found)
