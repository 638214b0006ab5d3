"""The layers (docs/architecture.md): the worker is built on the queue and the registry, never
the other way round, so the queue, the registry, the gateway and `rollq status` run without
importing a worker (issue 13); and the product never imports a harness (issue 31: only the
CLI's commands reach them). Checked on the source, imports inside functions included."""

import ast
from pathlib import Path

import pytest

ROLLQ = Path(__file__).resolve().parents[1] / "rollq"
BELOW_THE_WORKER = [*(ROLLQ / "queue").glob("*.py"), *(ROLLQ / "registry").glob("*.py"),
                    *(ROLLQ / "scoring").glob("*.py"),
                    *(ROLLQ / "gateway").glob("*.py"), ROLLQ / "status.py",
                    *(ROLLQ / "client").glob("*.py")]


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("path", BELOW_THE_WORKER, ids=lambda p: str(p.relative_to(ROLLQ)))
def test_no_import_of_the_worker_below_it(path):
    worker = sorted(m for m in imported_modules(path) if m == "rollq.worker" or m.startswith("rollq.worker."))
    assert not worker, f"{path.relative_to(ROLLQ)} imports {worker}"


PRODUCT = [p for p in ROLLQ.rglob("*.py") if "harness" not in p.relative_to(ROLLQ).parts
           and p != ROLLQ / "cli.py"]  # the CLI reaches the harnesses' commands, lazily


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROLLQ)))
def test_the_product_never_imports_a_harness(path):
    harness = sorted(m for m in imported_modules(path)
                     if m == "rollq.harness" or m.startswith("rollq.harness."))
    assert not harness, f"{path.relative_to(ROLLQ)} imports {harness}"
