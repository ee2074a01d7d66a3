"""No import circle under benchmarks/: the scripts there import each other by file name (a script's
folder is first on sys.path) and the simulator's package async_rl/ by package name or relatively.
The graph is read from the source (ast), with the imports inside functions too: a circle closed by
a function-level import (bench_async.py -> elastic_cli.py -> `import bench_async` in a function,
as it was) runs until the day the function runs first at import time."""
import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> Dict[str, Set[str]]:
    """module -> the modules under `root` it imports (anywhere in its body)."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py")) if "results" not in p.parts}
    graph: Dict[str, Set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".") if package else []
                    up = up[:len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" if base else alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_circle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One circle of the graph as [a, b, ..., a], or None."""
    state: Dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: List[str] = []

    def walk(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return None


def test_no_import_circle_under_benchmarks():
    graph = import_graph(BENCHMARKS)
    assert {"bench_async", "async_rl.elastic_cli", "async_rl.common"} <= set(graph)
    assert "async_rl.common" in graph["async_rl.elastic_cli"]  # relative imports are followed
    circle = find_circle(graph)
    assert circle is None, "import circle under benchmarks/: " + " -> ".join(circle)


def test_the_check_finds_a_circle_closed_inside_a_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "entry.py").write_text("from pkg.cli import add\n")
    (tmp_path / "pkg" / "cli.py").write_text("from .helpers import ROOT\n")
    (tmp_path / "pkg" / "helpers.py").write_text("def f():\n    import entry\n")
    assert find_circle(import_graph(tmp_path)) == ["entry", "pkg.cli", "pkg.helpers", "entry"]
    (tmp_path / "pkg" / "helpers.py").write_text("ROOT = 1\n")
    assert find_circle(import_graph(tmp_path)) is None
