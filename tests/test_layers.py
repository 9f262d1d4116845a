"""The package's layers, from its imports (read with ast, function-level imports included): no import circle, and no
module importing a layer above its own. From the top: the server glue (gateway, the Triton bridge, parity), the engine,
its configuration and image decoding, the runtime, the skills, the model, the kernels, and the leaves every layer may
use (errors, data URLs, slots)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kestrel_backend"
LAYERS = [("gateway", "server", "parity"), ("engine",), ("engine_config", "images"), ("runtime",), ("skills",), ("model",),
          ("kernels",), ("errors", "data_urls", "slots")]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules that `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    assert [m for m in graph() if m != "kestrel_backend" and layer(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    upward = [(m, t) for m, targets in graph().items() for t in targets
              if layer(m) is not None and layer(t) is not None and layer(t) < layer(m)]
    assert upward == []


def test_no_import_circle():
    edges, circles = graph(), []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == []


def test_no_private_name_crosses_a_module():
    """A name with a leading underscore is its module's own: no module imports one from another, or reaches one
    through another module (`module._name`). What several modules share is public (kernels/shared.py)."""
    known, crossing = modules(), []
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name.rpartition(".")[2] for node in ast.walk(tree)  # (the package's, not torch's)
                   if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                       "kestrel_backend")) for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                crossing += [f"{name}: from {node.module} import {a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__"):
                crossing.append(f"{name}: {node.value.id}.{node.attr}")
    assert crossing == []
