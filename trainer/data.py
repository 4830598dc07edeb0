"""Datasets and the resumable global sampler.

Datasets map a global index to ``(latent [C, H, W] float32, label int)``:

* :class:`SyntheticLatents`: class-conditional structured patterns, generated
  from (seed, index) alone, so any rank can produce any sample and nothing is
  stored.  Each class is a distinct oriented wave pattern with a class-specific
  channel mix; per-sample variation is the phase and a small amplitude change,
  so the distribution is easy to learn and samples are recognisable in a grid.
* :class:`SafetensorsLatents`: pre-computed latents in ``*.safetensors``
  shards (``latents`` [N, C, H, W], optional ``labels`` [N] int), read lazily
  row by row through ``safe_open``.
* :class:`ImageFolder`: pixel-space training on ``root/<class>/<image>``
  files (class index = sorted folder order), center-cropped, resized to
  ``input_size`` and scaled to [-1, 1]; needs pillow and ``in_channels: 3``.

:class:`GlobalSampler` owns the data order.  Its position is global: an epoch
number and how many samples of that epoch's permutation all ranks together
have consumed.  Every step takes the next ``global_batch_size`` indices of the
permutation; data-parallel rank r of dp takes the r-th contiguous slice.  The
position is the same on every rank and is saved in checkpoints, so a resume -
at any dp size that divides the global batch - continues with exactly the next
unseen samples.

Replica-group mode (torchft, :mod:`trainer.dit_ft_train`) keeps that order and changes only
who takes which part of a batch:

* **Committed step s trains on the s-th global batch** of the same sequence (skipped batches
  included: a step dropped by the numerics guard still consumes its batch), whatever the
  number of groups.  The position moves only when a step commits: a step attempt that does
  not commit (a group died during it) puts the position back, and the next attempt trains the
  same global batch again with the new quorum.  So a group dropping out, or coming back, never
  skips or repeats a sample; it changes only how a batch is split, and with it the
  floating-point reduction order.
* **Split at the quorum of that attempt**: with G groups in the quorum, the group of quorum rank
  g takes the g-th of G contiguous parts (:func:`part_bounds`: sizes differ by at most one), and
  its dp ranks split that part the same way (:meth:`GlobalSampler.group_slice`).  When G * dp
  divides the batch this is exactly the plain trainer's split over G * dp ranks; otherwise each
  rank's loss is weighted by its share, so the average over ranks and groups is still the mean
  over the global batch.  Quorum ranks follow torchft's order of the group ids.
"""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path
from typing import Any

import torch

from trainer.dit_config import DataConfig, ModelConfig


class SyntheticLatents:
    def __init__(self, num_samples: int, channels: int, size: int, num_classes: int, seed: int) -> None:
        self.num_samples = num_samples
        self.channels = channels
        self.size = size
        self.num_classes = max(num_classes, 1)
        self.seed = seed
        coords = torch.linspace(-1.0, 1.0, size)
        self._yy, self._xx = torch.meshgrid(coords, coords, indexing="ij")
        # Class-specific channel mix in {-1, +1} patterns and wave parameters, fixed by the seed.
        gen = torch.Generator().manual_seed(seed * 7919 + 17)
        self._mix = torch.randint(0, 2, (self.num_classes, channels), generator=gen).float() * 2 - 1

    def __len__(self) -> int:
        return self.num_samples

    def label(self, index: int) -> int:
        return index % self.num_classes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        k = self.label(index)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        phase = float(torch.rand((), generator=gen)) * 2 * math.pi
        amp = 0.8 + 0.2 * float(torch.rand((), generator=gen))
        angle = math.pi * k / self.num_classes
        freq = 1.5 + (k % 3)
        u = math.cos(angle) * self._xx + math.sin(angle) * self._yy
        wave = torch.sin(math.pi * freq * u + phase)
        image = amp * self._mix[k].reshape(-1, 1, 1) * wave.unsqueeze(0)
        return image.float(), k


