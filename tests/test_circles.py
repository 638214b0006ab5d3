"""No circle of imports among rollq's modules (issue 31): each module can be read, changed and
tested knowing only what is below it. Checked on the source with ast, the imports inside
functions included (a lazy import hides a circle, it does not remove one). Left out:
imports under `if TYPE_CHECKING:` (they never run: annotations only), and the implicit import
of a module's parent packages (Python runs a package's `__init__` first whatever it imports)."""

import ast
from pathlib import Path

ROLLQ = Path(__file__).resolve().parents[1] / "rollq"


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROLLQ.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {module_name(p): p for p in ROLLQ.rglob("*.py")}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(node: ast.AST):
    """The import statements in `node` and below it, but for those that never run."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    for child in ast.iter_child_nodes(node):
        if _type_checking_only(child):
            for other in child.orelse:  # the else branch does run
                yield from _imports(other)
        else:
            yield from _imports(child)


def imports_of(name: str) -> set[str]:
    """The rollq modules `name` imports: `from a import b` names `a.b` where that is a module,
    else `a`."""
    path = MODULES[name]
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs
            if len(subs) < len(node.names):  # some names are not modules: the package itself
                found.add(node.module)
    return {m for m in found if m in MODULES and m != name}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a path [a, b, ..., a], or None (depth-first, colouring)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start)):
            return circle
    return None


def test_the_finder_sees_a_circle_and_a_lazy_import():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
    lazy = ast.parse("def f():\n    import rollq.protocol\nif TYPE_CHECKING:\n    import rollq.config\n")
    assert [a.name for n in _imports(lazy) for a in n.names] == ["rollq.protocol"]


def test_no_import_circle_among_rollqs_modules():
    graph = {name: imports_of(name) for name in MODULES}
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)
