"""The benchmark scripts in benchmarks/ only use names their helper module defines.

compare_cpu.py is run by hand for an hour at a time, so a helper dropped from peers.py (as happened
once to `libiomp5` and `_guard_torchvision`) only surfaced as an AttributeError at the vLLM
configuration of the next run. This catches it at test time without starting any engine.
"""

import ast
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_compare_cpu_uses_only_names_peers_defines():
    peers = _module("peers")
    tree = ast.parse((BENCHMARKS / "compare_cpu.py").read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "peers"}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "peers"
                for alias in node.names}
    assert used and imported
    assert sorted(name for name in used | imported if not hasattr(peers, name)) == []

