"""Float64 sequential oracle for the SSM kernels: the one-token Mamba2 recurrence, run token by token.

Deliberately naive (Python loops, no closed forms, no chunking) so it shares no shortcut with the kernels.
"""
from __future__ import annotations

import math

import torch

from tests.kernels import interpret_compat

# kernels loop over runtime bounds, which the interpreter only handles with this fix on NumPy >= 2.4
interpret_compat.install()


def ring_window(ring: torch.Tensor, n: int) -> torch.Tensor:
    """A conv ring (D, W) of a slot at committed length n (the input at position p in column p mod W)
    -> its last W-1 inputs (D, W-1), oldest first; written out column by column, apart from the
    kernels' own `conv_window`."""
    W = ring.shape[1]
    return ring[:, [(n - (W - 1) + j) % W for j in range(W - 1)]]


def dt_act(dt_raw: torch.Tensor, dt_bias, dt_limit) -> torch.Tensor:
    v = dt_raw.double() + (0.0 if dt_bias is None else dt_bias.double())
    sp = torch.where(v > 20.0, v, torch.log1p(torch.exp(v.clamp(max=20.0))))
    lo, hi = (0.0, math.inf) if dt_limit is None else dt_limit
    return sp.clamp(min=float(lo), max=float(hi))


class Mamba2Step:
    """The one-token update of one layer with fixed weights; tensors indexed per token."""

    def __init__(self, A, D, dt_bias, dt_limit):
        self.A = A.double()
        self.D = None if D is None else D.double()
        self.dt_bias = dt_bias
        self.dt_limit = dt_limit

    def __call__(self, h, x, dt_raw, B, C, z=None):
        """h (H, P, N) f64, x (H, P), dt_raw (H,), B/C (G, N), z (H, P) -> (h_new, y (H, P))."""
        H = x.shape[0]
        rep = H // B.shape[0]
        dtv = dt_act(dt_raw, self.dt_bias, self.dt_limit)  # (H,)
        Bh = B.double().repeat_interleave(rep, 0)
        Ch = C.double().repeat_interleave(rep, 0)
        xd = x.double()
        h = torch.exp(dtv * self.A)[:, None, None] * h + (dtv[:, None] * xd)[..., None] * Bh[:, None, :]
        y = torch.einsum("hpn,hn->hp", h, Ch)
        if self.D is not None:
            y = y + self.D[:, None] * xd
        if z is not None:
            zd = z.double()
            y = y * zd * torch.sigmoid(zd)
        return h, y


def tree_outputs(step, h0_pool, x, dt, B, C, parent_lists, slot_idx, z=None):
    """Per-node y (T, H, P) f64: node i's y after running `step` along its root-to-i path from h0."""
    out = []
    t0 = 0
    for b, parents in enumerate(parent_lists):
        h0 = h0_pool[int(slot_idx[b])].double()
        for i in range(len(parents)):
            path = []
            j = i
            while j >= 0:
                path.append(j)
                j = parents[j]
            h = h0
            for j in reversed(path):
                t = t0 + j
                h, y = step(h, x[t], dt[t], B[t], C[t], None if z is None else z[t])
            out.append(y)
        t0 += len(parents)
    return torch.stack(out)


def chain_outputs(step, h0, x, dt, B, C, z=None):
    """Sequential run of one sequence: x (K, H, P) ... -> (y (K, H, P) f64, final state f64)."""
    h = h0.double()
    ys = []
    for k in range(x.shape[0]):
        h, y = step(h, x[k], dt[k], B[k], C[k], None if z is None else z[k])
        ys.append(y)
    return torch.stack(ys), h


# ---- shared inputs and checks for the SSM kernel tests -------------------------------------------


def layer_weights(H: int, gen: torch.Generator, a_max: float = 3.0):
    """(A (H,) negative, D (H,), dt_bias (H,)) of a random layer."""
    A = -(torch.rand(H, generator=gen) * a_max + 0.1)
    D = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, generator=gen) * 0.5
    return A, D, dt_bias


