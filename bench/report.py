"""What a benchmark's JSON report records of its software, and writing the report."""
from __future__ import annotations

import json
import pathlib
import sys


def versions() -> dict:
    """Python, torch, transformers and (where installed) Triton versions."""
    import torch
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def write(result: dict, out: str | None) -> None:
    """Write `result` as JSON to `out` (nothing when None) and say so."""
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
