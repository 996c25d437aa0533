"""`treeserve bench e2e`: the toy run end to end on CPU (HumanEval prompts, the demo pair, every path:
transformers, in-process engines, the orchestrator's engine loop against verifier and drafter
processes), and the pure bookkeeping behind its table."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench import e2e
from bench.e2e_paths import Method, Trace

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    # The GPU machine has no Ray: a `ray` that cannot be imported, for this process and the services
    no_ray = tmp_path_factory.mktemp("no_ray")
    (no_ray / "ray").mkdir()
    (no_ray / "ray" / "__init__.py").write_text("raise ImportError('ray is not available here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(no_ray), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "treeserve.cli", "bench", "e2e", "--toy", "--device", "cpu", "--prompts", "1",
           "--budgets", "4", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, f"bench e2e --toy failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return out, r.stdout, json.loads((out / "e2e.json").read_text())


def test_toy_runs_every_method_on_every_path(toy):
    _, _, result = toy
    rows = result["rows"]
    assert [r for r in rows if r.get("error")] == []
    got = {(r["method"], r["path"], r["temperature"]) for r in rows}
    names = {("plain", "inproc"), ("chain-6", "inproc"), ("static-13", "inproc"), ("dynamic-4", "inproc"),
             ("ngram-16", "inproc"), ("plain", "grpc"), ("chain-6", "grpc"), ("dynamic-16", "grpc"),
             ("dynamic-16 +ahead", "grpc"), ("ngram-16", "grpc"), ("server default", "grpc"), ("transformers", "hf")}
    assert got == {(m, p, t) for m, p in names for t in (0.0, 1.0)}
    assert result["config"]["prompts"] == ["HumanEval/0"] and result["config"]["prompt_tokens"] == [48]
    # the engine's steps go to the verifier's direct port, as under `treeserve serve`
    services = result["config"]["services"]
    assert services["verify_stream"].rpartition(":")[0] == services["verifier"].rpartition(":")[0]
    assert services["verify_stream"] != services["verifier"]
    assert services["speculate_stream"].rpartition(":")[0] == services["drafter"].rpartition(":")[0]
    assert services["speculate_stream"] != services["drafter"]


def test_toy_engine_learns_each_regime_apart(toy):
    """The gRPC rows share one engine: its acceptance and step overheads are kept per tree shape,
    temperature band and draft-ahead (a greedy draft-model tree says little about a sampled n-gram
    one)."""
    _, _, result = toy
    learnt = {(a["shape"], a["temperature_band"], a["draft_ahead"]): a["tau"] for a in result["engine"]["acceptance"]}
    shapes = ("TREE_SHAPE_CHAIN", "TREE_SHAPE_DYNAMIC", "TREE_SHAPE_NGRAM", "TREE_SHAPE_UNSPECIFIED")
    regimes = {(s, band, False) for s in shapes for band in (0, 2)}
    regimes |= {("TREE_SHAPE_DYNAMIC", band, True) for band in (0, 2)}  # the +ahead rows
    assert set(learnt) == regimes, learnt  # T = 0 and T = 1
    assert "7" in learnt["TREE_SHAPE_CHAIN", 0, False] and "16" in learnt["TREE_SHAPE_DYNAMIC", 2, False]
    kinds = [[(d["shape"], d["temperature_band"], d["draft_ahead"]) for d in o["drafted"]]
             for o in result["engine"]["step_overhead_ms"]]
    assert [] in kinds and [("TREE_SHAPE_DYNAMIC", 0, False)] in kinds and [("TREE_SHAPE_DYNAMIC", 2, True)] in kinds


def test_toy_rows_are_consistent(toy):
    _, _, result = toy
    for r in result["rows"]:
        assert [len(o) for o in r["outputs"]] == [8] and r["tokens"] == 8
        hist = {int(k): v for k, v in r["accept_hist"].items()}
        assert sum(hist.values()) == r["steps"]
        assert sum(k * v for k, v in hist.items()) == 7  # every token after the prefill's first
        assert r["tau"] == pytest.approx(7 / r["steps"])
        assert r["tokens_per_s"] == pytest.approx(8 / r["seconds"])
        assert r["adaptive"] == (r["method"] == "server default")
        if r["shape"] in ("plain", "transformers"):
            assert r["tau"] == 1.0 and r["mean_nodes"] == 1.0 and r["trees"] == 0
        elif r["adaptive"]:  # the server default: the policy may leave speculation off on any step
            assert (r["method"], r["path"], r["budget"]) == ("server default", "grpc", 0)
            assert 0 <= r["steps_without_draft"] <= r["steps"]
        else:
            assert r["trees"] >= 1 and r["mean_nodes"] > 1.0
        if r["path"] != "hf":
            assert r["speedup_vs_plain"] == pytest.approx(
                r["tokens_per_s"] / e2e._find(result["rows"], r["path"], r["temperature"], "plain")["tokens_per_s"])


def test_toy_greedy_outputs_equal_plain_greedy(toy):
    _, _, result = toy
    greedy = [r for r in result["rows"] if r["temperature"] == 0 and r["path"] != "hf"]
    assert all(r["equal_to_plain"] for r in greedy if r["method"] != "plain" or r["path"] != "inproc")
    # n-gram trees carry no draft distributions: sampled acceptance follows the target's own seeded
    # samples, so its sampled output is plain sampled decoding token for token
    rows = {(r["method"], r["path"], r["temperature"]): r for r in result["rows"]}
    assert rows[("ngram-16", "inproc", 1.0)]["outputs"] == rows[("plain", "inproc", 1.0)]["outputs"]
    assert rows[("ngram-16", "grpc", 1.0)]["outputs"] == rows[("plain", "grpc", 1.0)]["outputs"]
    assert rows[("plain", "grpc", 1.0)]["outputs"] == rows[("plain", "inproc", 1.0)]["outputs"]


def test_toy_writes_table_json_and_plots_and_prints_the_table_last(toy):
    out, stdout, result = toy
    md = (out / "e2e.md").read_text()
    assert "| method | path | T | tokens/s | tau |" in md
    assert "greedy check: 10/10 greedy rows of our stack reproduce plain greedy decoding" in md
    for name in ("e2e_speedup.png", "e2e_accept.png"):
        assert (out / name).read_bytes()[:8] == PNG
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines[-1].split()[:3] == ["transformers", "hf", "1"]
    header = next(i for i, ln in enumerate(lines) if ln.startswith("method "))
    assert len(lines) - header - 2 == len(result["rows"])


def test_a_run_of_adaptive_rows_alone_draws_no_budget_axis(toy, tmp_path):
    """`--methods "server default"`: its rows have no fixed budget for the speedup plot's axis (a
    log axis of none failed the whole run); the acceptance plot is drawn."""
    from bench import plots

    _, _, result = toy
    rows = [r for r in result["rows"] if r["method"] in ("plain", "server default") and r["path"] == "grpc"]
    alone = dict(result, rows=rows)
    drawn = plots.e2e_plots(alone, tmp_path)
    assert [pathlib.Path(p).name for p in drawn] == ["e2e_accept.png"]
    assert (tmp_path / "e2e_accept.png").read_bytes()[:8] == PNG


def test_toy_result_feeds_the_projection(toy, tmp_path):
    from bench import verify_cost

    out, _, result = toy
    rows = verify_cost.tau_rows(result)
    assert len(rows) == len([r for r in result["rows"] if r["path"] != "hf"])
    proj = verify_cost.project(rows, {1: 1.0, 64: 2.0})
    for p in proj:
        assert p["projected_speedup"] == pytest.approx(p["tau"] / (1.0 + (p["mean_nodes"] - 1) / 63))


# ---- bookkeeping without models -----------------------------------------------------------------------
def summary(name, path, shape, outputs, emitted, seconds, temperature=0.0):
    m = Method(name, path, shape, 8 if shape else 1, 4 if shape else 0)
    traces = [Trace(list(o), seconds, emitted=list(e), nodes=[3 if shape else 1] * len(e), trees=len(e) if shape else 0)
              for o, e in zip(outputs, emitted)]
    return e2e.summarise(m, temperature, traces)


@pytest.mark.parametrize("path,shape", [("inproc", None), ("grpc", "dynamic"), ("hf", None)])
def test_a_failed_row_names_its_method_as_a_measured_row_does(path, shape):
    m = Method("m", path, shape, 8 if shape else 1, 4 if shape else 0)
    done = e2e.summarise(m, 1.0, [Trace([1, 2], 1.0, emitted=[1], nodes=[1], trees=0)])
    failed = e2e.failed_row(m, 1.0, "boom")
    assert failed == {**{k: done[k] for k in failed if k != "error"}, "error": "boom"}
    assert failed["shape"] == {"inproc": "plain", "grpc": "dynamic", "hf": "transformers"}[path]


def test_comparisons_use_the_same_path_and_flag_a_greedy_mismatch():
    rows = [
        summary("plain", "inproc", None, [[1, 2, 3, 4]], [[1, 1, 1]], 2.0),
        summary("chain-4", "inproc", "chain", [[1, 2, 3, 4]], [[2, 1]], 1.0),
        summary("dynamic-8", "inproc", "dynamic", [[1, 2, 9, 4]], [[3]], 0.5),
        summary("plain", "grpc", None, [[1, 2, 3, 4]], [[1, 1, 1]], 4.0),
        summary("transformers", "hf", None, [[1, 2, 3, 4]], [[1, 1, 1]], 8.0),
    ]
    rows[-1]["shape"] = "transformers"
    e2e.add_comparisons(rows)
    plain, chain, dyn, gplain, hf = rows
    assert (plain["tau"], chain["tau"], dyn["tau"]) == (1.0, 1.5, 3.0)
    assert chain["speedup_vs_plain"] == pytest.approx(2.0) and dyn["speedup_vs_chain"] == pytest.approx(2.0)
    assert gplain["speedup_vs_plain"] == pytest.approx(1.0) and gplain["speedup_vs_chain"] is None
    assert hf["speedup_vs_plain"] == pytest.approx(0.25) and hf["compared_on"] == "inproc"
    assert chain["equal_to_plain"] and gplain["equal_to_plain"]
    assert dyn["equal_to_plain"] is False and dyn["first_difference"] == [2]
    assert e2e.lossless_failures(rows) == [dyn]
    assert "NO (0/1)" in e2e.text_table(rows)


def test_toy_shrinks_the_plan():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = e2e.apply_toy(p.parse_args(["--toy"]))
    assert (args.prompts, args.max_new_tokens, args.max_prompt_tokens, args.budgets) == (2, 8, 48, [4, 8])
    names = [(m.path, m.name) for m in e2e.plan_methods(args)]
    assert names[:2] == [("inproc", "plain"), ("inproc", "chain-6")] and ("grpc", "dynamic-16 +ahead") in names


def test_methods_keeps_the_named_rows_and_each_paths_plain():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args(["--paths", "inproc", "grpc", "--methods", "server default", "dynamic-8"])
    names = [(m.path, m.name) for m in e2e.plan_methods(args)]
    assert names == [("inproc", "plain"), ("inproc", "dynamic-8"), ("grpc", "plain"), ("grpc", "server default")]
    with pytest.raises(SystemExit, match="no row named transformers"):
        e2e.plan_methods(p.parse_args(["--paths", "grpc", "--methods", "transformers"]))
