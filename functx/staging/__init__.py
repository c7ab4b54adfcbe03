"""Staging functx transforms: torch.compile support and `functx.jit` on it.

Importing torch._dynamo costs over a second, so functx does not: `watch_for_dynamo()`
registers functx's entry points with dynamo when something else imports it (torch.compile
does), or at once if it is already imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def _install():
    from . import dynamo

    dynamo.install()


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of `torch._dynamo` so that functx's rules are
    installed right after the module has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            loader.exec_module = exec_module
            _install()

        loader.exec_module = exec_then_install
        return spec


def watch_for_dynamo():
    if "torch._dynamo" in sys.modules:
        _install()
    elif not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())
