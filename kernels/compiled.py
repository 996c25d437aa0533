"""Which Triton programs this process has compiled: every kernel of `kernels/` and the
specialisations each holds, read from Triton's in-memory caches. For checks that a warm-up left
nothing to compile later (tests/gpu/test_warm_up.py, `treeserve bench first-use`)."""
from __future__ import annotations

import importlib
import pkgutil

from triton.runtime.jit import JITFunction


def jit_functions() -> dict[str, JITFunction]:
    """Every `@triton.jit` function of `kernels/`, as module.name (wrappers such as autotuners
    unwrapped). Helpers that kernels call (`silu`, ...) and functions one module imports from
    another are listed too, under each name; only launched kernels ever hold compiled programs."""
    import kernels

    found = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for name, obj in vars(module).items():
            while obj is not None and not isinstance(obj, JITFunction):
                obj = getattr(obj, "fn", None)
            if obj is not None:
                found[f"{info.name}.{name}"] = obj
    return found


def compiled(fns: dict[str, JITFunction]) -> set[tuple[str, str]]:
    """(kernel, specialisation key) of every program of `fns` compiled so far, on any device."""
    return {(name, str(key)) for name, fn in fns.items() for caches in fn.device_caches.values() for key in caches[0]}


def forget(fns: dict[str, JITFunction]) -> None:
    """Drop the in-memory programs of `fns` (Triton rebuilds its cache at the next launch, from its
    disk cache when it can), so that programs compiled earlier in the process are counted again."""
    for fn in fns.values():
        fn.device_caches.clear()
