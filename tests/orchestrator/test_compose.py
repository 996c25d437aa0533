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


# what each image's entry point imports when it starts serving
IMAGE_MODULES = {
    "orchestrator": ["orchestrator.cli_orchestrator", "orchestrator.runtime", "orchestrator.actors",
                     "orchestrator.engine", "orchestrator.generation", "orchestrator.router"],
    "drafter": ["drafter_service.cli", "drafter_service.servicer", "drafter_service.draftlm"],
    "verifier": ["verifier_service.cli", "verifier_service.servicer", "models"],
}


@pytest.mark.parametrize("image", sorted(IMAGE_MODULES))
def test_each_image_holds_every_package_its_service_imports(image, tmp_path):
    """An image gets only the packages its Dockerfile copies: import the service's modules from a
    tree that holds just those (and the installed dependencies), not from this checkout."""
    import site
    import sys

    copied = [line.split()[1] for line in (ROOT / f"docker/{image}.Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and (ROOT / line.split()[1]).is_dir() and line.split()[1] != "docker"]
    for package in copied:
        (tmp_path / package).symlink_to(ROOT / package)
    # -S: no site-packages .pth files, so the editable install cannot put this checkout on the path
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, *{site.getsitepackages()!r}]; "
            f"import importlib; [importlib.import_module(m) for m in {IMAGE_MODULES[image]!r}]")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{image} image ({', '.join(copied)}): {r.stderr.strip().splitlines()[-1:]}"


def test_the_images_install_every_dependency_of_the_package():
    """The images install treeserve without its dependencies (`pip install --no-deps .`), from
    docker/requirements.txt: that file must pin what pyproject does, less torch (installed per
    image) and grpcio-tools (only generates the stubs). A missing one fails the service at start."""
    import re
    import tomllib

    def name_and_pin(spec: str) -> tuple[str, str]:
        name, _, pin = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?(.*)", spec.strip()).groups()
        return name.lower(), pin.strip()

    wanted = dict(name_and_pin(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    for name in ("torch", "grpcio-tools"):
        wanted.pop(name)
    lines = [line for line in (ROOT / "docker/requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert dict(name_and_pin(line) for line in lines) == wanted
