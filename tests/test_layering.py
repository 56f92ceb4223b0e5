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
    "container": 1, "manifest": 1, "manifest_files": 1, "formats": 1, "torchsave": 1, "checksums": 1,
    "storage": 1, "storage.": 1,
    # 2: the data path between tensors and shard files
    "pipeline": 2, "pipeline.": 2, "staging": 2, "selection": 2, "derived": 2, "describe": 2,
    "costmodel": 2, "reshard": 2,
    # 3: one file: save / load / parts of a file / the files beside it
    "": 3, "api": 3, "lazy": 3, "siblings": 3,
    # 4: a checkpoint of many files: commit, discovery, retention, the open step
    "collectives": 4, "verdict": 4, "commit": 4, "discovery": 4, "retention": 4, "opened": 4, "tagreader": 4,
    "tiers": 4, "tiers.": 4,
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
    assert "storage.locations" in imports("manifest")


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


# ------------------------------------------------------------------ file I/O only in storage/

#: Modules that may touch files directly: the storage backends and `fileio.py` under them.
STORAGE_MODULES = ("storage", "storage.", "fileio")
#: `os` functions that open, read, write, sync, rename, list, stat or remove files.
OS_IO = {"open", "fdopen", "read", "write", "pread", "preadv", "pwrite", "pwritev", "close",
         "replace", "rename", "renames", "fsync", "fdatasync", "unlink", "remove", "rmdir",
         "removedirs", "mkdir", "makedirs", "listdir", "scandir", "stat", "lstat", "fstat", "walk",
         "link", "symlink", "truncate", "ftruncate", "chmod", "utime", "posix_fadvise",
         "sendfile", "copy_file_range", "dup2"}
#: `os.path` functions that look at the file system (not the pure string ones).
OS_PATH_IO = {"exists", "lexists", "isdir", "isfile", "islink", "getsize", "getmtime", "samefile"}
#: `pathlib.Path` methods that do I/O. `exists`, `stat`, `open`, `replace` and `rename` are left
#: out: the same names are the storage interface's own (`storage.exists`, `storage.rename`),
#: `dataclasses.replace`, `str.replace`, a zip member's `open`; their `os` forms are caught.
PATH_IO = {"read_bytes", "write_bytes", "read_text", "write_text", "iterdir", "glob", "rglob",
           "mkdir", "unlink", "rmdir", "touch", "is_dir", "is_file", "is_symlink", "lstat",
           "chmod", "symlink_to", "hardlink_to", "samefile"}
#: `fileio.py`'s functions that do I/O (its constants and path checks are free to use).
FILEIO_IO = {"read_bounded", "atomic_write_bytes", "write_if_absent", "fsync_dir", "staged_directory",
             "ShardFileWriter", "prefetch"}
#: Other modules whose functions are file I/O.
IO_MODULES = {"shutil", "glob", "tempfile"}

#: What stays path-based for now, by module, and why (docs/STORAGE.md lists the same). Each
#: entry must still be used: a stale one fails `test_the_file_io_allowlist_is_current`.
FILE_IO_ALLOWED: dict[str, tuple[set[str], str]] = {
    "cli": ({"os.open", "os.dup2", "os.close"},
                     "stdout redirected to /dev/null after a broken pipe: the process's own "
                     "stream, not checkpoint bytes"),
    "cli.common": ({"Path.is_file", "Path.is_dir", "Path.iterdir", "Path.rglob", "Path.mkdir",
                    "os.path.lexists", "shutil.copy2"},
                   "the conversion commands walk a local folder tree (links inside followed, "
                   "links out left out) and copy its other files with their times and modes; "
                   "for a URL, a temporary local copy of it (cli.transfer)"),
    "cli.compress": ({"Path.is_file", "Path.iterdir", "Path.mkdir", "fileio.staged_directory"},
                     "a local output folder published by one rename (`staged_directory`)"),
    "cli.decompress": ({"fileio.staged_directory"},
                       "a local output folder published by one rename (`staged_directory`)"),
    "cli.transfer": ({"tempfile.TemporaryDirectory"},
                     "a conversion command's URL input copied into, or its URL output written in, "
                     "a temporary local folder the command walks (links followed inside it)"),
    "cli.to_universal": ({"fileio.staged_directory"},
                         "a local output folder published by one rename (`staged_directory`)"),
    "compat": ({"Path.is_file", "Path.read_text", "os.chmod", "fileio.atomic_write_bytes"},
               "DeepSpeed's recovery script in the save directory, rewritten in place with its "
               "executable bit (a POSIX mode the storage interface does not carry)"),
    "deepspeed._compat": ({"glob.glob", "os.path.exists"},
                          "DeepSpeed's own file names, as its loader globs them and checks they exist "
                          "(for a path; a URL's through the storage)"),
    "deepspeed.saves": ({"open"}, "the user's `log_jsonl` file, appended a line per commit"),
    "demo.train": ({"open", "Path.mkdir"},
                   "the demo job's own files (its data, its log), not checkpoint bytes"),
    "demo.compare": ({"Path.glob", "Path.is_file", "Path.read_text"}, "the demo's result files"),
    "demo.data": ({"Path.read_bytes"}, "the demo's data set"),
}


