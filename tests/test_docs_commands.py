"""Shell commands in the docs either run in a test or say why they cannot.

Every shell block of README.md and docs/*.md (```bash, ```sh, ```console, or a block of
``$ ``-prompted lines) is either covered, every command of it a key of :data:`COVERED` naming
the test that runs it (or its equivalent, said beside the entry), or carries a note on the line
before or after it: ``<!-- not run in tests: WHY -->`` (a GPU, a cluster, a recorded session).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

TOUR = "tests/test_docs_e2e.py::test_the_tour_runs_as_written"
COVERED = {
    # README, the five-minute tour: run as written, from a directory with the examples.
    "elastic-launch --nodes 4 examples/tiny.yaml": TOUR,
    """ETCD=$(grep -m1 -o '"endpoint": "[^"]*"' runs/tiny/events/launcher.jsonl | cut -d'"' -f4)""": TOUR,
    'elastic status --etcd "$ETCD" --run-id tiny': TOUR,
    # The same quick suite on the same job, shortened (--steps 28) and without the pre-flight screen.
    "chaos suite --config examples/tiny.yaml --nodes 2 --quick --out runs/chaos":
        "tests/test_chaos_suite.py::test_quick_suite_against_the_tiny_dit_job",
    # In-process (diagnostics.cli.main), with --etcd-endpoint and --ckpt-dir added so no check skips.
    "diag burnin --quick --json report.json": "tests/test_diag_cli.py::test_cli_burnin_passes_and_writes_json",
    # docs/architecture.md, replica-group mode: both example files, run as written.
    "elastic-launch examples/mlp-replicas.yaml": "tests/test_docs_e2e.py::test_the_replica_examples_run",
    "elastic-launch examples/dit-replicas.yaml": "tests/test_docs_e2e.py::test_the_replica_examples_run",
    # docs/cluster.md: the same batch script under real Slurm daemons on this host (3 nodes, tiny DiT config).
    "sbatch examples/slurm/dit-64node.sbatch":
        "tests/test_slurm.py::test_sbatch_screens_cancels_and_resumes_under_real_slurm",
    # docs/workloads.md, the BYO example: pip-installed into a directory of the test's own on the runs'
    # PYTHONPATH (not the venv), its example config shortened to 60 steps, run with --nodes 4.
    "pip install -e examples/byo":
        "tests/test_byo_e2e.py::test_the_installed_byo_workload_recovers_a_worker_kill_in_process_bitwise",
    "elastic-launch --nodes 4 examples/byo/byo.yaml":
        "tests/test_byo_e2e.py::test_the_installed_byo_workload_recovers_a_worker_kill_in_process_bitwise",
    # docs/operations.md: the refusal and the line it prints, compared below.
    "elastic-launch --set trainer.stepz=3 examples/mlp-tiny.yaml":
        "tests/test_docs_commands.py::test_the_documented_config_error_is_what_the_launcher_prints",
}

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)\s*$")
_NOTE = re.compile(r"^\s*<!-- not run in tests: (.+?) -->\s*$")
_TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
_SHELLS = ("bash", "sh", "shell", "console")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    body: list[str]
    note: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[str]:
        """The commands in it: one per line, ``\\`` continuations joined, comments and prompts dropped."""
        prompted = self.lang == "console" or any(line.lstrip().startswith("$ ") for line in self.body)
        out: list[str] = []
        pending = ""
        for raw in self.body:
            line = raw.strip()
            if not pending:
                if prompted:
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                if not line or line.startswith("#"):
                    continue
            line = _strip_comment(line)
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            out.append(pending + line)
            pending = ""
        return out


def _strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` after a blank, outside quotes)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def _note(lines: list[str], index: int) -> str | None:
    match = _NOTE.match(lines[index]) if 0 <= index < len(lines) else None
    return match.group(1).strip() if match else None


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang = match.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        before = next((j for j in range(i - 1, -1, -1) if lines[j].strip()), -1)
        after = next((j for j in range(end + 1, len(lines)) if lines[j].strip()), len(lines))
        found.append(Block(path, i + 1, lang, lines[i + 1:end], _note(lines, before) or _note(lines, after)))
        i = end + 1
    return found


def shell_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path)
            if b.lang in _SHELLS or (not b.lang and any(line.lstrip().startswith("$ ") for line in b.body))]


def test_every_shell_block_runs_in_a_test_or_says_why_not():
    assert len(shell_blocks()) >= 10  # the parser finds the docs' blocks
    uncovered = [f"{b.where}: {cmd}" for b in shell_blocks() if b.note is None
                 for cmd in b.commands() if cmd not in COVERED]
    assert not uncovered, ("shell commands neither covered by a test (COVERED in tests/test_docs_commands.py) "
                           "nor noted (<!-- not run in tests: WHY -->):\n" + "\n".join(uncovered))


def _defines(test_file: str, name: str) -> bool:
    path = REPO / test_file
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_the_mapping_and_the_notes_name_tests_that_exist_and_commands_the_docs_have():
    documented = {cmd for b in shell_blocks() for cmd in b.commands()}
    assert set(COVERED) <= documented, f"stale COVERED entries: {sorted(set(COVERED) - documented)}"
    refs = [ref.split("::") for ref in COVERED.values()]
    refs += [m.groups() for b in shell_blocks() if b.note for m in _TEST_REF.finditer(b.note)]
    missing = sorted({f"{f}::{name}" for f, name in refs if not _defines(f, name)})
    assert not missing, f"named tests that do not exist: {missing}"


def test_ci_runs_the_readme_test_command_verbatim():
    readme = [b for b in blocks(REPO / "README.md") if b.lang == "bash"]
    test_command = readme[1].commands()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert test_command == [ci[-1]]


def test_the_documented_config_error_is_what_the_launcher_prints(monkeypatch, capsys):
    from launch.cli import main

    block = next(b for b in blocks(REPO / "docs" / "operations.md") if "trainer.stepz" in "\n".join(b.body))
    command, printed = block.body[0], block.body[1]
    assert command == "$ elastic-launch --set trainer.stepz=3 examples/mlp-tiny.yaml"
    monkeypatch.chdir(REPO)
    assert main(command.split()[2:]) == 2
    assert capsys.readouterr().err.splitlines() == [printed]


@pytest.mark.parametrize("text, commands", [
    (["$ a --x 1   # why", "output", "$ b \\", "  --y 2"], ["a --x 1", "b --y 2"]),
    (["# a comment", "", "c 'd # e'", "f  # the tag"], ["c 'd # e'", "f"]),
])
def test_commands_are_read_as_a_shell_would_see_them(text, commands):
    assert Block(REPO, 1, "bash", text, None).commands() == commands
