"""Datasets and the global, resumable sampler."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from elastic.common.config import from_dict
from trainer.data import (
    GlobalSampler,
    SafetensorsLatents,
    SyntheticLatents,
    build_dataset,
    collate,
)
from trainer.dit_config import DataConfig, ModelConfig


def test_synthetic_is_deterministic_and_class_structured():
    a = SyntheticLatents(64, 4, 8, 10, seed=0)
    b = SyntheticLatents(64, 4, 8, 10, seed=0)
    x, y = a[13]
    assert x.shape == (4, 8, 8) and y == 3
    assert torch.equal(x, b[13][0])
    assert not torch.equal(x, SyntheticLatents(64, 4, 8, 10, seed=1)[13][0])
    assert float(x.abs().max()) <= 1.0
    # samples of one class are closer to each other than to another class
    same = torch.stack([a[i][0] for i in (3, 13, 23, 33)])
    other = torch.stack([a[i][0] for i in (4, 14, 24, 34)])
    d_same = torch.cdist(same.flatten(1), same.flatten(1)).mean()
    d_cross = torch.cdist(same.flatten(1), other.flatten(1)).mean()
    assert d_same < d_cross
    with pytest.raises(IndexError):
        a[64]


def test_safetensors_shards(tmp_path):
    lat0, lat1 = torch.randn(5, 4, 8, 8), torch.randn(3, 4, 8, 8)
    save_file({"latents": lat0, "labels": torch.arange(5)}, str(tmp_path / "shard-000.safetensors"))
    save_file({"latents": lat1.to(torch.bfloat16), "labels": torch.arange(10, 13)}, str(tmp_path / "shard-001.safetensors"))
    ds = SafetensorsLatents(str(tmp_path))
    assert len(ds) == 8 and ds.sample_shape == (4, 8, 8)
    x, y = ds[2]
    assert torch.equal(x, lat0[2]) and y == 2
    x, y = ds[6]
    assert torch.equal(x, lat1[1].to(torch.bfloat16).float()) and y == 11
    xs, ys = collate(ds, [7, 0])
    assert xs.shape == (2, 4, 8, 8) and ys.tolist() == [12, 0]
    with pytest.raises(IndexError):
        ds[8]
    cfg = from_dict(DataConfig, {"kind": "safetensors", "path": str(tmp_path / "*.safetensors")})
    assert len(build_dataset(cfg, from_dict(ModelConfig, {}), 0)) == 8
    with pytest.raises(ValueError, match="latent shape"):
        build_dataset(cfg, from_dict(ModelConfig, {"input_size": 16}), 0)


def test_safetensors_without_labels_and_missing_key(tmp_path):
    save_file({"latents": torch.randn(2, 4, 8, 8)}, str(tmp_path / "a.safetensors"))
    assert SafetensorsLatents(str(tmp_path / "a.safetensors"))[1][1] == 0
    with pytest.raises(KeyError):
        SafetensorsLatents(str(tmp_path / "a.safetensors"), latents_key="z")
    with pytest.raises(FileNotFoundError):
        SafetensorsLatents(str(tmp_path / "none"))


def test_sampler_covers_each_epoch_once_and_crosses_epochs():
    s = GlobalSampler(10, 4, seed=0)
    batches = [s.next_global_batch() for _ in range(5)]  # 20 samples = 2 epochs
    flat = [i for batch in batches for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert (s.epoch, s.consumed, s.samples_seen) == (2, 0, 20)


def test_rank_slices_partition_the_global_batch():
    batch = GlobalSampler(100, 8, seed=3).next_global_batch()
    for dp in (1, 2, 4, 8):
        parts = [GlobalSampler.rank_slice(batch, r, dp) for r in range(dp)]
        assert [i for part in parts for i in part] == batch


def test_resume_at_other_dp_continues_with_next_unseen_samples():
    reference = GlobalSampler(50, 6, seed=7)
    seq = [reference.next_global_batch() for _ in range(12)]

    run = GlobalSampler(50, 6, seed=7)
    for _ in range(5):
        run.next_global_batch()
    saved = run.state_dict()
    resumed = GlobalSampler(50, 6, seed=7)
    resumed.load_state_dict(saved)
    for step in range(5, 12):
        batch = resumed.next_global_batch()
        assert batch == seq[step]
        # whatever the dp size after the resume, the ranks together take exactly this batch
        for dp in (1, 2, 3):
            assert [i for r in range(dp) for i in GlobalSampler.rank_slice(batch, r, dp)] == seq[step]
    with pytest.raises(ValueError):
        GlobalSampler(51, 6, seed=7).load_state_dict(saved)


def test_image_folder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    for label, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / label).mkdir()
        for i in range(2):
            Image.new("RGB", (20 + 4 * i, 16), colour).save(tmp_path / label / f"{i}.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    model = from_dict(ModelConfig, {"in_channels": 3, "num_classes": 2})
    ds = build_dataset(from_dict(DataConfig, {"kind": "image_folder", "path": str(tmp_path)}), model, 0)
    assert len(ds) == 4 and ds.classes == ["cat", "dog"]
    x, y = ds[3]
    assert x.shape == (3, 8, 8) and y == 1
    assert torch.allclose(x[2], torch.ones(8, 8)) and torch.allclose(x[0], -torch.ones(8, 8))  # blue in [-1, 1]
    with pytest.raises(ValueError, match="in_channels"):
        build_dataset(from_dict(DataConfig, {"kind": "image_folder", "path": str(tmp_path)}),
                      from_dict(ModelConfig, {}), 0)
