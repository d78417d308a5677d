"""The design's boundaries, read from the source: a service imports only its own modules, `services.common` and
another service's public `client/` package; nothing under `services/` imports the launcher, the benchmarks, the
scripts or the tests; and no two modules import each other at module level (directly or round a cycle)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTSIDE = ("launcher", "bench", "scripts", "tests")   # what a deployed service image must not need


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of each absolute import anywhere in the file (function bodies included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def module_imports(path: pathlib.Path) -> list[str]:
    """What importing the module imports at once: `import a.b` is a.b; `from a import b` is a.b (a module, or a
    name that `module_imports`' caller resolves to a)."""
    out = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def service_violation(owner: str, module: str) -> str:
    """Why `module` may not be imported by service `owner` ("" when it may)."""
    parts = module.split(".")
    if parts[0] in OUTSIDE:
        return f"a service imports {parts[0]}/"
    if parts[0] != "services" or len(parts) < 2 or parts[1] in (owner, "common"):
        return ""
    if len(parts) >= 3 and parts[2] == "client":
        return ""
    return f"{owner} imports {parts[1]}'s internals (only services.{parts[1]}.client is public)"


def test_services_import_only_their_own_modules_common_and_other_services_clients():
    found = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        owner = path.relative_to(ROOT).parts[1]
        for line, module in imports(path):
            why = service_violation(owner, module)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line}: {module}: {why}")
    assert not found, "\n".join(found)


def test_the_rule_catches_what_it_is_for():
    assert service_violation("trainer", "services.weight_exchange.planner")
    assert service_violation("weight_exchange", "launcher.processes")
    assert not service_violation("trainer", "services.weight_exchange.client.transfer")
    assert not service_violation("trainer", "services.common.config")
    assert not service_violation("rollout", "services.rollout.engines.runner")


def test_no_import_cycle_at_module_level():
    files = {module_name(p): p for folder in ("services", "launcher") for p in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for module in module_imports(path):
            # `from a.b import c`: the module a.b.c where it is one, else a.b (a package's own __init__, run before
            # any of its modules, is not an edge: re-exports in __init__ are not cycles)
            target = module if module in files else module.rsplit(".", 1)[0]
            if target in files and target != name and not name.startswith(target + "."):
                targets.add(target)
        graph[name] = targets
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(sorted(c)) for c in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(component)
                continue
            if child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
