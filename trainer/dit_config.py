"""Config of the reference DiT flow-matching trainer, importable without torch.

The launcher validates the ``trainer`` section of a run YAML with
:func:`elastic.common.config.from_dict` before any worker starts, so every check that
can be made without knowing the world size lives in ``__post_init__`` and
raises :class:`~elastic.common.config.ConfigError` naming the field.  Checks that
need the world size (``dp * cp == world``) are in
:meth:`DiTTrainerConfig.check_world`, called by the trainer at start-up.

Sections::

    trainer:
      steps, seed, global_batch_size, micro_batch_size, step_sleep
      model:     preset or explicit sizes (input_size, patch_size, hidden_dim, depth, num_heads, ...)
      flow:      logit-normal timestep sampling, Euler sampler settings
      data:      synthetic | safetensors latents | image folder
      parallel:  dp, cp, mixed-precision dtypes, activation checkpointing
      fp8:       which linears become FP8, scaling granularity
      numerics:  NaN/Inf and loss-spike guard and what to do about it
      optim:     AdamW, warmup, grad clipping
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from elastic.common.config import ConfigError

# name -> (hidden_dim, depth, num_heads); patch size and input size stay separate fields.
# The S/B/L/XL sizes are the DiT paper's; "tiny" is for CPU tests.
MODEL_PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (32, 2, 2),
    "S": (384, 12, 6),
    "B": (768, 12, 12),
    "L": (1024, 24, 16),
    "XL": (1152, 28, 16),
}

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class ModelConfig:
    """The DiT's shape: a preset or explicit sizes."""

    preset: str = "tiny"
    """One of MODEL_PRESETS ("tiny", "S", "B", "L", "XL") or "" for fully explicit sizes."""
    input_size: int = 8
    """Latent height = width."""
    in_channels: int = 4
    """Channels of a latent (3 for ``data.kind: image_folder``, pixel space)."""
    patch_size: int = 2
    """Side of a square patch: ``(input_size / patch_size)^2`` tokens per image."""
    hidden_dim: int | None = None
    """Overrides the preset's width when set."""
    depth: int | None = None
    """Overrides the preset's number of DiT blocks when set."""
    num_heads: int | None = None
    """Overrides the preset's attention heads when set (``parallel.cp`` must divide it)."""
    mlp_ratio: float = 4.0
    """Width of a block's MLP as a multiple of hidden_dim."""
    num_classes: int = 10
    """Class-label conditioning; 0 disables it. Label ``num_classes`` is the null (CFG) class."""
    class_dropout_prob: float = 0.1
    """Probability that a training label is replaced by the null class (classifier-free guidance)."""

    def __post_init__(self) -> None:
        if self.preset:
            if self.preset not in MODEL_PRESETS:
                raise ConfigError("preset", f"unknown preset {self.preset!r} (known: {', '.join(MODEL_PRESETS)})")
            dim, depth, heads = MODEL_PRESETS[self.preset]
            self.hidden_dim = dim if self.hidden_dim is None else self.hidden_dim
            self.depth = depth if self.depth is None else self.depth
            self.num_heads = heads if self.num_heads is None else self.num_heads
        for name in ("hidden_dim", "depth", "num_heads"):
            value = getattr(self, name)
            if value is None:
                raise ConfigError(name, "required when preset is empty")
            if value < 1:
                raise ConfigError(name, "must be >= 1")
        for name in ("input_size", "in_channels", "patch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.input_size % self.patch_size:
            raise ConfigError("patch_size", f"must divide input_size {self.input_size}")
        assert self.hidden_dim is not None and self.num_heads is not None
        if self.hidden_dim % self.num_heads:
            raise ConfigError("hidden_dim", f"must be divisible by num_heads {self.num_heads}")
        if (self.hidden_dim // self.num_heads) % 2:
            raise ConfigError("num_heads", "head dim (hidden_dim / num_heads) must be even")
        if self.hidden_dim % 4:
            raise ConfigError("hidden_dim", "must be divisible by 4 (2-D sin-cos position embedding)")
        if self.mlp_ratio <= 0:
            raise ConfigError("mlp_ratio", "must be > 0")
        if self.num_classes < 0:
            raise ConfigError("num_classes", "must be >= 0")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            raise ConfigError("class_dropout_prob", "must be in [0, 1)")

    @property
    def num_tokens(self) -> int:
        return (self.input_size // self.patch_size) ** 2

    @property
    def mlp_dim(self) -> int:
        assert self.hidden_dim is not None
        return int(self.hidden_dim * self.mlp_ratio)


@dataclass(kw_only=True)
class FlowConfig:
    """Flow matching: training timestep sampling and the Euler sampler of ``trainer.sample``."""

    t_logit_mean: float = 0.0
    """Timesteps are sigmoid(N(mean, std)) (logit-normal)."""
    t_logit_std: float = 1.0
    """Standard deviation of that normal."""
    sample_steps: int = 16
    """Euler steps of trainer.sample."""
    cfg_scale: float = 1.0
    """Classifier-free guidance scale of trainer.sample (1.0 = no guidance)."""

    def __post_init__(self) -> None:
        if self.t_logit_std <= 0:
            raise ConfigError("t_logit_std", "must be > 0")
        if self.sample_steps < 1:
            raise ConfigError("sample_steps", "must be >= 1")
        if self.cfg_scale < 0:
            raise ConfigError("cfg_scale", "must be >= 0")


@dataclass(kw_only=True)
class DataConfig:
    """The dataset; the data order is the resumable global sampler's (trainer/data.py)."""

    kind: Literal["synthetic", "safetensors", "image_folder"] = "synthetic"
    """synthetic: class-conditional patterns made from (seed, index), nothing stored; safetensors:
    pre-computed latents in shards; image_folder: pixel-space images (see ``path``)."""
    num_samples: int = 512
    """Size of the synthetic dataset (ignored for safetensors)."""
    path: str = ""
    """safetensors: a shard file, a directory of ``*.safetensors`` shards, or a glob;
    image_folder: a directory ``root/<class>/<image>`` (pixel space, model.in_channels = 3)."""
    latents_key: str = "latents"
    """safetensors: name of the [N, C, H, W] latents tensor in each shard."""
    labels_key: str = "labels"
    """Optional int64 [N] tensor in each shard; missing -> all labels 0."""
    shuffle: bool = True
    """A seeded permutation of the dataset per epoch; false: index order."""

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ConfigError("num_samples", "must be >= 1")
        if self.kind != "synthetic" and not self.path:
            raise ConfigError("path", f"required for kind {self.kind!r}")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the ranks split the work: FSDP2 over dp, Ulysses context parallel over cp."""

    dp: int = 0
    """Data-parallel degree; 0 = world_size / cp."""
    cp: int = 1
    """Context-parallel (Ulysses) degree: tokens are split across cp ranks, heads exchanged by all-to-all."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """FSDP2 MixedPrecisionPolicy param dtype (compute dtype of the unsharded params)."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """FSDP2 gradient reduce-scatter dtype."""
    activation_checkpointing: bool = False
    """Recompute each DiT block in backward."""
    fsdp: bool = True
    """Shard with fully_shard (per block + root). Off -> no FSDP (single process only)."""

    def __post_init__(self) -> None:
        if self.dp < 0:
            raise ConfigError("dp", "must be >= 0 (0 = derive from world size)")
        if self.cp < 1:
            raise ConfigError("cp", "must be >= 1")


@dataclass(kw_only=True)
class FP8Config:
    """FP8 linears (a config converter over module names; CPU runs emulate them)."""

    enabled: bool = False
    """Convert the matching linears to FP8 (hidden_dim and the MLP width must be divisible by 16)."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling granularity: one scale per tensor, or per row of the input and per output row of the weight."""
    include: list[str] = field(default_factory=lambda: ["blocks.*"])
    """fnmatch patterns over module names; a Linear must match one to be converted."""
    exclude: list[str] = field(default_factory=lambda: ["*adaLN*"])
    """fnmatch patterns that veto a match (the adaLN modulation is precision-sensitive)."""
    backend: Literal["auto", "emulate", "scaled_mm"] = "auto"
    """auto: torch._scaled_mm on CUDA with compute capability >= 8.9, else emulation."""

    def __post_init__(self) -> None:
        if self.enabled and not self.include:
            raise ConfigError("include", "must list at least one pattern when fp8 is enabled")


@dataclass(kw_only=True)
class NumericsConfig:
    """The NaN/Inf and loss-spike guard of every step."""

    action: Literal["skip", "rollback"] = "skip"
    """skip: drop the step (no optimizer update); rollback: report and exit with EXIT_NUMERICS."""
    spike_window: int = 64
    """Losses kept for the robust (median/MAD) z-score."""
    spike_min_history: int = 16
    """No spike verdicts before this many accepted losses."""
    spike_zscore: float = 8.0
    """A loss with (loss - median) / (1.4826 * MAD) above this is a spike; 0 disables spike detection."""
    spike_min_rel_scale: float = 0.01
    """Floor of the z-score's scale as a fraction of the median loss (guards against MAD ~ 0)."""
    max_consecutive_skips: int = 4
    """More skipped steps in a row than this escalates to rollback."""

    def __post_init__(self) -> None:
        if self.spike_window < 2:
            raise ConfigError("spike_window", "must be >= 2")
        if not 2 <= self.spike_min_history <= self.spike_window:
            raise ConfigError("spike_min_history", f"must be in [2, spike_window={self.spike_window}]")
        if self.spike_zscore < 0:
            raise ConfigError("spike_zscore", "must be >= 0")
        if self.spike_min_rel_scale < 0:
            raise ConfigError("spike_min_rel_scale", "must be >= 0")
        if self.max_consecutive_skips < 0:
            raise ConfigError("max_consecutive_skips", "must be >= 0")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with a linear warmup, then a constant learning rate."""

    lr: float = 1e-3
    """Learning rate after warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear learning-rate warmup from 0."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping (the norm is still computed and checked)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr", "must be > 0")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", "must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, "must be in [0, 1)")
        if self.eps <= 0:
            raise ConfigError("eps", "must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", "must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError("grad_clip", "must be >= 0")


@dataclass(kw_only=True)
class DiTTrainerConfig:
    checkpoint_neutral_fields: ClassVar[frozenset[str]] = frozenset(
        {"steps", "step_sleep", "flow.sample_steps", "flow.cfg_scale"})
    """Fields that do not change the meaning of saved state: run length, pacing and the sampler's
    settings (read only by trainer.sample).  The learning-rate schedule is a warmup and then
    constant, so it does not depend on ``steps`` and a run may be extended."""

    steps: int = 40
    """Optimizer steps to train in total (across restarts)."""
    seed: int = 0
    """Seeds the model init, the data (synthetic samples, the sampler's permutation) and the per-sample noise."""
    global_batch_size: int = 8
    """Samples per step over all data-parallel ranks (fixed across dp changes, so a resume at
    another world size consumes the same samples per step)."""
    micro_batch_size: int = 0
    """Per-rank samples per forward/backward; larger per-rank batches are processed in chunks with
    gradient accumulation (0 = the whole per-rank batch at once).  Bounds memory when an elastic
    shrink raises the per-rank batch (the global batch is fixed)."""
    step_sleep: float = 0.0
    """Extra seconds per step, so that faults can land mid-run in tests and demos."""
    model: ModelConfig = field(default_factory=ModelConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("steps", "must be >= 1")
        if self.global_batch_size < 1:
            raise ConfigError("global_batch_size", "must be >= 1")
        if self.step_sleep < 0:
            raise ConfigError("step_sleep", "must be >= 0")
        if self.micro_batch_size < 0:
            raise ConfigError("micro_batch_size", "must be >= 0 (0 = whole per-rank batch)")
        cp = self.parallel.cp
        if self.model.num_tokens % cp:
            raise ConfigError("parallel.cp", f"must divide the token count {self.model.num_tokens}")
        assert self.model.num_heads is not None
        if self.model.num_heads % cp:
            raise ConfigError("parallel.cp", f"must divide num_heads {self.model.num_heads} (Ulysses)")
        if self.parallel.dp and self.global_batch_size % self.parallel.dp:
            raise ConfigError("global_batch_size", f"must be divisible by parallel.dp {self.parallel.dp}")
        if self.fp8.enabled:
            dim, mlp = self.model.hidden_dim, self.model.mlp_dim
            assert dim is not None
            if dim % 16 or mlp % 16:
                raise ConfigError(
                    "fp8.enabled", f"FP8 linears need hidden_dim ({dim}) and mlp dim ({mlp}) divisible by 16"
                )

    def check_world(self, world_size: int) -> tuple[int, int]:
        """(dp, cp) for ``world_size`` ranks; ConfigError if they do not fit."""
        cp = self.parallel.cp
        if world_size % cp:
            raise ConfigError("parallel.cp", f"must divide the world size {world_size}")
        dp = self.parallel.dp or world_size // cp
        if dp * cp != world_size:
            raise ConfigError("parallel.dp", f"dp * cp = {dp} * {cp} != world size {world_size}")
        if self.global_batch_size % dp:
            raise ConfigError("global_batch_size", f"must be divisible by dp {dp} (world size {world_size})")
        return dp, cp

    def check_replica_groups(self, group_size: int, max_groups: int) -> tuple[int, int]:
        """Replica-group mode: (dp, cp) inside a group of ``group_size`` ranks; every rank of up to
        ``max_groups`` groups must get a sample of the global batch (parts may be unequal)."""
        dp, cp = self.check_world(group_size)
        if self.global_batch_size < max_groups * dp:
            raise ConfigError("global_batch_size", f"must be >= {max_groups * dp}: {max_groups} replica groups "
                                                   f"x dp {dp} ranks each need at least one sample")
        return dp, cp
