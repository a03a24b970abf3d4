"""The package tree reads like the pipeline: every import points down the stages, none runs in a circle, no private
name crosses modules, and no module grows past 400 lines. Read from the code's own imports (ast), every module."""

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

# the stages, lowest first: a module may import its own stage and those below it
STAGES = ["core", "hardware", "config", "params", "measurement", "engines", "search", "decision", "cli"]
MAX_LINES = 400


def _modules(repo: Path = REPO) -> dict[str, Path]:
    return {".".join(p.relative_to(repo).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted((repo / "optimizer").rglob("*.py"))}


def _imports(repo: Path = REPO) -> list[tuple[str, str, list[str], int]]:
    out = []
    for mod, path in _modules(repo).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("optimizer"):
                out.append((mod, node.module, [a.name for a in node.names], node.lineno))
            elif isinstance(node, ast.Import):
                out += [(mod, a.name, [], node.lineno) for a in node.names if a.name.startswith("optimizer")]
    return out


def _stage(module: str) -> int | None:
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def test_every_module_lives_in_a_stage():
    loose = [m for m in _modules() if m.count(".") == 1 and _stage(m) is None and m != "optimizer.__main__"]
    assert not loose, f"modules outside the stage subpackages {STAGES}: {loose}"


def _upward(repo: Path = REPO) -> list[str]:
    return [f"{a} (line {line}) imports {b}" for a, b, _, line in _imports(repo)
            if _stage(a) is not None and _stage(b) is not None and _stage(b) > _stage(a)]


def test_every_import_points_down_the_stages():
    assert not _upward(), "\n".join(_upward())


def test_no_import_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    modules = set(_modules())
    for a, b, names, _ in _imports():
        targets = {f"{b}.{n}" for n in names if f"{b}.{n}" in modules} or {b}  # `from pkg import module`
        graph[a] |= {t for t in targets if t != a}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node):], node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*path, node])
        done.add(node)

    for m in sorted(graph):
        visit(m, [])


def test_no_private_name_crosses_modules():
    crossing = [f"{a} imports {n} from {b}" for a, b, names, _ in _imports() for n in names
                if n.startswith("_") and b != a]
    assert not crossing, crossing


def test_no_module_over_the_limit():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_stage_check_sees_an_upward_import(tmp_path):
    """The check is not vacuous: a core module that imports the CLI, planted in a copy of the tree, is named."""
    for rel, text in {"optimizer/core/units.py": "from optimizer.cli.main import main\n",
                      "optimizer/cli/main.py": "from optimizer.core.units import x\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert _upward(tmp_path) == ["optimizer.core.units (line 1) imports optimizer.cli.main"]
    assert len(_imports()) > 100  # and the real tree is read: its modules import each other
