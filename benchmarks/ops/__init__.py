"""Operator entries of the benchmark harness.

Every module in this package that defines a module-level ``ENTRY`` (an
``benchmarks.harness.OpEntry``) is picked up automatically; adding an operator
to the benchmarks means adding one file here and nothing else.  Modules whose
name starts with an underscore are ignored.
"""

from __future__ import annotations

import importlib
import pkgutil


def load_entries() -> dict:
    """Import every entry module and return ``{op name: OpEntry}`` in name order."""
    entries = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        entry = getattr(module, "ENTRY", None)
        if entry is None:
            continue
        if entry.name in entries:
            raise RuntimeError(f"two benchmark entries are named {entry.name!r}")
        entries[entry.name] = entry
    return entries
