"""The package layering of DESIGN.md, enforced with import-linter (contracts in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    proc = _lint(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_a_runtime_import_of_launch_breaks_the_contract(tmp_path):
    """The check can fail: a copy of the tree where elastic imports launch is refused."""
    for name in ("elastic", "launch", "trainer", "diagnostics", "chaos"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    bad = tmp_path / "elastic_bad"
    bad.mkdir()
    # Same contracts, with a package that imports launch placed in the runtime's layer.
    text = (REPO / "pyproject.toml").read_text().replace('root_packages = ["elastic",',
                                                         'root_packages = ["elastic_bad", "elastic",')
    text = text.replace('layers = ["chaos", "launch", "trainer | diagnostics", "elastic"]',
                        'layers = ["chaos", "launch", "trainer | diagnostics", "elastic : elastic_bad"]')
    (tmp_path / "pyproject.toml").write_text(text)
    (bad / "__init__.py").write_text("import launch.cli  # noqa: F401\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0 and "BROKEN" in proc.stdout.upper(), proc.stdout[-3000:]


def test_the_agent_and_the_launcher_do_not_import_torch():
    """Each agent and launcher is a process of its own: importing torch would cost seconds per node."""
    code = ("import sys, elastic.agent.main, launch.cli, launch.local; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
