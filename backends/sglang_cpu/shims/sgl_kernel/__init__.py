"""Stand-in for `sgl_kernel` (the `sglang-kernel` wheel) on machines without CUDA.

Why it exists: the real package cannot be imported without libcuda, yet SGLang imports it (and
its submodules such as `sgl_kernel.kvcacheio`) at module level in many places. With
`SGLANG_USE_CPU_ENGINE=1` on a CPU without Intel AMX, SGLang takes its torch-native paths and
should never call into it. Every attribute, at any depth and in any submodule, is a placeholder
that raises `SglKernelUnavailable` when called, so an unexpected call is loud, not silent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+cpu.stand.in"


class SglKernelUnavailable(RuntimeError):
    """A CUDA kernel was called on the CPU rig: a CPU path in SGLang is missing or misrouted."""


class _Missing:
    """A placeholder for one kernel (or namespace); attribute access nests, calling raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise SglKernelUnavailable(
            f"{self._qualname} was called, but sgl_kernel is a CPU stand-in "
            "(backends/sglang_cpu/shims); SGLang should take a torch-native path here"
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._qualname}>"


class _StubModule(types.ModuleType):
    """A module whose unknown attributes are `_Missing` placeholders."""

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any `sgl_kernel.<sub>` module on import, as a `_StubModule` package."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name, "sgl_kernel CPU stand-in submodule")
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"{__name__}.{name}")


if not any(isinstance(finder, _SubmoduleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())
