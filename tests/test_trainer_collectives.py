"""Collectives on the device the process group serves, and the worker's process setup.

NCCL serves only CUDA tensors: a bare ``torch.zeros(1)`` in a collective crashes the first GPU
run.  A gloo group bound to one device type (``cpu:gloo``, ``cuda:gloo``) fails the same way
for a tensor of another type, so these single-process tests reach that failure on a CPU host.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from elastic.common.collectives import (
    CollectiveDeviceError,
    all_true,
    backend_for,
    check_device,
    group_device,
    served_device_types,
)
from trainer.collectives import all_finite, broadcast_flag

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


@pytest.fixture
def group(monkeypatch):
    """A one-rank default group with the backend string the test asks for."""
    def make(backend: str) -> None:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend, rank=0, world_size=1)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def test_backend_is_bound_to_the_compute_device_type():
    assert backend_for(torch.device("cuda", 3)) == "cuda:nccl"
    assert backend_for(torch.device("cpu")) == "cpu:gloo"


def test_helpers_work_on_a_group_that_serves_only_the_cpu(group):
    group("cpu:gloo")
    assert served_device_types() == {"cpu"} and group_device() == torch.device("cpu")
    assert all_finite(torch.tensor(1.5)) is True
    assert all_finite(torch.tensor([1.0, float("nan")])) is False
    assert broadcast_flag(True) is True and broadcast_flag(False) is False
    assert all_true(True, None) is True


def test_a_group_for_another_device_type_rejects_the_tensor_as_nccl_would(group):
    """The negative control: the pre-fix code's ``torch.zeros(1)`` on a group that does not serve the CPU."""
    group("cuda:gloo")
    assert served_device_types() == {"cuda"}
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(1))  # what trainer/train.py did before
    with pytest.raises(CollectiveDeviceError, match="collective tensor on cpu.*serves cuda"):
        all_finite(torch.tensor(1.0))
    with pytest.raises(CollectiveDeviceError):
        broadcast_flag(True, device=torch.device("cpu"))


def test_helpers_put_their_tensors_on_the_given_device_not_the_default(group):
    """A second device type on a CPU host: meta.  The flag follows the loss, the broadcast its
    device, and the check refuses both on a CPU-only group before the backend sees them."""
    group("cpu:gloo")
    with pytest.raises(CollectiveDeviceError, match="on meta"):
        all_finite(torch.zeros((), device="meta"))
    with pytest.raises(CollectiveDeviceError, match="on meta"):
        broadcast_flag(True, device=torch.device("meta"))
    assert check_device(torch.zeros(1)).device.type == "cpu"


def test_trainer_process_group_serves_only_the_compute_device(monkeypatch):
    from elastic.worker.session import init_process

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    try:
        device, rank, world = init_process()
        assert (device.type, rank, world) == ("cpu", 0, 1)
        assert dist.get_backend() == "cpu:gloo" and served_device_types() == {"cpu"}
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


@pytest.fixture
def restore_determinism(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    backends = torch.backends.cuda
    saved = (backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(), backends.cudnn_sdp_enabled(),
             backends.math_sdp_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(False)
    backends.enable_flash_sdp(saved[0])
    backends.enable_mem_efficient_sdp(saved[1])
    backends.enable_cudnn_sdp(saved[2])
    backends.enable_math_sdp(saved[3])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[4], saved[5]


def test_deterministic_flag_sets_algorithms_workspace_and_attention_backend(restore_determinism):
    from elastic.worker.determinism import CUBLAS_WORKSPACE
    from elastic.worker.session import parse_worker_args

    args = parse_worker_args("t", ["--config", "c.yaml", "--run-dir", "d"])
    assert args.deterministic is False and not torch.are_deterministic_algorithms_enabled()
    args = parse_worker_args("t", ["--config", "c.yaml", "--run-dir", "d", "--deterministic"])
    assert args.deterministic is True and torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    backends = torch.backends.cuda
    assert backends.math_sdp_enabled() and not backends.flash_sdp_enabled()
    assert not backends.mem_efficient_sdp_enabled() and not backends.cudnn_sdp_enabled()
