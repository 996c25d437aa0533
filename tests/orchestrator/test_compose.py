"""docker-compose.yml is a valid Compose file (checked by docker-compose itself; no engine needed)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (scripts/setup.sh installs it on Debian as root)")
    return exe


def test_compose_config_is_valid(compose):
    r = subprocess.run([compose, "-f", "docker-compose.yml", "config", "-q"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_compose_services_and_gpu_reservation():
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = spec["services"]
    assert set(services) == {"verifier", "drafter", "orchestrator"}
    devices = services["verifier"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    for name, svc in services.items():
        dockerfile = svc["build"]["dockerfile"]
        assert dockerfile == f"docker/{name}.Dockerfile" and (ROOT / dockerfile).is_file()
    assert services["orchestrator"]["depends_on"]["verifier"]["condition"] == "service_healthy"
