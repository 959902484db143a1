"""Dependencies point one way: tiers uses lazyckpt; lazyckpt never imports tiers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import lazyckpt

PACKAGE = Path(lazyckpt.__file__).parent


def test_lazyckpt_sources_never_import_tiers() -> None:
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "tiers" or n.startswith("tiers.") for n in names), path


def test_importing_lazyckpt_does_not_load_tiers() -> None:
    code = "import sys, lazyckpt, lazyckpt.testing; print('tiers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_builtin_tiers_register_through_the_entry_point() -> None:
    found = lazyckpt.available_tiers()
    assert {"host", "file"} <= set(found)
    tier = lazyckpt.load_tier("file", "/nonexistent/never/opened")
    assert tier.name == "file"


def test_public_names_are_exported() -> None:
    for name in lazyckpt.__all__:
        assert hasattr(lazyckpt, name), name


# The packages of lazyckpt, lowest first (docs/design.md opens with this picture). A module
# may import modules of its own package or layer, or of a lower one, never of a higher one;
# imports inside functions and under TYPE_CHECKING count like any other. Inside a package
# the modules may import each other, without cycles (test_no_import_cycles).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_errors", "hooks", "_progress", "_gcpause", "_metrics"),  # leaves
    ("_distributed",),  # the ranks: coordinator, chunk records, placement, preemption
    ("_format",),  # state walk, tagged values, manifest and its encodings, crc joining
    ("_options",),  # the Checkpointer's options, read by everything above
    ("_tiering",),  # the tier contract, shard states, host arena, tier calls
    ("tier",),  # the contract's public face, for tier authors
    ("_capture",),  # CPU and CUDA capture, the guard's optimizers
    ("_restore",),  # restore, verified fetch, keys and into, lazy, reshard, verify
    ("_engine",),  # the scheduler: loop, flights, flows, commits, records, incremental
    ("_checkpointer",),  # the facades, their core, step operations, lifecycle, handles
    ("", "timeline"),  # the public names
    ("cli", "integrations", "testing", "__main__"),  # users of the public names
)

# the subpackages, each with a docstring that says what it may import
SUBPACKAGES = ("_distributed", "_format", "_tiering", "_capture", "_restore", "_engine", "_checkpointer")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Every module of the package (dotted, relative to it: "" is the package itself) and
    the package modules it imports, wherever the import statement stands."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)]
                else:
                    if not (node.module or "").startswith("lazyckpt"):
                        continue
                    base = []
                module = (node.module or "").removeprefix("lazyckpt").lstrip(".") if not node.level else node.module or ""
                stem = ".".join([*base, *([module] if module else [])])
                # `from X import name`: the submodule X.name where there is one, else X itself
                candidates = [
                    sub if (sub := f"{stem}.{a.name}".lstrip(".")) in modules else stem
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                candidates = [
                    a.name.removeprefix("lazyckpt").lstrip(".")
                    for a in node.names
                    if a.name == "lazyckpt" or a.name.startswith("lazyckpt.")
                ]
            else:
                continue
            targets.update(c for c in candidates if c in modules and c != name)
        found[name] = targets
    return found


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for depth, layer in enumerate(LAYERS):
        if module in layer or top in layer:
            return depth
    raise AssertionError(f"lazyckpt.{module} is in no layer: add it to LAYERS and docs/design.md")


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"lazyckpt.{m} (layer {_layer(m)}) imports lazyckpt.{t} (layer {_layer(t)})"
        for m, targets in _imports().items()
        for t in targets
        if _layer(t) > _layer(m)
    ]
    assert not upward, upward


def test_each_subpackage_says_what_it_may_import() -> None:
    # the "May import:" line of each subpackage's docstring is the truth the layers allow,
    # and the package imports nothing it does not name there
    found = _imports()
    for package in SUBPACKAGES:
        doc = (PACKAGE / package / "__init__.py").read_text()
        assert doc.startswith('"""'), package
        line = doc[doc.index("May import:") :].split(".\n", 1)[0]
        allowed = set(re.findall(r"``([\w.]+)``", line))
        assert allowed, package
        for name in allowed:
            assert _layer(name) < _layer(package), f"{package} says it may import {name}, a layer above"
        used = {
            t.split(".")[0]
            for m, targets in found.items()
            if m.split(".")[0] == package
            for t in targets
            if t.split(".")[0] != package
        }
        assert used <= allowed, f"{package} imports {sorted(used - allowed)} beyond its docstring"
    listed = {p.parent.name for p in PACKAGE.glob("_*/__init__.py")}
    assert listed == set(SUBPACKAGES), listed ^ set(SUBPACKAGES)


def test_the_top_holds_public_modules_and_a_few_leaves() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    layered = {name for layer in LAYERS for name in layer}
    for name in top:
        stem = name.removesuffix(".py").replace("__init__", "")
        assert stem in layered, f"lazyckpt/{name} is in no layer"


def test_no_import_cycles() -> None:
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(f"lazyckpt.{c}" for c in cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)



def test_the_plugin_interface_is_one_module() -> None:
    # every capability protocol the package defines is offered by lazyckpt.tier, with the
    # base class, the errors a tier raises and the registry: a tier author imports one thing
    import lazyckpt.tier

    defined = {
        node.name
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.startswith("Supports")
    } - {"SupportsMetrics"}  # what export_prometheus takes: a Checkpointer's ability, not a tier's
    assert defined >= {"SupportsStaging", "SupportsGlobalCommit", "SupportsRankManifests", "SupportsBlockRead"}
    needed = defined | {"Tier", "Retention", "backend_errors", "translate_os_error", "load_tier", "TierBrokenError"}
    assert needed <= set(lazyckpt.tier.__all__)
    for name in lazyckpt.tier.__all__:
        assert hasattr(lazyckpt.tier, name), name


def test_builtin_tiers_use_only_the_plugin_interface() -> None:
    # the built-in tiers are written as a third-party tier is: everything from lazyckpt.tier
    # (hooks only for the named crash points of the tests), nothing private
    import tiers

    allowed = {"lazyckpt.tier", "lazyckpt.hooks"}
    for path in Path(tiers.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                module = node.module or ""
                found = {module} if module != "lazyckpt" else {f"lazyckpt.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found = {a.name for a in node.names}
            else:
                continue
            used = {m for m in found if m == "lazyckpt" or m.startswith("lazyckpt.")}
            assert used <= allowed, f"{path.name} imports {sorted(used - allowed)}"
