"""Triton interpreter fix for NumPy >= 2.4: scalars are 1-element arrays there, and NumPy no longer
converts those with int(), so `range(start, stop)` with runtime bounds fails inside interpreted
kernels. `install()` makes `tensor.__index__` use `.item()` (idempotent; compiled kernels unaffected).
"""
from __future__ import annotations

import triton.runtime.interpreter as _interp

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    original = _interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = patched
    _INSTALLED = True
