"""The package's shape: no import circle (lazy imports count), no oversized module; and the
tests' shape, which mirrors it.

An import circle hidden in a function body still ties two modules into one concern and
breaks as soon as either is imported first in a new place; a module past 600 lines holds
more than one concern. Both are checked from the source, without importing anything.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "raycap"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the checks (which only read it)."""
    return ast.parse(path.read_text(), str(path))


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The raycap modules `name` imports anywhere in its source, functions included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from raycap.cluster.plumbing import task` imports the module raycap.cluster.plumbing.task.
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            found.update(submodules or {base})
    return {target for target in found if target in known and target != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_raycap_modules_import_each_other_in_a_circle_even_lazily():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_import_scan_sees_lazy_imports_and_finds_a_planted_circle():
    graph = _graph()
    # The dispatch reaches the Ray session only from inside a function.
    assert "raycap.cluster.rebuild.session" in graph["raycap.runs.dispatch"]
    planted = {name: set(targets) for name, targets in graph.items()}
    planted["raycap.capture.store"].add("raycap.api")
    assert _cycle(planted) is not None


def test_no_module_is_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def _eager_imports(path: Path) -> set[str]:
    """Every module named by an import that runs when `path` is imported (not in a function)."""
    names: set[str] = set()
    todo = list(_parsed(path).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return names


def test_the_core_and_the_front_door_import_without_ray():
    modules = _modules()
    front = ("raycap", "raycap.api", "raycap.rows.executor", "raycap.rows.local", "raycap.capture.directory")
    runs = ("raycap.runs.dispatch", "raycap.runs.handoff", "raycap.runs.rollouts", "raycap.runs.directories", "raycap.runs.stream")
    for start in front + runs:
        reached, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name in reached:
                continue
            reached.add(name)
            imported = _eager_imports(modules[name])
            assert not any(n == "ray" or n.startswith("ray.") for n in imported), f"{start} imports Ray via {name}"
            todo.extend(n for n in imported if n in modules)
        assert not any(n.startswith("raycap.cluster") for n in reached), (start, sorted(reached))


GYM_MODULES = ("records", "store", "builder", "consumer", "protocols", "config", "sink", "delivery")
NOT_IN_GYM_MODULES = ("ray", "fastapi", "starlette", "uvicorn", "aiohttp", "flask", "nemo_gym")


def _all_imports(path: Path, known: set[str]) -> set[str]:
    """Every module named by an import anywhere in `path`, function bodies included
    (`from raycap import builder` names the module raycap.capture.builder)."""
    names: set[str] = set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            names.update(submodules or {node.module or ""})
    return names


def test_the_modules_named_like_nemo_gyms_import_no_ray_web_framework_or_gym_even_lazily():
    modules = _modules()
    for start in GYM_MODULES:
        reached, todo = set(), [f"raycap.capture.{start}"]
        while todo:
            name = todo.pop()
            if name in reached:
                continue
            reached.add(name)
            imported = _all_imports(modules[name], set(modules))
            banned = sorted(n for n in imported if n.split(".")[0] in NOT_IN_GYM_MODULES)
            assert not banned, f"raycap.{start} reaches {banned} through {name}"
            todo.extend(n for n in imported if n in modules)
        assert not any(n.startswith("raycap.cluster") for n in reached), (start, sorted(reached))


# --- the packages and what each may import ----------------------------------------------------------

# Lowest first: a package imports only packages before it here (and `raycap.errors`),
# at module level or inside a function alike.
PACKAGES = ("capture", "observe", "rows", "output", "finalize", "stream", "cluster", "runs", "train", "cli")


def _declared(package: str) -> tuple[set[str], set[str]]:
    """What the package's __init__ says it may import: at module level, and lazily."""
    tree = ast.parse((PACKAGE / package / "__init__.py").read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MAY_IMPORT", "MAY_CALL_LAZILY"):
                found[node.targets[0].id] = set(ast.literal_eval(node.value))
    assert set(found) == {"MAY_IMPORT", "MAY_CALL_LAZILY"}, f"raycap/{package}/__init__.py declares {sorted(found)}"
    return found["MAY_IMPORT"], found["MAY_CALL_LAZILY"]


def _raycap_imports(path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """The raycap modules `path` imports at module level, and those it imports only in functions."""
    every = _all_imports(path, known)
    eager = {name for name in _eager_imports(path) if name in known or name.startswith("raycap")}
    eager = {name for name in eager if name in every or name in known}
    return eager & known, (every - eager) & known


def _package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in PACKAGES) else module


def test_every_package_imports_only_what_its_init_declares():
    modules = _modules()
    known = set(modules)
    broken = []
    for package in PACKAGES:
        may, lazily = _declared(package)
        own = f"raycap.{package}"
        allowed = {own, "raycap.errors"} | may
        for name, path in modules.items():
            if _package_of(name) != own:
                continue
            eager, inside = _raycap_imports(path, known)
            broken += [f"{name} imports {t}" for t in eager if _package_of(t) not in allowed]
            broken += [f"{name} imports {t} in a function" for t in inside if _package_of(t) not in allowed | lazily]
    assert broken == [], "\n".join(sorted(broken))


def test_no_package_imports_a_higher_one_even_lazily():
    """A lazy import is an arrow like any other: a lower package that reaches up from
    inside a function ties the two into one concern all the same."""
    modules = _modules()
    known = set(modules)
    rank = {f"raycap.{package}": i for i, package in enumerate(PACKAGES)}
    # The front door (`raycap`, `raycap.api`) stands above every package but the command line.
    rank["raycap"] = rank["raycap.api"] = rank["raycap.cli"] - 0.5
    upward = []
    for package in PACKAGES:
        may, lazily = _declared(package)
        declared_up = sorted(t for t in may | lazily if rank.get(t, -1) >= rank[f"raycap.{package}"])
        assert declared_up == [], f"raycap/{package}/__init__.py declares imports of higher packages: {declared_up}"
        for name, path in modules.items():
            if _package_of(name) != f"raycap.{package}":
                continue
            eager, inside = _raycap_imports(path, known)
            for target in eager | inside:
                top = _package_of(target)
                if rank.get(top, -1) > rank[f"raycap.{package}"]:
                    upward.append(f"{name} imports {target}")
    assert upward == [], "\n".join(sorted(upward))


# raycap.cluster's folders, lowest first; the modules at its top (finalizer, sink) stand above them all.
CLUSTER_LAYERS = ({"plumbing"}, {"nodes"}, {"rebuild", "streaming"})


def test_the_cluster_folders_import_only_lower_ones_even_lazily():
    modules = _modules()
    known = set(modules)

    def layer(module: str) -> int | None:
        parts = module.split(".")
        if parts[:2] != ["raycap", "cluster"] or len(parts) < 3:
            return None
        folder = parts[2] if len(parts) > 3 or (PACKAGE / "cluster" / parts[2]).is_dir() else None
        return next((i for i, names in enumerate(CLUSTER_LAYERS) if folder in names), len(CLUSTER_LAYERS))

    broken = []
    for name, path in modules.items():
        mine = layer(name)
        if mine is None or mine == len(CLUSTER_LAYERS):
            continue
        eager, inside = _raycap_imports(path, known)
        for target in eager | inside:
            theirs = layer(target)
            same_folder = target.split(".")[2] == name.split(".")[2] if theirs is not None else True
            if theirs is not None and (theirs > mine or (theirs == mine and not same_folder)):
                broken.append(f"{name} imports {target}")
    assert broken == [], "\n".join(sorted(broken))


def test_the_order_check_sees_a_lazy_import_of_a_higher_package(tmp_path):
    known = set(_modules())
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from raycap.runs import dispatch\n")
    _, inside = _raycap_imports(planted, known)
    assert "raycap.runs.dispatch" in inside and PACKAGES.index("runs") > PACKAGES.index("output")


def test_the_package_rule_check_finds_a_planted_import(tmp_path):
    known = set(_modules())
    planted = tmp_path / "planted.py"
    planted.write_text("from raycap.cluster.rebuild.session import session\n\ndef f():\n    from raycap.stream import steps\n")
    eager, inside = _raycap_imports(planted, known)
    assert "raycap.cluster.rebuild.session" in eager and "raycap.stream.steps" in inside


def test_the_capture_package_imports_neither_ray_nor_pyarrow_even_lazily():
    for path in sorted((PACKAGE / "capture").glob("*.py")):
        imported = _all_imports(path, set())
        banned = sorted(n for n in imported if n.split(".")[0] in ("ray", "pyarrow"))
        assert banned == [], f"{path.name} imports {banned}"


def test_raycap_errors_declares_every_exception_class_and_exports_it():
    import raycap
    import raycap.errors

    declared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {ast.unparse(base) for base in node.bases}
                if any(base.endswith(("Error", "Exception")) for base in bases):
                    declared.append((path.relative_to(PACKAGE).as_posix(), node.name))
    assert {where for where, _ in declared} == {"errors.py"}, declared
    names = {name for _, name in declared}
    assert names <= set(raycap.errors.__all__) and names <= set(raycap.__all__)


def test_the_tests_mirror_the_packages_each_folder_on_the_path_and_each_file_name_once():
    """tests/<package>/ holds a package's tests, tests/system/ the suites across packages, and
    tests/ itself the shared helpers, this file and the top-level API's tests. Every folder is
    on pytest's path and ruff's (pyproject.toml): test modules import each other by file name,
    so a name is used once across the folders."""
    tomllib = pytest.importorskip("tomllib")
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name.isidentifier() and not p.name.startswith("_")}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders - packages == {"system"}, f"tests/ has system/ and raycap's package names, not {sorted(folders)}"
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == ["test_api.py", "test_layout.py"]
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    on_path = {".", "tests", *(f"tests/{name}" for name in folders)}
    assert set(config["tool"]["pytest"]["ini_options"]["pythonpath"]) == on_path
    assert set(config["tool"]["ruff"]["src"]) == on_path
    names = [p.name for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
