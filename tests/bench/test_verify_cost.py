"""The verify-cost projection: ratio interpolation, tau / ratio, against-chain quotients, and the
command reading ratios from a runtime benchmark JSON (no GPU involved)."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import cli, verify_cost
from bench.verify_cost import interpolate, project, project_fixed_tau, tau_rows

RATIOS = {1: 1.0, 4: 1.2, 16: 1.6}


def test_interpolate_is_linear_between_measured_sizes():
    assert interpolate(RATIOS, 4) == (1.2, False)
    assert interpolate(RATIOS, 10) == (pytest.approx(1.4), False)
    assert interpolate(RATIOS, 2.5) == (pytest.approx(1.1), False)


def test_interpolate_outside_uses_the_nearest_end_and_says_so():
    assert interpolate(RATIOS, 40) == (1.6, True)
    assert interpolate(RATIOS, 0.5) == (1.0, True)
    with pytest.raises(ValueError):
        interpolate({}, 3)


def row(method, shape, tau, nodes, temperature=0.0, path="inproc"):
    return {"method": method, "path": path, "temperature": temperature, "shape": shape, "tau": tau,
            "mean_nodes": nodes, "measured_speedup_vs_plain": None}


def test_projection_divides_tau_by_the_ratio_at_the_mean_tree_size():
    rows = [row("plain", "plain", 1.0, 1.0), row("chain-6", "chain", 3.0, 7.0), row("dynamic-16", "dynamic", 4.2, 10.0),
            row("chain-6", "chain", 2.0, 7.0, temperature=1.0)]
    out = project(rows, RATIOS, {1: 1.1, 16: 2.6})
    by = {(p["method"], p["temperature"]): p for p in out}
    assert by[("plain", 0.0)]["projected_speedup"] == pytest.approx(1.0)
    assert by[("chain-6", 0.0)]["verify_ratio"] == pytest.approx(1.3)
    assert by[("chain-6", 0.0)]["projected_speedup"] == pytest.approx(3.0 / 1.3)
    assert by[("dynamic-16", 0.0)]["projected_speedup"] == pytest.approx(3.0)
    assert by[("dynamic-16", 0.0)]["projected_vs_chain"] == pytest.approx(3.0 / (3.0 / 1.3))
    assert by[("dynamic-16", 0.0)]["projected_speedup_with_commit"] == pytest.approx(4.2 / (1.1 + 9 / 15 * 1.5))
    assert by[("chain-6", 1.0)]["projected_vs_chain"] == pytest.approx(1.0)  # its own temperature's chain
    assert by[("plain", 0.0)]["projected_vs_chain"] == pytest.approx(1.0 / (3.0 / 1.3))


def test_fixed_tau_at_every_size():
    out = project_fixed_tau(3.2, RATIOS)
    assert [r["nodes"] for r in out] == [1, 4, 16]
    assert [r["projected_speedup"] for r in out] == pytest.approx([3.2, 3.2 / 1.2, 2.0])


def test_tau_rows_keep_our_successful_rows_only():
    e2e = {"rows": [
        {"method": "plain", "path": "inproc", "temperature": 0.0, "shape": "plain", "tau": 1.0, "mean_nodes": 1.0,
         "steps": 9},
        {"method": "transformers", "path": "hf", "temperature": 0.0, "shape": "transformers", "tau": 1.0,
         "mean_nodes": 1.0, "steps": 9},
        {"method": "chain-6", "path": "grpc", "temperature": 0.0, "shape": "chain", "error": "boom"},
    ]}
    assert [r["method"] for r in tau_rows(e2e)] == ["plain"]


def runtime_json(tmp_path):
    """What `bench.model_runtime` writes, reduced to the fields the projection reads."""
    data = {"shape": "mamba2-2.7b", "device": "test-gpu", "layers": "all",
            "graphs": {"decode_ms": 2.0, "verify_ms": {"1": 2.0, "4": 2.4, "16": 3.2},
                       "verify_ratio": {"1": 1.0, "4": 1.2, "16": 1.6},
                       "verify_commit_ms": {"1": 2.2, "4": 2.6, "16": 3.6}}}
    path = tmp_path / "runtime_mamba2-2.7b.json"
    path.write_text(json.dumps(data))
    return path


def test_command_projects_an_e2e_file_with_ratios_from_a_runtime_json(tmp_path, capsys):
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps({"config": {"device_name": "test-gpu", "dtype": "fp32", "target": "t"}, "rows": [
        {"method": "chain-6", "path": "inproc", "temperature": 0.0, "shape": "chain", "tau": 3.0, "mean_nodes": 7.0,
         "steps": 10, "speedup_vs_plain": 0.5},
        {"method": "dynamic-16", "path": "inproc", "temperature": 0.0, "shape": "dynamic", "tau": 4.2,
         "mean_nodes": 10.0, "steps": 10, "speedup_vs_plain": 0.7},
    ]}))
    out = tmp_path / "vc.json"
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["verify-cost", "--shapes", "mamba2-2.7b", "--ratios", str(runtime_json(tmp_path)),
                         "--tau", str(e2e), "--out", str(out)])
    assert cli.run(args) == 0
    text = capsys.readouterr().out
    assert "PROJECTION" in text and "not a measurement" in text
    report = json.loads(out.read_text())
    assert report["label"] == verify_cost.LABEL
    proj = {p["method"]: p for p in report["projection"]["mamba2-2.7b"]}
    assert proj["dynamic-16"]["projected_speedup"] == pytest.approx(3.0)
    assert proj["chain-6"]["projected_speedup"] == pytest.approx(3.0 / 1.3)
    assert proj["dynamic-16"]["measured_speedup_vs_plain"] == 0.7
    # the report can itself serve as --ratios later (string keys after JSON survive the round trip)
    again = verify_cost.ratios_from_file(str(out))
    assert verify_cost._int_keys(again["mamba2-2.7b"])["ratios"] == {1: 1.0, 4: 1.2, 16: 1.6}


def test_command_refuses_to_measure_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would measure")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["verify-cost", "--shapes", "hybrid-8b", "--tau", "2"])) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
