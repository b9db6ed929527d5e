"""Runs a registration when a module is first imported, or at once if it already is: for the
parts of torch that fusedops registers with but whose import ``import fusedops`` should not
pay for (torch.distributed.tensor's sharding rules, about 0.4 s; torch.utils.flop_counter's
formulas, which import triton)."""

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable


class _RunOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `name` is looked up, it lets the usual finders find the
    module and runs `register` once that spec's module has run. It stays in sys.meta_path until
    then: a lookup that only asks for the spec (importlib.util.find_spec, as
    torch._logging.set_logs does) runs nothing."""

    def __init__(self, name: str, register: Callable[[], None]):
        self._name = name
        self._register = register
        self._finding = threading.local()

    def find_spec(self, name, path, target=None):
        if name != self._name or getattr(self._finding, "active", False):
            return None
        self._finding.active = True  # (the lookup below asks every finder again, this one too)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.active = False
        if spec is not None and spec.loader is not None:
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                self._register()

            spec.loader.exec_module = exec_module
        return spec


def when_imported(name: str, register: Callable[[], None]) -> None:
    """Calls `register` now if module `name` is imported, else right after its import."""
    if name in sys.modules:
        register()
    else:
        sys.meta_path.insert(0, _RunOnImport(name, register))