class SafetensorsLatents:
    def __init__(self, path: str, latents_key: str = "latents", labels_key: str = "labels") -> None:
        from safetensors import safe_open

        self.files = _shard_files(path)
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors shards at {path!r}")
        self.latents_key = latents_key
        self._handles = []
        self._labels: list[torch.Tensor | None] = []
        self._offsets = [0]
        shape = None
        for file in self.files:
            handle = safe_open(str(file), framework="pt")
            names = set(handle.keys())
            if latents_key not in names:
                raise KeyError(f"{file}: no tensor {latents_key!r} (has {sorted(names)})")
            rows = handle.get_slice(latents_key).get_shape()
            if shape is not None and rows[1:] != shape:
                raise ValueError(f"{file}: latent shape {rows[1:]} differs from {shape}")
            shape = rows[1:]
            labels = handle.get_tensor(labels_key).long() if labels_key in names else None
            if labels is not None and labels.shape[0] != rows[0]:
                raise ValueError(f"{file}: {labels.shape[0]} labels for {rows[0]} latents")
            self._handles.append(handle)
            self._labels.append(labels)
            self._offsets.append(self._offsets[-1] + rows[0])
        self.sample_shape = tuple(shape or ())

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = _bisect_right(self._offsets, index) - 1
        row = index - self._offsets[shard]
        latent = self._handles[shard].get_slice(self.latents_key)[row : row + 1][0].float()
        labels = self._labels[shard]
        return latent, int(labels[row]) if labels is not None else 0


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class ImageFolder:
    def __init__(self, root: str, size: int) -> None:
        try:
            from PIL import Image
        except ImportError as exc:  # optional dependency
            raise ImportError("data.kind 'image_folder' needs pillow (pip install pillow)") from exc
        self._image = Image
        self.size = size
        base = Path(root)
        self.classes = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
        self.items: list[tuple[Path, int]] = []
        for label, name in enumerate(self.classes):
            files = sorted(f for f in (base / name).rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
            self.items.extend((f, label) for f in files)
        if not self.items:
            raise FileNotFoundError(f"no images under {root!r} (expected root/<class>/<image>)")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < len(self.items):
            raise IndexError(index)
        path, label = self.items[index]
        with self._image.open(path) as img:
            img = img.convert("RGB")
            side = min(img.size)
            left, top = (img.width - side) // 2, (img.height - side) // 2
            img = img.crop((left, top, left + side, top + side)).resize((self.size, self.size), self._image.BICUBIC)
            data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        pixels = data.reshape(self.size, self.size, 3).permute(2, 0, 1).float()
        return pixels / 127.5 - 1.0, label


def _bisect_right(values: list[int], x: int) -> int:
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < values[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _shard_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        return sorted(p.glob("*.safetensors"))
    if p.is_file():
        return [p]
    return sorted(Path(f) for f in glob.glob(os.path.expanduser(path)))


def build_dataset(data: DataConfig, model: ModelConfig, seed: int) -> SyntheticLatents | SafetensorsLatents | ImageFolder:
    if data.kind == "synthetic":
        return SyntheticLatents(data.num_samples, model.in_channels, model.input_size, model.num_classes, seed)
    if data.kind == "image_folder":
        if model.in_channels != 3:
            raise ValueError(f"image_folder data is RGB: model.in_channels must be 3, not {model.in_channels}")
        images = ImageFolder(data.path, model.input_size)
        if model.num_classes and len(images.classes) > model.num_classes:
            raise ValueError(f"{len(images.classes)} class folders but model.num_classes = {model.num_classes}")
        return images
    ds = SafetensorsLatents(data.path, data.latents_key, data.labels_key)
    expected = (model.in_channels, model.input_size, model.input_size)
    if ds.sample_shape != expected:
        raise ValueError(f"latent shape {ds.sample_shape} in {data.path} != model input {expected}")
    return ds


class GlobalSampler:
    """Deterministic, resumable sampling order shared by all ranks (see the module docstring)."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError("empty dataset")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0
        """Samples of the current epoch's permutation consumed by all ranks together."""
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_033 + epoch)
                self._perm = torch.randperm(self.num_samples, generator=gen)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def next_global_batch(self) -> list[int]:
        """The next ``global_batch_size`` global indices; advances the position (crossing epochs)."""
        out: list[int] = []
        while len(out) < self.global_batch_size:
            perm = self._permutation(self.epoch)
            take = min(self.global_batch_size - len(out), self.num_samples - self.consumed)
            out.extend(perm[self.consumed : self.consumed + take].tolist())
            self.consumed += take
            if self.consumed == self.num_samples:
                self.epoch += 1
                self.consumed = 0
        return out

    @staticmethod
    def rank_slice(global_batch: list[int], dp_rank: int, dp: int) -> list[int]:
        per_rank = len(global_batch) // dp
        return global_batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]

    @staticmethod
    def group_slice(global_batch: list[int], group: int, groups: int, dp_rank: int, dp: int
                    ) -> tuple[list[int], float, tuple[int, int]]:
        """Replica-group mode: (this rank's indices, its loss weight, its group's [lo, hi) of the batch).

        The weight makes unequal parts average to the global mean: a rank holding k of n samples
        among dp ranks and G groups weighs k * dp * G / n (exactly 1.0 when the parts are equal)."""
        n = len(global_batch)
        if n < groups * dp:
            raise ValueError(f"a global batch of {n} cannot feed {groups} groups x {dp} dp ranks")
        lo, hi = part_bounds(n, group, groups)
        r_lo, r_hi = part_bounds(hi - lo, dp_rank, dp)
        mine = global_batch[lo + r_lo : lo + r_hi]
        share = len(mine) * dp * groups
        return mine, 1.0 if share == n else share / n, (lo, hi)

    @property
    def samples_seen(self) -> int:
        return self.epoch * self.num_samples + self.consumed

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"checkpoint sampler covers {state['num_samples']} samples, dataset has {self.num_samples}")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])


def part_bounds(n: int, part: int, parts: int) -> tuple[int, int]:
    """[lo, hi) of part ``part`` when n items are cut into ``parts`` contiguous, near-equal parts."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}")
    return part * n // parts, (part + 1) * n // parts


def collate(dataset: Any, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items], dtype=torch.long)
