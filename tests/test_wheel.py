"""The wheel has the right contents and installs into a fresh venv."""
import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest


@pytest.fixture
def wheel(request):
    path = request.config.getoption("--wheel")
    assert path and os.path.exists(path), "pass --wheel=PATH"
    return path


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "mlp_offload/_C.so" in names
    assert "mlp_offload/__init__.py" in names
    assert "mlp_offload/optimizer.py" in names
    assert "mlp_offload/cli.py" in names
    dist = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert len(dist) == 1
    entry = zipfile.ZipFile(wheel).read(dist[0].replace("METADATA", "entry_points.txt"))
    assert b"mlp-offload = mlp_offload.cli:main" in entry
    assert os.path.basename(wheel).startswith("mlp_offload-")
    assert wheel.endswith("-cp311-cp311-linux_x86_64.whl")


def test_wheel_installs_into_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", wheel], check=True)
    # torch comes from the project's venv (a fresh torch install would take a
    # minute); the package under test comes only from the wheel. The path is
    # added after the install: the project's venv may hold an installed
    # mlp_offload too (tools/main.sh puts it there), which pip would take for
    # this one and skip the install.
    with open(os.path.join(site, "torch_from_project.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([str(py), "-c", "import torch, mlp_offload; print(mlp_offload.__file__)"],
                         check=True, capture_output=True, text=True, cwd=str(tmp_path)).stdout
    assert out.strip().startswith(site)
    info = subprocess.run([str(venv / "bin" / "mlp-offload"), "info"], check=True,
                          capture_output=True, text=True, cwd=str(tmp_path)).stdout
    assert '"simd_target"' in info
