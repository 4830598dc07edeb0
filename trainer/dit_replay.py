"""Replay of one DiT rank's step on a spare (``sdc.replay_every``; :mod:`elastic.sdc.replay`).

The spare gets the step's unsharded weights (as FSDP gathered them for the forward, in
``param_dtype``) and the checked rank's sample indices, and recomputes that rank's local gradient
the way its FSDP2 unit did, with no process group: an unsharded model holding the gathered weights,
the blocks' floating inputs cast to ``param_dtype`` as ``fully_shard``'s mixed precision casts them
(the root does not cast: :func:`trainer.parallel.apply_fsdp`), gradients accumulated over the
micro-batches in ``reduce_dtype`` (FSDP2 sets each parameter's ``grad_dtype`` to it), activation
checkpointing as configured.  Bitwise equal to the rank's own on CPU for every combination the
tests try (``tests/test_sdc_replay.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from elastic.api import RunConfig, load_run_file, parse_worker_args
from elastic.sdc.replay import clean_name
from trainer.data import build_dataset
from trainer.dit_config import DiTTrainerConfig
from trainer.dit_train import build_model, micro_batch_loss, micro_batches
from trainer.parallel import TORCH_DTYPES, apply_activation_checkpointing

_DATASETS: dict[int, Any] = {}  # a spare replays many checks of one run: build its dataset once
_RUNS: dict[str, RunConfig] = {}


def _cast_inputs(dtype: torch.dtype):
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.to(dtype) if torch.is_tensor(a) and torch.is_floating_point(a) else a for a in args)

    return hook


def replay_model(cfg: DiTTrainerConfig, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The DiT with the gathered weights, cast and accumulated as the rank's FSDP2 units were."""
    model, _ = build_model(cfg, torch.device("cpu"), on_meta=True)
    model.to_empty(device="cpu")
    model.reset_buffers()
    named = dict(model.named_parameters())
    missing = sorted(set(named) - set(params))
    if missing:
        raise ValueError(f"replay record lacks weights for {missing[:3]}{'...' if len(missing) > 3 else ''}")
    for name, param in named.items():
        param.data = params[name]
    param_dtype = TORCH_DTYPES[cfg.parallel.param_dtype]
    reduce_dtype = TORCH_DTYPES[cfg.parallel.reduce_dtype]
    if reduce_dtype != param_dtype:
        for param in model.parameters():
            param.grad_dtype = reduce_dtype
    if param_dtype != torch.float32:
        for block in model.blocks:
            block.register_forward_pre_hook(_cast_inputs(param_dtype))
    if cfg.parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model


def replay_gradients_of(cfg: DiTTrainerConfig, record: dict[str, Any]) -> dict[str, torch.Tensor | None]:
    """The checked rank's local gradients of its step, by parameter name."""
    model = replay_model(cfg, record["params"])
    step, indices = int(record["step"]), [int(i) for i in record["inputs"]["indices"]]
    dataset, device = _dataset(cfg), torch.device("cpu")
    for chunk in micro_batches(indices, cfg.micro_batch_size):
        part = micro_batch_loss(model, cfg, dataset, step, chunk, device) * (len(chunk) / len(indices))
        part.backward()
    return {clean_name(name): p.grad for name, p in model.named_parameters()}


def replay_gradients(argv: list[str], record: dict[str, Any]) -> dict[str, torch.Tensor | None]:
    """The spare's entry (``trainer.dit_train.REPLAY_MODULE``): the trainer's own flags name the run file."""
    return replay_gradients_of(_run(argv).trainer, record)


def warm(argv: list[str]) -> None:
    """What a spare does before it says it is warm, when the run replays: read the run file and
    build the dataset, so that its first replay costs what the others do (2.8 s against 0.04 s)."""
    run = _run(argv)
    if run.sdc.replay:
        _dataset(run.trainer)


def _run(argv: list[str]) -> RunConfig:
    args = parse_worker_args("python -m trainer.dit_train", argv)
    run = _RUNS.get(args.config)
    if run is None:
        run = _RUNS[args.config] = load_run_file(args.config, DiTTrainerConfig)
    return run


def _dataset(cfg: DiTTrainerConfig) -> Any:
    dataset = _DATASETS.get(cfg.seed)
    if dataset is None:
        dataset = _DATASETS[cfg.seed] = build_dataset(cfg.data, cfg.model, cfg.seed)
    return dataset
