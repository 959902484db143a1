"""Dependencies point one way: tiers uses lazyckpt; lazyckpt never imports tiers."""

from __future__ import annotations

import ast
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
