"""The package's layers (docs/ARCHITECTURE.md): every module belongs to one, and imports point
down or within a layer, never up and never in a cycle. A new module must be placed here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nvcomp_ckpt_engine"

#: Layer of each module, by dotted name relative to the package or a package prefix ending in
#: ".": the most specific entry wins. Higher layers may import lower ones.
LAYERS = {
    # 0: what every layer may use
    "errors": 0, "_version": 0,
    # 1: bytes and formats (no framework, no data path)
    "fileio": 1, "transforms": 1, "codecs": 1, "codecs.": 1, "options": 1, "state": 1,
    "container": 1, "manifest": 1, "formats": 1,
    # 2: the data path between tensors and shard files
    "pipeline": 2, "pipeline.": 2, "staging": 2, "selection": 2, "derived": 2, "describe": 2,
    "costmodel": 2,
    # 3: one file: save / load / parts of a file / the files beside it
    "": 3, "api": 3, "lazy": 3, "siblings": 3,
    # 4: a checkpoint of many files: commit, discovery, retention, the open step
    "collectives": 4, "commit": 4, "discovery": 4, "retention": 4, "opened": 4, "tagreader": 4,
    # 5: framework adapters
    "config": 5, "compat": 5, "deepspeed": 5, "deepspeed.": 5, "dcp": 5, "dcp.": 5,
    "megatron": 5, "megatron_files": 5,
    # 6: entry points
    "cli": 6, "cli.": 6, "__main__": 6, "demo": 6, "demo.": 6,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer(module: str) -> int:
    if module in LAYERS:
        return LAYERS[module]
    prefixes = [p for p in LAYERS if p.endswith(".") and module.startswith(p)]
    if not prefixes:
        raise KeyError(module)
    return LAYERS[max(prefixes, key=len)]


def imports(module: str) -> set[str]:
    """The package's modules that `module` imports (at any depth of its code)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == PACKAGE.name:
                target = node.module.partition(".")[2]
            else:
                continue
            # `from X import y`: the module X.y where y is one, else X itself
            names = [f"{target}.{a.name}".lstrip(".") if f"{target}.{a.name}".lstrip(".") in MODULES
                     else target for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == PACKAGE.name]
        found |= {n for n in names if n in MODULES and n != module}
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = []
    for module in MODULES:
        try:
            layer(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"place these modules in LAYERS (and docs/ARCHITECTURE.md): {unplaced}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    upward = {m: layer(m) for m in imports(module) if layer(m) > layer(module)}
    assert not upward, f"{module or '<package>'} (layer {layer(module)}) imports higher layers: {upward}"


def test_no_import_cycles() -> None:
    graph = {m: imports(m) for m in MODULES}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_import_reader_sees_relative_and_absolute_imports() -> None:
    """Guards the checks above against passing vacuously."""
    assert {"api", "deepspeed._compat", "manifest"} <= imports("deepspeed.engine")
    assert "fileio" in imports("manifest")


#: Frameworks only their adapters (layer 5) and the entry points above them may import.
FRAMEWORKS = ("deepspeed", "megatron")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) < 5))
def test_below_the_adapters_no_framework_is_imported(module: str) -> None:
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
    assert not found & set(FRAMEWORKS), f"{module or '<package>'} imports {sorted(found & set(FRAMEWORKS))}"