def file_io_calls(module: str) -> set[str]:
    return file_io_calls_in(MODULES[module].read_text())


def file_io_calls_in(source: str) -> set[str]:
    """The file I/O that code does itself, as names like ``os.replace`` or ``Path.read_bytes``
    (method calls by their name alone: see `PATH_IO`)."""
    tree = ast.parse(source)
    fileio_names = {a.asname or a.name: a.name for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("fileio")
                    for a in n.names if a.name in FILEIO_IO}
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            if func.id == "open":
                found.add("open")
            elif func.id in fileio_names:
                found.add(f"fileio.{fileio_names[func.id]}")
        elif isinstance(func, ast.Attribute):
            owner = func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else None
            if owner_name == "os" and func.attr in OS_IO:
                found.add(f"os.{func.attr}")
            elif (isinstance(owner, ast.Attribute) and owner.attr == "path"
                  and isinstance(owner.value, ast.Name) and owner.value.id == "os"
                  and func.attr in OS_PATH_IO):
                found.add(f"os.path.{func.attr}")
            elif owner_name in IO_MODULES:
                found.add(f"{owner_name}.{func.attr}")
            elif owner_name == "fileio" and func.attr in FILEIO_IO:
                found.add(f"fileio.{func.attr}")
            elif func.attr in PATH_IO:
                found.add(f"Path.{func.attr}")
    return found


def _is_storage(module: str) -> bool:
    return any(module == p or (p.endswith(".") and module.startswith(p)) for p in STORAGE_MODULES)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _is_storage(m)))
def test_file_io_goes_through_storage(module: str) -> None:
    allowed = FILE_IO_ALLOWED.get(module, (set(), ""))[0]
    direct = file_io_calls(module) - allowed
    assert not direct, (f"{module or '<package>'} does file I/O itself: {sorted(direct)}; go through "
                        "nvcomp_ckpt_engine.storage (or list it in FILE_IO_ALLOWED with the reason)")


def test_the_file_io_allowlist_is_current() -> None:
    stale = {m: sorted(calls - file_io_calls(m)) for m, (calls, _) in FILE_IO_ALLOWED.items()
             if m not in MODULES or calls - file_io_calls(m)}
    assert not stale, f"FILE_IO_ALLOWED lists I/O these modules no longer do: {stale}"


def test_the_file_io_check_sees_every_form() -> None:
    """Guards the check above against passing vacuously."""
    source = ("import os, shutil\nfrom pathlib import Path\nfrom . import fileio\n"
              "from .fileio import read_bounded as rb\n"
              "def f(p):\n    open(p)\n    os.replace(p, p)\n    os.path.lexists(p)\n"
              "    shutil.rmtree(p)\n    Path(p).read_bytes()\n    fileio.fsync_dir(p)\n    rb(p, 1)\n"
              "    'a'.replace('a', 'b')\n    fileio.is_inside(p, p)\n")
    found = file_io_calls_in(source)
    assert found == {"open", "os.replace", "os.path.lexists", "shutil.rmtree", "Path.read_bytes",
                     "fileio.fsync_dir", "fileio.read_bounded"}


# ------------------------------------------------------------------ multi-process tests are slow

TESTS = Path(__file__).resolve().parent
#: Strings of a command that starts a multi-process job (a launcher, or ranks by count).
LAUNCH_TOKENS = ("torch.distributed.run", "torchrun", "deepspeed.launcher", "mpirun", "sbatch",
                 "--nproc_per_node")
#: Calls that start processes of this Python: torch.multiprocessing.spawn, a multiprocessing
#: context (the test then starts its processes).
SPAWN_CALLS = {"spawn", "start_processes", "get_context"}


def _statements(unit: ast.AST) -> list[ast.AST]:
    """Every node of `unit` except docstrings (a docstring may name a launcher it does not run)."""
    docstrings = {id(n.body[0].value) for n in ast.walk(unit)
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    return [n for n in ast.walk(unit) if id(n) not in docstrings]


def _starts_processes(unit: ast.AST) -> bool:
    """`unit` itself starts a multi-process job: a spawn call or a launcher command."""
    for node in _statements(unit):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in SPAWN_CALLS):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                token in node.value for token in LAUNCH_TOKENS):
            return True
    return False


