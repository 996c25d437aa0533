"""Plots of `bench e2e` results (PNG, matplotlib's Agg backend), drawn from the result JSON alone so
they can be redrawn anywhere: `treeserve bench plots e2e.json --out DIR`.

- e2e_speedup.png: tau and speedup over plain decoding against the tree's node budget (dynamic
  trees as lines, chain / static / n-gram as single points at their node counts), one line style
  per temperature.
- e2e_accept.png: acceptance-length histogram (tokens emitted per target forward), one panel per
  temperature, one line per speculative method.
"""
from __future__ import annotations

import pathlib
import sys

MARKERS = {"chain": "s", "static": "^", "ngram": "D", "dynamic": "o"}
STYLES = ("-", "--", ":", "-.")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (redraw later with `treeserve bench plots e2e.json`)",
              file=sys.stderr)
        return None
    return plt


def _rows(result: dict) -> tuple[str, list[dict]]:
    """Rows of the path the plots describe: in-process when it ran, else gRPC."""
    ok = [r for r in result["rows"] if not r.get("error")]
    for path in ("inproc", "grpc"):
        rows = [r for r in ok if r["path"] == path]
        if rows:
            return path, rows
    return "", []


def e2e_plots(result: dict, out_dir) -> list[str]:
    """Draw both plots into out_dir; returns the files written (none without matplotlib or data)."""
    plt = _pyplot()
    path, rows = _rows(result)
    if plt is None or not rows:
        return []
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the speedup plot's axis is the tree budget: rows of a fixed budget only (an adaptive row has
    # none; a run of adaptive rows alone draws the acceptance plot only)
    fixed = [r for r in rows if r["budget"] > 0 and not r.get("adaptive")]
    drawn = [speedup_plot(plt, fixed, path, out / "e2e_speedup.png")] if any(r["shape"] != "plain" for r in fixed) else []
    return drawn + [accept_plot(plt, rows, path, out / "e2e_accept.png")]


def _title(result_path: str) -> str:
    return {"inproc": "in-process engines", "grpc": "gRPC services"}.get(result_path, result_path)


def speedup_plot(plt, rows: list[dict], path: str, file: pathlib.Path) -> str:
    temps = sorted({r["temperature"] for r in rows})
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    budgets = set()
    for ti, t in enumerate(temps):
        style = STYLES[ti % len(STYLES)]
        at_t = [r for r in rows if r["temperature"] == t]
        dyn = sorted([r for r in at_t if r["shape"] == "dynamic" and not r.get("draft_ahead")], key=lambda r: r["budget"])
        if dyn:
            xs = [r["budget"] for r in dyn]
            budgets.update(xs)
            ax_tau.plot(xs, [r["tau"] for r in dyn], style, marker="o", color="C0", label=f"dynamic, T={t:g}")
            ax_speed.plot(xs, [r.get("speedup_vs_plain") or 0 for r in dyn], style, marker="o", color="C0",
                          label=f"dynamic, T={t:g}")
        for ci, shape in enumerate(("chain", "static", "ngram")):
            for r in (r for r in at_t if r["shape"] == shape):
                budgets.add(r["budget"])
                kw = dict(marker=MARKERS[shape], color=f"C{ci + 1}", linestyle="none",
                          fillstyle="full" if ti == 0 else "none", markersize=8, label=f"{r['method']}, T={t:g}")
                ax_tau.plot([r["budget"]], [r["tau"]], **kw)
                ax_speed.plot([r["budget"]], [r.get("speedup_vs_plain") or 0], **kw)
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    for ax, ylabel in ((ax_tau, "tau (tokens per target forward)"), (ax_speed, "speedup over plain decoding")):
        ax.set_xscale("log", base=2)
        ticks = sorted(budgets)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(b) for b in ticks])
        ax.set_xlabel("tree node budget (root included)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_speed.legend(fontsize=7, loc="best")
    fig.suptitle(f"bench e2e: tau and speedup against the tree budget ({_title(path)})")
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    plt.close(fig)
    return str(file)


def accept_plot(plt, rows: list[dict], path: str, file: pathlib.Path) -> str:
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        spec = [r for r in rows if r["temperature"] == t and r["shape"] not in ("plain", "transformers")]
        for i, r in enumerate(spec):
            hist = {int(k): v for k, v in r["accept_hist"].items()}
            total = sum(hist.values()) or 1
            xs = list(range(1, max(hist) + 1)) if hist else []
            ax.plot(xs, [hist.get(x, 0) / total for x in xs], marker=MARKERS.get(r["shape"], "o"), color=f"C{i % 10}",
                    label=f"{r['method']} (tau {r['tau']:.2f})")
        ax.set_title(f"T = {t:g}")
        ax.set_xlabel("tokens emitted per target forward (bonus included)")
        ax.set_ylabel("fraction of steps")
        ax.grid(alpha=0.3)
        if spec:
            ax.legend(fontsize=7)
    fig.suptitle(f"bench e2e: acceptance length ({_title(path)})")
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    plt.close(fig)
    return str(file)
