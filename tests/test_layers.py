"""The package's layers are checked, not hoped for: import-linter's contracts in pyproject.toml (the model
contract below the engine, models importing only the contract, the engine away from the command line, HF,
data and checkpoint code, the plan away from the command line, nothing importing experiments/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the repository's contracts, on the package under ``root``."""
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists():
        exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]' (import-linter)")
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root), "HOME": str(root)}
    return subprocess.run([str(exe), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    r = lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and " kept" in r.stdout


@pytest.mark.parametrize("module,line,broken", [
    ("contract/layered.py", "from megatrain_jax.engine.parts import PartId", "contract/ never imports the engine"),
    ("models/layers.py", "from megatrain_jax.plan.counts import GiB", "Models import only the contract"),
    ("families/olmo2.py", "from megatrain_jax.models.config import DecoderConfig", "The family records import nothing"),
    ("engine/passes.py", "from megatrain_jax.data import DataConfig", "The engine never imports"),
    ("plan/levers.py", "from megatrain_jax.cli import main", "The memory plan never imports the command line"),
    ("fit.py", "import experiments.bench", "Nothing in the package imports the experiments"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, broken):
    """A copy of the package with one forbidden import added: lint-imports fails, naming that contract."""
    shutil.copytree(REPO / "megatrain_jax", tmp_path / "megatrain_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "megatrain_jax" / module
    target.write_text(target.read_text() + f"\n{line}  # added by the test\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    assert broken in r.stdout and "BROKEN" in r.stdout, r.stdout
