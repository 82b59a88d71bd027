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
    # The native libraries it needs travel with it (see the next test).
    for lib in ("libhwy.so.1", "liburing.so.2", "libabsl_status.so.20220623",
                "libabsl_base.so.20220623"):
        assert "mlp_offload.libs/" + lib in names
    record = zipfile.ZipFile(wheel).read(dist[0].replace("METADATA", "RECORD")).decode()
    assert "mlp_offload.libs/libhwy.so.1,sha256=" in record  # pip uninstall removes it
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
    # Abseil, Highway and liburing load from the wheel's own copies, not from
    # the system's (which this machine also has): the wheel installs where
    # Debian's packages are not.
    probe = ("import re, mlp_offload\n"
             "maps = open('/proc/self/maps').read().split('\\n')\n"
             "paths = {l.split()[-1] for l in maps if re.search(r'/(libabsl_|libhwy|liburing)', l)}\n"
             "print('\\n'.join(sorted(paths)))\n")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    loaded = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True,
                            cwd=str(tmp_path), env=env).stdout.split()
    names = {os.path.basename(p) for p in loaded}
    assert {"libhwy.so.1", "liburing.so.2", "libabsl_status.so.20220623"} <= names, loaded
    libs_dir = os.path.realpath(os.path.join(site, "mlp_offload.libs"))
    assert all(os.path.dirname(os.path.realpath(p)) == libs_dir for p in loaded), loaded
