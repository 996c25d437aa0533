"""Compile kernels for an H100 (sm_90) on a machine without a GPU.

The Triton interpreter accepts code the GPU compiler rejects (non power-of-two shapes, dtype
mismatches in tl.dot, scalar/vector mix-ups in loops...). `record_launches` captures the real
arguments of interpreted launches; `compile_sm90` runs the whole Triton pipeline (TTIR -> PTX ->
cubin with ptxas) for sm_90 on them and reports registers and spills. Compilation happens in a
fresh process without TRITON_INTERPRET, because an interpreted run leaves parts of
`triton.language` patched for the rest of the process.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile


# launch keywords that are compile options rather than kernel arguments
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")


@contextlib.contextmanager
def record_launches(kernel):
    """Collect (args, kwargs) of every launch of the interpreted `kernel` inside the block. kwargs
    also carry the launch options (`LAUNCH_OPTIONS`) where the launch gave them: the interpreter
    drops them before its hooks run, so they are caught on the way in."""
    calls = []
    options = {}

    def hook(*args, **kwargs):
        calls.append((args, {**kwargs, **options}))

    run = kernel.run

    def run_noting_options(*args, **kwargs):
        options.clear()
        options.update({k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs})
        return run(*args, **kwargs)

    kernel.add_pre_run_hook(hook)
    kernel.run = run_noting_options
    try:
        yield calls
    finally:
        kernel.pre_run_hooks.remove(hook)
        del kernel.run  # the class's own method again


def launch_spec(kernel, args, kwargs, num_warps: int = 4, num_stages: int = 3, maxnreg: int | None = None) -> dict:
    """A JSON-able description of one recorded launch: kernel location, signature, constexprs and the
    alignment attributes, specialised exactly as the GPU launcher would (ints equal to 1 become
    constexprs, ints divisible by 16 and 16-byte aligned pointers get `tt.divisibility`)."""
    import inspect

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    fn = kernel.fn
    params = list(inspect.signature(fn).parameters.items())
    values = dict(zip([name for name, _ in params], args))
    values.update(kwargs)
    signature, constexprs, aligned = {}, {}, []
    for i, (name, p) in enumerate(params):
        v = values[name]
        if "constexpr" in str(getattr(p.annotation, "__name__", p.annotation)):
            signature[name] = "constexpr"
            constexprs[name] = v.value if hasattr(v, "value") else v
            continue
        ty, spec = native_specialize_impl(BaseBackend, v, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = spec
        elif spec == "D":
            aligned.append(i)
    return {
        "module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
        "aligned": aligned, "num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg,
        "enable_fp_fusion": kwargs.get("enable_fp_fusion"),
    }


def compile_sm90(specs: list[dict], timeout: float = 600) -> list[dict]:
    """Compile every spec for sm_90 in a clean process; one result dict per spec:
    {"ok": bool, "error": str, "registers": int, "spill_bytes": int, "shared": int}."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(specs, f)
        path = f.name
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.kernels.sm90", path], env=env, cwd=root,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(f"sm_90 compile process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compile_one(spec: dict) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec.get("aligned", [])}
    src = ASTSource(fn=kernel, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={k: spec.get(k) for k in LAUNCH_OPTIONS if spec.get(k) is not None})
    except Exception as e:  # report, don't crash: the caller asserts
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
        ptx = f.name
    try:
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(ptx)
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"ok": True, "error": "", "registers": int(regs.group(1)) if regs else -1,
            "spill_bytes": int(spills.group(1)) if spills else -1, "shared": compiled.metadata.shared,
            "grid_dependency_control": all(f"griddepcontrol.{op}" in compiled.asm["ptx"]
                                           for op in ("launch_dependents", "wait"))}


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        todo = json.load(fh)
    print(json.dumps([_compile_one(s) for s in todo]))