def rand(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Elementwise |a - e| <= tol * (|e| + max|e|): relative, with an absolute floor at the output's scale."""
    a = actual.double()
    e = expected.double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values (unwritten or overflowed)"
    bound = tol * (e.abs() + e.abs().max().clamp(min=1e-6))
    err = (a - e).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: max |err| {err.max().item():.3g} is {worst:.2f}x the bound (tol {tol})"


def nan_output(shape, dtype, device):
    """Poisoned replacement for `kernels.ssm_common.new_output`: unwritten elements stay NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_compiles_for_sm90(kernels, run, spills_ok=lambda spec: False, spill_bytes=lambda spec: 0) -> list[dict]:
    """Record the launches `run()` makes of the interpreted `kernels`, compile each for an H100
    (sm_90, full pipeline down to ptxas) in a clean process, and require success, and no register
    spills unless `spills_ok(spec)` (spec: see tests.kernels.sm90.launch_spec), or at most
    `spill_bytes(spec)` bytes of them (a known small spill, bounded). Kernels with a `PDL`
    constexpr compile with it on, and must then carry both grid-dependency instructions."""
    import contextlib

    from tests.kernels.sm90 import compile_sm90, launch_spec, record_launches

    with contextlib.ExitStack() as stack:
        recorded = [(k, stack.enter_context(record_launches(k))) for k in kernels]
        run()
    specs = []
    for kernel, calls in recorded:
        assert calls, f"{kernel.fn.__name__} was not launched"
        for args, kwargs in calls:
            spec = launch_spec(kernel, args, kwargs, num_warps=kwargs.get("num_warps", 4),
                               num_stages=kwargs.get("num_stages", 3), maxnreg=kwargs.get("maxnreg"))
            if "PDL" in spec["constexprs"]:  # as an H100 launches it (the interpreter never does)
                spec["constexprs"]["PDL"] = True
            specs.append(spec)
    results = compile_sm90(specs)
    for spec, res in zip(specs, results):
        assert res["ok"], f"{spec['name']} {spec['constexprs']}: {res['error']}"
        if "PDL" in spec["constexprs"]:
            assert res["grid_dependency_control"], f"{spec['name']}: no griddepcontrol in its PTX"
        assert res["spill_bytes"] <= spill_bytes(spec) or spills_ok(spec), \
            f"{spec['name']} {spec['constexprs']} spills: {res}"
    return results


# ---- random kernel inputs (built on the CPU from a seed, then moved with `on`) -------------------

LIMIT = (0.0, float("inf"))


def on(args: dict, device) -> dict:
    """The same inputs on `device` (tensors moved, everything else kept)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _dt(gen, shape, dtype, dt_scale, dt_shift):
    return (rand(gen, *shape) * dt_scale + dt_shift).to(dtype)


def tree_case(spec, H, P, N, G, seed, dtype=torch.float32, slots=5, dt_scale=1.0, dt_shift=0.0, a_max=3.0,
              with_z=True):
    """(kwargs of tree_ssd_scan, per-tree parent lists) for trees `spec = [(size, kind), ...]`."""
    import random

    from tests.kernels import tree_cases

    gen = torch.Generator().manual_seed(seed)
    parents, cu, max_nodes, lists = tree_cases.packed_batch(spec, random.Random(seed))
    T = int(cu[-1])
    A, D, dt_bias = layer_weights(H, gen, a_max)
    slot_idx = torch.randperm(slots, generator=gen)[: len(spec)].to(torch.int32)
    return dict(
        x=rand(gen, T, H, P, dtype=dtype), dt=_dt(gen, (T, H), dtype, dt_scale, dt_shift), A=A,
        B=rand(gen, T, G, N, dtype=dtype), C=rand(gen, T, G, N, dtype=dtype), D=D, dt_bias=dt_bias,
        ssm_state=rand(gen, slots, H, P, N), parents=parents, cu_seqlens=cu, slot_idx=slot_idx,
        max_nodes=max_nodes, dt_limit=LIMIT, z=rand(gen, T, H, P, dtype=dtype) if with_z else None,
    ), lists


def chain_case(nb, K, H, P, N, G, seed, dtype=torch.float32, slots=6, dt_scale=1.0, dt_shift=0.0, a_max=3.0,
               with_z=True):
    """kwargs of ssm_chain_update: `nb` sequences of `K` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    A, D, dt_bias = layer_weights(H, gen, a_max)
    return dict(
        ssm_state=rand(gen, slots, H, P, N), slot_idx=torch.randperm(slots, generator=gen)[:nb].to(torch.int32),
        x=rand(gen, nb, K, H, P, dtype=dtype), dt=_dt(gen, (nb, K, H), dtype, dt_scale, dt_shift), A=A,
        B=rand(gen, nb, K, G, N, dtype=dtype), C=rand(gen, nb, K, G, N, dtype=dtype), D=D, dt_bias=dt_bias,
        dt_limit=LIMIT, z=rand(gen, nb, K, H, P, dtype=dtype) if with_z else None,
    )


def commit_case(lens, K, H, P, N, G, seed, dtype=torch.float32, slots=6, dt_scale=1.0, dt_shift=0.0, a_max=3.0,
                layers=None):
    """kwargs of ssm_state_commit: accepted paths of lengths `lens` whose steps are random rows of the
    per-node inputs (x, dt, B), as a verify's stash holds them. Steps past a path point at a NaN
    row, and so do the rows no path uses, so any read of the padding shows. `layers=L` gives every
    tensor a layer axis (after the first one; A and dt_bias (L, H)), as a commit of L layers at once."""
    gen = torch.Generator().manual_seed(seed)
    nb = len(lens)
    lay = () if layers is None else (layers,)
    weights = [layer_weights(H, gen, a_max) for _ in range(layers or 1)]
    A, dt_bias = (torch.stack([w[i] for w in weights]) if layers else weights[0][i] for i in (0, 2))
    path_len = torch.tensor(lens, dtype=torch.int32)
    R = sum(lens) + 3
    order = 1 + torch.randperm(R - 1, generator=gen)  # row 0 is the padding row
    rows = torch.zeros(nb, K, dtype=torch.int64)
    used = torch.zeros(R, dtype=torch.bool)
    at = 0
    for b, n in enumerate(lens):
        rows[b, :n] = order[at : at + n]
        at += n
    used[rows[rows > 0]] = True

    def stashed(t):
        return t.masked_fill(~used.reshape(R, *([1] * (t.dim() - 1))), float("nan"))

    return dict(
        ssm_state=rand(gen, slots, *lay, H, P, N),
        slot_idx=torch.randperm(slots, generator=gen)[:nb].to(torch.int32),
        x=stashed(rand(gen, R, *lay, H, P, dtype=dtype)), dt=stashed(_dt(gen, (R, *lay, H), dtype, dt_scale, dt_shift)),
        B=stashed(rand(gen, R, *lay, G, N, dtype=dtype)), rows=rows, path_len=path_len, A=A, dt_bias=dt_bias,
        dt_limit=LIMIT,
    )


def prefill_case(L, H, P, N, G, seed, dtype=torch.float32, with_init=True, dt_scale=1.0, dt_shift=0.0, a_max=3.0,
                 with_z=True):
    """kwargs of ssd_prefill (without chunk_size) for one sequence of L tokens."""
    gen = torch.Generator().manual_seed(seed)
    A, D, dt_bias = layer_weights(H, gen, a_max)
    return dict(
        x=rand(gen, L, H, P, dtype=dtype), dt=_dt(gen, (L, H), dtype, dt_scale, dt_shift), A=A,
        B=rand(gen, L, G, N, dtype=dtype), C=rand(gen, L, G, N, dtype=dtype), D=D, dt_bias=dt_bias,
        dt_limit=LIMIT, initial_state=rand(gen, H, P, N) if with_init else None,
        z=rand(gen, L, H, P, dtype=dtype) if with_z else None,
    )


# ---- expected results from the oracle ------------------------------------------------------------


def oracle_tree(args: dict, lists) -> torch.Tensor:
    step = Mamba2Step(args["A"], args["D"], args["dt_bias"], args["dt_limit"])
    return tree_outputs(step, args["ssm_state"], args["x"], args["dt"], args["B"], args["C"], lists,
                        args["slot_idx"], z=args["z"])


def oracle_chain(args: dict):
    """(y (B, K, H, P), new states (B, H, P, N)) in float64 for chain_case-style kwargs."""
    step = Mamba2Step(args["A"], args["D"], args["dt_bias"], args["dt_limit"])
    ys, hs = [], []
    for b, slot in enumerate(args["slot_idx"].tolist()):
        z = None if args["z"] is None else args["z"][b]
        y, h = chain_outputs(step, args["ssm_state"][slot], args["x"][b], args["dt"][b], args["B"][b], args["C"][b], z)
        ys.append(y)
        hs.append(h)
    return torch.stack(ys), torch.stack(hs)


def oracle_commit(args: dict) -> torch.Tensor:
    """New states (B, H, P, N) in float64 for commit_case-style kwargs."""
    step = Mamba2Step(args["A"], None, args["dt_bias"], args["dt_limit"])
    hs = []
    for b, slot in enumerate(args["slot_idx"].tolist()):
        r = args["rows"][b, : int(args["path_len"][b])]
        if len(r) == 0:  # nothing accepted: the state stays
            hs.append(args["ssm_state"][slot].double())
            continue
        B = args["B"][r]
        _, h = chain_outputs(step, args["ssm_state"][slot], args["x"][r], args["dt"][r], B, B)
        hs.append(h)
    return torch.stack(hs)


def oracle_prefill(args: dict):
    """(y (L, H, P), final state (H, P, N)) in float64."""
    H, P = args["x"].shape[1:]
    N = args["B"].shape[-1]
    h0 = args["initial_state"]
    if h0 is None:
        h0 = torch.zeros(H, P, N, device=args["x"].device)
    step = Mamba2Step(args["A"], args["D"], args["dt_bias"], args["dt_limit"])
    return chain_outputs(step, h0, args["x"], args["dt"], args["B"], args["C"], args["z"])


def untouched_slots(pool: torch.Tensor, slot_idx: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    keep[slot_idx.long()] = False
    return keep