def _units(tree: ast.Module) -> dict[str, ast.AST]:
    """A module's top-level functions and classes (a class as a whole), by name."""
    return {n.name: n for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _imported(tree: ast.Module, modules: set[str]) -> dict[str, tuple[str, str]]:
    """Names imported from other test modules: local name -> (module, name)."""
    return {a.asname or a.name: (n.module, a.name) for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.module in modules for a in n.names}


def _annotation_names(unit: ast.AST) -> set[int]:
    """Names inside type hints of `unit`: a hint (`launcher: Launcher`) starts nothing."""
    hints = [n.annotation for n in ast.walk(unit) if isinstance(n, (ast.arg, ast.AnnAssign))]
    hints += [n.returns for n in ast.walk(unit) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return {id(m) for h in hints if h is not None for m in ast.walk(h) if isinstance(m, ast.Name)}


def launching_units(sources: dict[str, str]) -> dict[str, set[str]]:
    """Per test module, the top-level functions and classes that start a multi-process job,
    themselves or through what they use: helpers, classes, fixtures (by parameter name) and
    names imported from other test modules."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    units = {m: _units(t) for m, t in trees.items()}
    imports = {m: _imported(t, set(trees)) for m, t in trees.items()}
    launching = {m: {name for name, u in us.items() if _starts_processes(u)} for m, us in units.items()}
    changed = True
    while changed:
        changed = False
        for module, found in units.items():
            for name, unit in found.items():
                if name in launching[module]:
                    continue
                names = [n for n in ast.walk(unit) if isinstance(n, ast.Name)
                         and id(n) not in _annotation_names(unit)]
                local = {n.id for n in names if isinstance(n.ctx, ast.Store)}
                used = {n.id for n in names if isinstance(n.ctx, ast.Load)} - local
                used |= {a.arg for n in ast.walk(unit) if isinstance(n, ast.arguments)
                         for a in n.args + n.kwonlyargs}
                if used & launching[module] or any(
                        imports[module][u][1] in launching[imports[module][u][0]]
                        for u in used & set(imports[module])):
                    launching[module].add(name)
                    changed = True
    return launching


def _marked_slow(node: ast.AST, units: dict[str, ast.AST]) -> bool:
    """`slow` on the test: in a decorator, or in the cases a decorator takes from a helper
    (``pytest.param(..., marks=pytest.mark.slow)``)."""
    for decorator in getattr(node, "decorator_list", ()):
        helpers = [units[n.id] for n in ast.walk(decorator) if isinstance(n, ast.Name) and n.id in units]
        if any("mark.slow" in ast.unparse(d) for d in (decorator, *helpers)):
            return True
    return False


def unmarked_multi_process_tests(sources: dict[str, str],
                                 fixture_marked: dict[str, set[str]]) -> list[str]:
    """Test functions that start a multi-process job but do not carry `slow`: not on the
    function, not in the module's `pytestmark`, not through conftest's fixture list."""
    launching = launching_units(sources)
    missing = []
    for module, source in sources.items():
        tree = ast.parse(source)
        module_slow = any(isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n.targets[0])
                          and "mark.slow" in ast.unparse(n.value) for n in tree.body)
        units = _units(tree)
        for name, unit in units.items():
            if not name.startswith("test_") or name not in launching[module]:
                continue
            args = {a.arg for a in unit.args.args} if isinstance(unit, ast.FunctionDef) else set()
            if not (module_slow or _marked_slow(unit, units) or args & fixture_marked.get(module, set())):
                missing.append(f"{module}.{name}")
    return missing


def _test_sources() -> dict[str, str]:
    """Every test module but this one (whose marker check quotes launchers as test data)."""
    return {p.stem: p.read_text() for p in TESTS.rglob("*.py") if p != Path(__file__).resolve()}


def test_every_multi_process_test_is_marked_slow() -> None:
    from conftest import MULTI_PROCESS_FIXTURES

    missing = unmarked_multi_process_tests(_test_sources(), MULTI_PROCESS_FIXTURES)
    assert not missing, f"these tests start several processes: mark them @pytest.mark.slow: {missing}"


def test_the_marker_check_follows_helpers_fixtures_and_imports() -> None:
    """Guards the check above against passing vacuously: a launch reached through a helper, a
    fixture, or a class imported from another test module, is found unless marked."""
    sources = {
        "test_a": "import torch.multiprocessing as mp\n"
                  "def run_ranks(fn):\n    mp.spawn(fn, nprocs=2)\n"
                  "class Launcher:\n    def run(self):\n"
                  "        subprocess.run(['python', '-m', 'torch.distributed.run'])\n"
                  "def test_direct():\n    run_ranks(print)\n"
                  "@pytest.mark.slow\ndef test_marked():\n    run_ranks(print)\n"
                  "def test_fast():\n    '''Not torchrun.'''\n    subprocess.run(['python', '-c', ''])\n",
        "test_b": "import pytest\nfrom test_a import Launcher\n"
                  "@pytest.fixture\ndef runs():\n    return Launcher()\n"
                  "def test_through_a_fixture(runs):\n    pass\n"
                  "def test_listed(listed):\n    pass\n",
        "test_d": "from test_a import Launcher\n"
                  "class Runs:\n    def __init__(self, launcher: Launcher) -> None:\n"
                  "        self.launcher = launcher\n"
                  "def test_with_a_fake_launcher():\n    Runs(object())\n"
                  "def test_with_the_real_one():\n    Runs(Launcher())\n",
        "test_c": "import pytest\nfrom test_a import Launcher\n"
                  "pytestmark = [pytest.mark.gpu, pytest.mark.slow]\n"
                  "def test_module_marked():\n    Launcher().run()\n",
    }
    missing = unmarked_multi_process_tests(sources, {"test_b": {"listed"}})
    assert missing == ["test_a.test_direct", "test_b.test_through_a_fixture",
                       "test_d.test_with_the_real_one"]
