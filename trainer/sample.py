"""Sample a trained DiT: ``python -m trainer.sample --run-dir D [--step S] --out grid.png``.

Loads the newest committed checkpoint of the run (or step S) into an
unsharded model in a single process (DCP reshards on load, no process group
needed), integrates the rectified-flow ODE from noise with Euler steps, and
writes a PNG grid: one row per class, latent channels 0-2 shown as RGB.

The model is rebuilt from ``<run-dir>/dit_trainer.yaml`` (written by the
trainer at start) unless ``--config`` names a run YAML.  The checkpoint is
only read: unlike a full CheckpointManager, this never removes a save in
progress, so it is safe while training is running.
"""

from __future__ import annotations

import argparse
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from elastic.checkpoint.load import CheckpointCorrupt, CommittedCheckpoints, step_dir_name
from elastic.checkpoint.format import SafetensorsShardReader
from elastic.common.config import ConfigError
from elastic.common.events import EventLog
from trainer.dit import DiT, build_dit
from elastic.run.schema import RunConfig, load_run_file
from trainer.dit_config import DiTTrainerConfig
from trainer.dit_train import RESOLVED_CONFIG_NAME
from trainer.flow import euler_sample


class _ReadOnlyCheckpoints(CommittedCheckpoints):
    """The run's committed checkpoints, read only (no writer, no start-up cleanup)."""

    def __init__(self, cfg_file: RunConfig, root: Path) -> None:
        super().__init__(cfg_file.checkpoint, root, cfg_file.fingerprint, EventLog(None, "sample"))

    def newest_verified(self) -> int | None:
        for step in reversed(self.committed_steps()):
            try:
                self.verify(step)
            except CheckpointCorrupt as exc:
                print(f"sample: skipping checkpoint: {exc}", file=sys.stderr)
                continue
            return step
        return None


class _ModelOnly(Stateful):
    """Loads just ``app.model`` of a trainer checkpoint (the optimizer state is not read)."""

    def __init__(self, model: DiT) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict["model"])


def load_model(cfg_file: RunConfig, run_dir: Path, step: int | None = None) -> tuple[DiT, int]:
    ckpts = _ReadOnlyCheckpoints(cfg_file, cfg_file.checkpoint.root(run_dir))
    if step is None:
        step = ckpts.newest_verified()
        if step is None:
            raise FileNotFoundError(f"no committed checkpoint under {ckpts.root}")
    else:
        ckpts.verify(step)
    model = build_dit(cfg_file.trainer.model, cfg_file.trainer.seed)
    path = ckpts.root / step_dir_name(step)
    dcp.load({"app": _ModelOnly(model)}, storage_reader=SafetensorsShardReader(path), no_dist=True)
    return model.eval(), step


def write_png(path: Path, rgb_HW3: torch.Tensor) -> None:
    """8-bit RGB PNG with zlib + struct (no imaging dependency)."""
    img = rgb_HW3.to(torch.uint8).contiguous()
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[row].numpy().tobytes() for row in range(h))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit, colour type 2 (RGB)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                     + chunk(b"IEND", b""))


def to_grid(latents_NCHW: torch.Tensor, rows: int, upscale: int = 8, pad: int = 2) -> torch.Tensor:
    """[N, C, H, W] in about [-1, 1] -> [rows*(H*u+pad)+pad, cols*(W*u+pad)+pad, 3] uint8 image."""
    n, c, h, w = latents_NCHW.shape
    cols = (n + rows - 1) // rows
    rgb = latents_NCHW[:, :3] if c >= 3 else latents_NCHW[:, :1].expand(n, 3, h, w)
    rgb = ((rgb.clamp(-1, 1) + 1) * 127.5).round()
    rgb = rgb.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    th, tw = h * upscale, w * upscale
    grid = torch.full((rows * (th + pad) + pad, cols * (tw + pad) + pad, 3), 255.0)
    for i in range(n):
        r, col = divmod(i, cols)
        y0, x0 = pad + r * (th + pad), pad + col * (tw + pad)
        grid[y0 : y0 + th, x0 : x0 + tw] = rgb[i].permute(1, 2, 0)
    return grid


@torch.no_grad()
def generate(model: DiT, num_classes: int, per_class: int, steps: int, cfg_scale: float, seed: int) -> torch.Tensor:
    cfg = model.cfg
    classes = max(num_classes, 1)
    labels = torch.arange(classes).repeat_interleave(per_class) if num_classes else None
    n = classes * per_class
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, cfg.in_channels, cfg.input_size, cfg.input_size, generator=gen)

    def velocity(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        return model.unpatchify(model(x, t, y)).float()

    return euler_sample(velocity, noise, labels, steps, cfg_scale, model.null_class if num_classes else None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.sample")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest committed)")
    parser.add_argument("--out", default="grid.png")
    parser.add_argument("--config", default=None, help=f"run YAML (default: <run-dir>/{RESOLVED_CONFIG_NAME})")
    parser.add_argument("--per-class", type=int, default=4)
    parser.add_argument("--max-classes", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="Euler steps (default: trainer.flow.sample_steps)")
    parser.add_argument("--cfg-scale", type=float, default=None, help="default: trainer.flow.cfg_scale")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        cfg_file = load_run_file(args.config or run_dir / RESOLVED_CONFIG_NAME, DiTTrainerConfig)
    except ConfigError as exc:
        print(f"sample: config error: {exc}", file=sys.stderr)
        return 2
    try:
        model, step = load_model(cfg_file, run_dir, args.step)
    except (FileNotFoundError, CheckpointCorrupt) as exc:
        print(f"sample: {exc}", file=sys.stderr)
        return 1
    flow = cfg_file.trainer.flow
    num_classes = min(cfg_file.trainer.model.num_classes, args.max_classes)
    samples = generate(model, num_classes, args.per_class, args.steps or flow.sample_steps,
                       flow.cfg_scale if args.cfg_scale is None else args.cfg_scale, args.seed)
    write_png(Path(args.out), to_grid(samples, rows=max(num_classes, 1)))
    print(f"sample: step {step}: wrote {samples.shape[0]} samples to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
