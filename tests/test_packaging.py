"""What gets installed: the kernel source ships as megatrain_jax/kernels/ (found by the loader in editable and
wheel installs alike), every megatrain_jax subpackage is in the wheel, and no top-level ``kernels`` package
is installed (PyPI has a popular package of that name)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def _run_python(code: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter of this environment, away from the repository (which would put its
    own folders on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_every_package_directory_is_listed_in_pyproject():
    """Packages are listed explicitly, so a new subpackage left out of the list would silently be missing
    from wheels."""
    found = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "megatrain_jax").rglob("*")
             if d.is_dir() and (d / "__init__.py").is_file()} | {"megatrain_jax"}
    missing = found - set(PACKAGES)
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
    assert all(p == "megatrain_jax" or p.startswith("megatrain_jax.") for p in PACKAGES), PACKAGES
    assert "megatrain_jax.kernels" in PACKAGES


def test_no_top_level_kernels_package_and_loader_finds_source(tmp_path):
    r = _run_python("import kernels", tmp_path)
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, r.stdout + r.stderr
    r = _run_python("from megatrain_jax.engine.update import host_kernel as k; print(k.SOURCE); "
                    "assert k.SOURCE.is_file()",
                    tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("host_adamw.cpp")


def test_wheel_ships_kernel_source_inside_megatrain_jax(tmp_path):
    """Builds the wheel offline from a copy of the tree (a stale build/ there would leak into the wheel),
    checks its contents, and has the loader find the source in the unpacked wheel (what a non-editable
    install puts in site-packages); nothing is installed into this environment."""
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools: pip install -e '.[test]'")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("megatrain_jax-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert "megatrain_jax/kernels/host_adamw.cpp" in names
    assert not [n for n in names if n.split("/")[0] == "kernels"], "a top-level kernels/ entry is in the wheel"
    for pkg in PACKAGES:
        assert f"{pkg.replace('.', '/')}/__init__.py" in names, f"{pkg} is missing from the wheel"
    for n in names:
        if n.endswith(".dist-info/top_level.txt"):
            assert (tmp_path / "site" / n).read_text().split() == ["megatrain_jax"]
    site = tmp_path / "site"
    r = _run_python("from megatrain_jax.engine.update import host_kernel as k; print(k.SOURCE); "
                    "assert k.SOURCE.is_file()",
                    tmp_path, pythonpath=site)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == (site / "megatrain_jax/kernels/host_adamw.cpp").resolve()


def test_loader_finds_source_in_an_uninstalled_checkout(monkeypatch):
    """Run from the tree (``PYTHONPATH=.``, as on the GPU image) the package mapping does not exist; the
    loader reads the checkout's kernels/ folder."""
    from megatrain_jax.engine.update import host_kernel

    def not_installed(name):
        raise ModuleNotFoundError(f"No module named {name!r}")
    monkeypatch.setattr(host_kernel.resources, "files", not_installed)
    path = host_kernel.source_path()
    assert path == ROOT / "kernels" / "host_adamw.cpp" and path.is_file()
