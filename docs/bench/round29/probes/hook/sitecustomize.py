# logs every Triton JIT compile (kernel name, ms, the calling frames of this project) to stderr
import os, sys, time, traceback
try:
    from triton import knobs
    _t = {}
    def _before(*args, **kw):
        _t["t"] = time.perf_counter()
        return False
    def _after(*args, **kw):
        fn = kw.get("fn")
        name = getattr(fn, "name", "?")
        ms = (time.perf_counter() - _t.get("t", time.perf_counter())) * 1e3
        frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack()
                  if "/work/main/" in f.filename and "sitecustomize" not in f.filename][-6:]
        print(f"COMPILE {name} {ms:.0f}ms {' < '.join(reversed(frames))}", file=sys.stderr, flush=True)
        return False
    knobs.runtime.jit_cache_hook = _before
    knobs.runtime.jit_post_compile_hook = _after
except Exception as exc:
    print("compile hook not installed:", exc, file=sys.stderr)
