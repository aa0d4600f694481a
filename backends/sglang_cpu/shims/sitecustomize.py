"""CPU-rig patches for SGLang, applied lazily in every Python process started with the shims.

Python imports `sitecustomize` at startup from `PYTHONPATH`, so this runs in the SGLang server,
its scheduler and detokenizer subprocesses, and any other Python process sharing that
environment. It therefore does nothing unless `SGLANG_USE_CPU_ENGINE=1`, and even then imports
no SGLang module itself: it installs an import hook that patches a module right after the module
is first imported by SGLang. Each patch below says why it exists.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any


def _mooncake_generic_send_path(module: types.ModuleType) -> None:
    """Send the KV through Mooncake's generic path instead of the CUDA host-index path.

    `MooncakeKVSender.supports_host_tensor_indices = True` (disaggregation/mooncake/conn.py) makes
    `disaggregation/prefill.py` pin memory and record a CUDA event on the first PD request,
    which fails without a GPU. With False the prefill sends on the device-agnostic path.
    """
    module.MooncakeKVSender.supports_host_tensor_indices = False


# module name -> patch applied right after that module executes
PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.disaggregation.mooncake.conn": _mooncake_generic_send_path,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the real spec via the other finders, then wraps its loader's exec_module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                _wrap_exec_module(spec.loader, patch)
                return spec
        return None


def _wrap_exec_module(loader: Any, patch: Callable[[types.ModuleType], None]) -> None:
    """Shadow exec_module on this one loader instance (loaders are per module)."""
    original = loader.exec_module

    def exec_module(module: types.ModuleType) -> None:
        original(module)
        patch(module)

    loader.exec_module = exec_module


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _PatchAfterImport())
