"""The house rules of the source tree, read from the code itself (``ast``, no imports).

- imports flow one way: no circle among ``flax_ln``'s modules, ``TYPE_CHECKING`` and
  in-function imports counted;
- no module imports another module's underscore name;
- no file in ``flax_ln/`` holds more than one concept's worth of lines;
- ``torch_ref`` imports nothing from ``flax_ln``, JAX or flax, and the engine does not import the book.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600  # past this a file holds more than one concept (CONTRIBUTING.md, "Rules the code keeps")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """Every import in the file: (imported module, names taken from it, line), relative imports resolved."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the flax_ln modules it imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target, names, _ in _imports(path, module):
            for candidate in [target, *(f"{target}.{n}" for n in names)]:
                if candidate in modules and candidate != module:
                    edges[module].add(candidate)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def _is_parent_package(package: str, module: str) -> bool:
    """A package's ``__init__`` may re-export its own submodules' names, and a submodule may not."""
    return module.startswith(package + ".")


def test_no_import_circle_among_flax_ln_modules():
    # ancestors are edges too (importing a.b.c runs a and a.b); a package importing its own
    # submodules is how it re-exports, so the package -> descendant edge is not a circle
    modules = _sources("flax_ln")
    edges = _edges(modules)
    for module in edges:
        edges[module] = {t for t in edges[module] if not _is_parent_package(module, t)}
    assert _cycles(edges) == []


def test_no_module_imports_another_modules_underscore_name():
    offences = []
    for package in ("flax_ln", "torch_ref"):
        for module, path in _sources(package).items():
            for target, names, line in _imports(path, module):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if target.startswith(("flax_ln", "torch_ref")) and private:
                    offences.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {target}")
    assert offences == []


def test_no_file_past_the_size_of_one_concept():
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "flax_ln").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}


def test_the_reference_and_the_engine_import_only_downwards():
    offences = []
    for module, path in _sources("torch_ref").items():
        for target, _, line in _imports(path, module):
            if target.split(".")[0] in ("flax_ln", "jax", "flax"):
                offences.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    for package, forbidden in (("flax_ln/parity", "flax_ln.book"), ("flax_ln/convert", "flax_ln.parity")):
        for module, path in _sources(package).items():
            for target, names, line in _imports(path, module):
                if target.startswith(forbidden) or any(f"{target}.{n}".startswith(forbidden) for n in names):
                    offences.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert offences == []


def test_the_checks_see_a_circle_and_an_underscore_import(tmp_path):
    # the helpers above must be able to fail: a planted circle and a planted private import
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    planted = tmp_path / "planted.py"
    planted.write_text("from flax_ln.convert.keymap import _hidden\nif True:\n    from . import sibling\n")
    found = _imports(planted, "flax_ln.convert.planted")
    assert ("flax_ln.convert.keymap", ["_hidden"], 1) in found
    assert ("flax_ln.convert", ["sibling"], 3) in found


# The rooms of flax_ln/parity/, lowest first: a module may import its own room and the rooms before it
# (docs/design.md, "The house of the parity engine"). report and sides share a level: neither imports the other.
PARITY_ROOMS = [{"core"}, {"records"}, {"islands"}, {"report", "sides"}, {"localize"}, {"top"}, {"streamed"}]
MAX_FILES_PER_FOLDER = 15  # modules, __init__.py aside: past this a folder holds more than one concept


def _parity_room(module: str) -> str:
    """The room of a module of flax_ln.parity: its folder, or ``top`` for the modules at the top."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (ROOT / "flax_ln/parity" / parts[-1]).is_dir() else "top"


def _room_level(room: str) -> int:
    return next(level for level, rooms in enumerate(PARITY_ROOMS) if room in rooms)


def _room_offences(modules: dict[str, Path]) -> list[str]:
    """Every import of a higher room (or of a room beside one's own), and every underscore name taken across rooms."""
    offences = []
    for module, path in modules.items():
        if module == "flax_ln.parity":  # the public face re-exports every room
            continue
        room = _parity_room(module)
        for target, names, line in _imports(path, module):
            if not target.startswith("flax_ln.parity."):
                continue
            other = _parity_room(target)
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line}"
            if other != room and _room_level(other) >= _room_level(room):
                offences.append(f"{where} ({room}) imports {target} ({other})")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if other != room and private:
                offences.append(f"{where} takes {private} from another room")
    return offences


def test_the_parity_rooms_import_only_downwards():
    modules = _sources("flax_ln/parity")
    assert {_parity_room(m) for m in modules if m != "flax_ln.parity"} == set().union(*PARITY_ROOMS)
    assert _room_offences(modules) == []


def test_the_room_check_sees_an_upward_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from flax_ln.parity.sides.torch import run_torch_side\nfrom flax_ln.parity.core import _x\n")
    offences = _room_offences({"flax_ln.parity.records.planted": planted})
    assert len(offences) == 2 and "(records) imports flax_ln.parity.sides.torch (sides)" in offences[0]


def test_no_folder_holds_more_than_one_concept_of_files():
    crowded = {
        str(folder.relative_to(ROOT)): n
        for folder in [ROOT / "flax_ln", *(ROOT / "flax_ln").rglob("*/")]
        if folder.is_dir() and (n := len(set(folder.glob("*.py")) - {folder / "__init__.py"})) > MAX_FILES_PER_FOLDER
    }
    assert crowded == {}
