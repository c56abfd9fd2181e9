"""No import cycles between the modules of piwf (issue 19).

``lint-imports`` (the ``acyclic_siblings`` contract in pyproject.toml) forbids cycles
between sibling packages and modules at every depth; this test also catches a package's
``__init__`` and one of its own modules importing each other, by looking for strongly
connected components in the module graph (imports under ``TYPE_CHECKING`` and inside
functions count: they are imports all the same).
"""

from __future__ import annotations

import grimp

def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The module groups that import each other in a circle (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            for other in imported:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph.find_modules_directly_imported_by(other)))))
                    break
                if other in on_stack:
                    low[module] = min(low[module], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == module:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found



def test_no_module_of_piwf_imports_itself_in_a_circle() -> None:
    cycles = _cycles(grimp.build_graph("piwf", cache_dir=None))
    assert not cycles, f"modules that import each other in a circle: {cycles}"


def test_a_circle_is_found() -> None:
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]
