"""The package's layout as docs/design.md draws it ("Layout"), checked from the imports: each room
(the top-level modules, a subpackage) imports only from its own room and the layers below it, so
the folders tell the architecture and stay telling it. Lazy imports inside functions count too.
Runs without the compiled library: it reads the source."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dblast_ext"

# bottom to top; a room may import its own modules and those of every layer below its own
LAYERS = [
    ("face",),                 # the top-level modules: ops, reference and the shared vocabulary
    ("target",),               # the target and its caches
    ("drafting",),             # the drafter family
    ("decoding",),             # the decode loop
    ("training", "eval"),      # side by side: neither imports the other
    ("vllm",),                 # serving through vLLM
    ("cli",),                  # the command line, over everything
]
LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
MAX_TOP_LEVEL_MODULES = 12


def module_name(path: pathlib.Path) -> str:
    parts = ("dblast_ext",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "drafters" not in p.parts}
COMPILED = {"dblast_ext._C"}  # the op library, loaded by the face


def room(module: str) -> str:
    """The room a module belongs to: its subpackage, or "face" for a top-level module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"  # dblast_ext/__init__.py: the public face, which re-exports from every room
    return parts[1] if f"dblast_ext.{parts[1]}" in MODULES and MODULES[f"dblast_ext.{parts[1]}"].name == "__init__.py" \
        else "face"


def imports(module: str):
    """(line, imported module) for every import of a dblast_ext module in `module`'s source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("dblast_ext"):
                continue
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES.keys() | COMPILED]
            if submodules and len(submodules) == len(node.names):
                yield from ((node.lineno, m) for m in submodules)  # from pkg import module, module
            else:
                yield node.lineno, base
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("dblast_ext"))


def test_every_room_has_a_layer():
    rooms = {room(m) for m in MODULES} - {"package"}
    assert rooms == set(LAYER_OF), "a new subpackage needs its place in LAYERS and in docs/design.md's layout"


def test_no_module_imports_against_the_layers():
    wrong = []
    for module in sorted(MODULES):
        here = room(module)
        if here == "package":
            continue
        for line, imported in imports(module):
            there = room(imported) if imported in MODULES else "face"  # a name from the package: its face
            if there == here or there == "package" and imported != "dblast_ext":
                continue
            if there == "package" or LAYER_OF[there] >= LAYER_OF[here]:
                wrong.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {imported} "
                             f"({here} may not import {there})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_top_level_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_each_subpackage_says_what_it_holds_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.parent.name}/__init__.py opens with no docstring"
        assert "May import" in doc, f"{init.parent.name}/__init__.py does not say what it may import"


def test_the_check_sees_an_import_against_the_layers(tmp_path):
    """The check can fail: an import running up (the target importing the decode loop) is seen."""
    module = "dblast_ext.target.adapter"
    source = MODULES[module].read_text()
    planted = tmp_path / "adapter.py"
    planted.write_text(source + "\n\ndef _planted():\n    from ..decoding import decoder\n")
    real, MODULES[module] = MODULES[module], planted
    try:
        bad = [(line, m) for line, m in imports(module) if room(m) == "decoding"]
    finally:
        MODULES[module] = real
    assert bad and LAYER_OF["decoding"] > LAYER_OF["target"]
