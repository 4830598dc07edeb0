"""The Slurm and Kubernetes launch examples: syntax, structure, and commands the real CLIs accept."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from diagnostics.cli import build_parser as diag_parser
from launch.cli import build_parser as launch_parser
from launch.cli import resolve_config
from elastic.run.schema import load_run_file
from trainer.dit_config import DiTTrainerConfig

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "examples" / "slurm"
K8S = ROOT / "examples" / "k8s"


def _scripts() -> list[Path]:
    return sorted(SLURM.glob("*.sh")) + sorted(SLURM.glob("*.sbatch"))


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=10)


def _command_line(text: str, program: str) -> list[str]:
    """The words after "$BIN/<program>" on its line, shell variables kept as placeholders."""
    line = next(ln for ln in text.splitlines() if re.search(rf'"\$BIN/{program}"', ln))
    words = shlex.split(line.split(f'"$BIN/{program}"', 1)[1])
    return [re.sub(r"\$\(?[A-Za-z_ ]+[-a-z]*\)?", "x", w) for w in words]


def test_slurm_node_runs_burnin_then_one_agent():
    text = (SLURM / "node.sh").read_text()
    burnin = diag_parser().parse_args(_command_line(text, "diag"))
    assert burnin.command == "burnin" and burnin.mode == "quick" and burnin.etcd_endpoint
    assert 'exit 93' in text and 'rc=$?' in text  # the screen's exit code decides
    args = launch_parser().parse_args(_command_line(text, "elastic-launch"))
    assert args.nodes and args.etcd_endpoint and args.node_id and args.local_addr
    assert '--nodes "$NODES"' in text
    assert text.index("\"$BIN/diag\" burnin") < text.index("\"$BIN/elastic-launch\"")
    sbatch = (SLURM / "dit-64node.sbatch").read_text()
    assert "#SBATCH --nodes=64" in sbatch and "#SBATCH --ntasks-per-node=1" in sbatch
    assert "srun" in sbatch and "node.sh" in sbatch
    # The elastic range follows the allocation: 64 nodes -> 63:64, what the 64-node config allows.
    line = next(ln for ln in sbatch.splitlines() if ln.startswith("NODES="))
    nodes = subprocess.run(["bash", "-c", f"{line}; echo $NODES"], env={"SLURM_JOB_NUM_NODES": "64"},
                           capture_output=True, text=True, timeout=10).stdout.strip()
    assert nodes == "63:64" == load_run_file(ROOT / "examples" / "dit-64node.yaml").launch.nodes


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_k8s_manifests_structure_and_commands(tmp_path):
    etcd = {d["kind"]: d for d in _docs(K8S / "etcd.yaml")}
    assert set(etcd) == {"Service", "StatefulSet"}
    assert etcd["Service"]["spec"]["clusterIP"] == "None"
    assert etcd["StatefulSet"]["spec"]["serviceName"] == etcd["Service"]["metadata"]["name"]

    docs = {d["kind"]: d for d in _docs(K8S / "dit-64node-job.yaml")}
    job = docs["Job"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == 64 == job["parallelism"]
    pod = job["template"]["spec"]
    assert pod["subdomain"] == docs["Service"]["metadata"]["name"]
    (agent,) = pod["containers"]
    assert agent["command"][0] == "elastic-launch"
    args = launch_parser().parse_args(agent["command"][1:])
    assert args.etcd_endpoint.split(":")[0] == etcd["Service"]["metadata"]["name"]
    assert args.nodes == "63:64" and args.node_id and args.local_addr
    burnin = pod["initContainers"][0]["command"]
    assert burnin[0] == "diag" and diag_parser().parse_args(burnin[1:]).command == "burnin"
    codes = {r["onExitCodes"]["containerName"]: r["onExitCodes"]["values"] for r in job["podFailurePolicy"]["rules"]}
    assert codes == {"agent": [93], "burnin": [1]}
    # The command resolves to a valid run config (the 64-node example, run dir overridden).
    args.config = str(ROOT / args.config)
    cfg = resolve_config(args)
    assert cfg.launch.local_addr and cfg.run.dir == "/shared/runs/dit64"


def test_64_node_config_loads():
    cfg = load_run_file(ROOT / "examples" / "dit-64node.yaml")
    assert cfg.workload().name == "dit" and isinstance(cfg.trainer, DiTTrainerConfig)
    assert (cfg.launch.min_nodes, cfg.launch.max_nodes, cfg.launch.nproc_per_node) == (63, 64, 8)
    for nodes in (63, 64):
        assert cfg.trainer.check_world(nodes * 8) == (nodes * 8, 1)
    assert cfg.tensorboard.enabled and cfg.agent.metrics.port == 9400


def test_cluster_mode_launcher_per_host(tmp_path):
    """One launcher per host: its own events file, its host's address for torchrun, no archiving."""
    import socket

    from elastic.common.config import override
    from launch.local import Launcher

    local = Launcher(load_run_file(None), tmp_path)
    assert local.local_addr() == "127.0.0.1" and local._events_path().name == "launcher.jsonl"
    cfg = override(override(load_run_file(None), "launch.etcd_endpoint", "127.0.0.1:1"), "launch.node_id", "h7")
    cluster = Launcher(cfg, tmp_path)
    assert cluster.node_ids() == ["h7"] and cluster.local_addr() == socket.getfqdn()
    assert cluster._events_path().name == "launcher-h7.jsonl"
    (tmp_path / "events").mkdir(exist_ok=True)
    (tmp_path / "events" / "agent-h3.jsonl").write_text("{}\n")  # another host's live log
    cluster._archive_previous()
    assert (tmp_path / "events" / "agent-h3.jsonl").exists() and not (tmp_path / "history").exists()
    explicit = Launcher(override(cfg, "launch.local_addr", "10.0.0.7"), tmp_path)
    assert explicit.local_addr() == "10.0.0.7"


def test_64_node_example_has_a_fast_shape_and_the_video_example_splits_the_sequence():
    """256 tokens: no context parallelism, big GEMMs; 16384 tokens: Ulysses cp=8 inside a node."""
    image = load_run_file(ROOT / "examples" / "dit-64node.yaml").trainer
    assert image.parallel.cp == 1 and image.model.num_tokens == 256
    assert image.micro_batch_size * image.model.num_tokens >= 8192
    video = load_run_file(ROOT / "examples" / "dit-video-64node.yaml")
    assert video.workload().name == "dit" and isinstance(video.trainer, DiTTrainerConfig)
    assert video.trainer.parallel.cp == 8 and video.trainer.model.num_tokens == 16384
    assert video.trainer.micro_batch_size * video.trainer.model.num_tokens // 8 >= 8192
    for nodes in (63, 64):
        assert video.trainer.check_world(nodes * 8) == (nodes, 8)
