"""`TrainConfig`: every knob of a training run, grouped by the concern it belongs to.

The apps fill it from their flags; a field is named after its flag (`--prune_sparsity` is
`config.pruning.prune_sparsity`), except the compute policy, whose flag is `--precision`:

    from tfmp.training.config import TrainConfig
    config = TrainConfig.from_flat(model="lenet", dataset="digits", precision="mixed",
                                   strategy="mirrored", cpu_replicas=2, epochs=1)
    config.precision.policy, config.distribution.cpu_replicas     # "mixed", 2
    config.flat()["cpu_replicas"]                                  # 2: the flag view again

Batch sizes are global. The groups are plain dataclasses, so a library user may also build one
directly: `TrainConfig(model="lenet", data=DataConfig(dataset="digits"))`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from tfmp.distribute.allreduce import DEFAULT_BUCKET_BYTES
from tfmp.distribute.strategies import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_STARTUP_TIMEOUT
from tfmp.models.recipes import KNOBS, SUPERSEDED_BY


@dataclasses.dataclass
class DataConfig:
    """What is read and how it is batched."""

    dataset: str = "shapes"
    image_size: int | None = None
    data_dir: str | None = None
    # Images declaring more pixels are refused before decoding (tfmp.input.image_files); None:
    # Pillow's 89,478,485, 0: no limit. None stays out of flags.txt, so older runs resume.
    max_image_pixels: int | None = None
    augment: bool = False
    # RandAugment (tfmp.input.randaugment): ops per image (0: off) at a magnitude from 0 to 10.
    randaugment_ops: int = 0
    randaugment_magnitude: float = 9.0
    # Mixup / CutMix on each training batch (tfmp.input.mixing): Beta(alpha, alpha); 0: off.
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    cache: bool = False
    global_batch_size: int = 64
    data_threads: int = 0  # tf.data's private thread pool; 0: the shared default


@dataclasses.dataclass
class OptimizationConfig:
    """The optimizer, its learning-rate schedule and the length of the run."""

    optimizer: str = "adam"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    # No weight decay on normalization scales and offsets, biases, embeddings and tokens
    # (tfmp.optim.decay_exclusions), as DeiT, timm and big_vision train.
    exclude_from_weight_decay: bool = False
    label_smoothing: float = 0.0  # classification: (1 - e) x the label + e spread over the classes
    lr_scaling: str = "none"
    reference_batch_size: int = 256
    warmup_steps: int = 0
    warmup_epochs: float = 0.0  # used when warmup_steps is 0: a recipe's warmup for any dataset
    lr_decay: str = "constant"
    epochs: int = 1
    steps: int = 0  # total training steps; > 0 overrides epochs
    steps_per_epoch: int = 0  # 0: train examples // global batch


@dataclasses.dataclass
class PrecisionConfig:
    """The compute dtype policy (`--precision`) and float16's loss scaling."""

    policy: str = dataclasses.field(default="float32", metadata={"flag": "precision"})
    loss_scale: str = "auto"
    # Regexes (full match) of layers built with the float32 policy whatever `policy` is: what
    # the precision doctor (`--diagnose_precision`) recommends. () = the builders' own choice.
    float32_layers: tuple[str, ...] = ()
    # BatchNormalization on TensorFlow's fused kernel (tfmp.precision.fuse_normalization):
    # half-precision activations stay half, statistics float32, Keras' numbers within rounding.
    fused_norm: bool = True


@dataclasses.dataclass
class DistributionConfig:
    """Where the replica steps run and how each host call executes them."""

    strategy: str = "auto"
    cpu_replicas: int = 0
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT  # multi-worker: wait for peers
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT  # multi-worker: a silent peer is dead
    xla: str = "auto"
    steps_per_execution: int = 1
    intra_op_threads: int = 0  # 0: TensorFlow's default (one thread per core)
    inter_op_threads: int = 0
    allreduce_dtype: str = "auto"  # the gradients' sum: auto | float32 | bfloat16 | float16
    allreduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES  # per all-reduce call; 0: one call


@dataclasses.dataclass
class CheckpointConfig:
    """Where the run writes, and how often it saves."""

    model_dir: str | None = None
    keep_checkpoints: int = 3
    checkpoint_every: int = 0  # steps; 0: at the end of every epoch
    log_every: int = 50


@dataclasses.dataclass
class PruningConfig:
    """Magnitude pruning (tfmp.pruning): 0 = dense; begin/end None: the middle third of the run."""

    prune_sparsity: float = 0.0
    prune_schedule: str = "polynomial"
    prune_begin_step: int | None = None
    prune_end_step: int | None = None
    prune_every: int = 100


@dataclasses.dataclass
class PipelineConfig:
    """Model parallelism (tfmp.pipeline): K >= 2 stages on K devices, M micro-batches per step."""

    pipeline_stages: int = 0
    micro_batches: int = 4
    pipeline_boundaries: tuple[str, ...] = ()  # layer names that start a stage; () = balanced
    pipeline_balance: str = "flops"


@dataclasses.dataclass
class DetectionConfig:
    """Detections kept for COCO eval (and drawn by --predict above the threshold)."""

    score_threshold: float = 0.05
    max_detections: int = 100


@dataclasses.dataclass
class TrainConfig:
    """Every knob of a run, one group per concern; the apps fill it from flags."""

    model: str = "seed_cnn"
    # The training recipe applied (tfmp.models.recipes); `recipe_fields` names the flags whose
    # values came from it (the rest: the user's flags or the plain defaults).
    recipe: str = "none"
    recipe_fields: tuple[str, ...] = ()
    stochastic_depth: float = 0.0  # a residual model's drop rate for its last block (linear rule)
    seed: int = 0
    evaluate: bool = True
    verbose: bool = True
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimization: OptimizationConfig = dataclasses.field(default_factory=OptimizationConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    distribution: DistributionConfig = dataclasses.field(default_factory=DistributionConfig)
    checkpointing: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    pruning: PruningConfig = dataclasses.field(default_factory=PruningConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    detection: DetectionConfig = dataclasses.field(default_factory=DetectionConfig)

    def with_recipe(self, recipe, explicit: Collection[str] = ()) -> TrainConfig:
        """This config with `recipe`'s values (a `tfmp.models.recipes.Recipe`) for every knob
        not in `explicit` (the flags the user set); `recipe_fields` records which it took."""
        superseded = {knob for knob, flags in SUPERSEDED_BY.items() if set(flags) & set(explicit)}
        taken = {
            name: value
            for name, value in recipe.values.items()
            if name not in explicit and name not in superseded
        }
        values = {**self.flat(), **taken, "recipe": recipe.name}
        values["recipe_fields"] = tuple(name for name in KNOBS if name in taken)
        return TrainConfig.from_flat(**values)

    @classmethod
    def from_flat(cls, **values) -> TrainConfig:
        """Builds a config from flag-named values (`precision="mixed"`, `prune_sparsity=0.8`, ...).

        An unknown name is a TypeError, as a misspelt keyword argument would be.
        """
        unknown = sorted(set(values) - set(_flag_places()))
        if unknown:
            raise TypeError(f"TrainConfig has no flag(s) {', '.join(unknown)}")
        places = _flag_places()
        top = {name: value for name, value in values.items() if places[name][0] is None}
        grouped = {group_name: {} for group_name in _GROUP_TYPES}
        for flag, value in values.items():
            group_name, field_name = places[flag]
            if group_name is not None:
                grouped[group_name][field_name] = value
        groups = {name: _GROUP_TYPES[name](**fields) for name, fields in grouped.items()}
        return cls(**top, **groups)

    def flat(self) -> dict:
        """Flag name -> value, the inverse of `from_flat`."""
        return {
            flag: getattr(getattr(self, group) if group else self, field_name)
            for flag, (group, field_name) in _flag_places().items()
        }


_GROUP_TYPES = {
    "data": DataConfig,
    "optimization": OptimizationConfig,
    "precision": PrecisionConfig,
    "distribution": DistributionConfig,
    "checkpointing": CheckpointConfig,
    "pruning": PruningConfig,
    "pipeline": PipelineConfig,
    "detection": DetectionConfig,
}


def _flag_places() -> dict[str, tuple[str | None, str]]:
    """Flag name -> (group name or None for a top-level field, field name)."""
    places = {}
    for field in dataclasses.fields(TrainConfig):
        group_type = _GROUP_TYPES.get(field.name)
        if group_type is None:
            places[field.name] = (None, field.name)
            continue
        for inner in dataclasses.fields(group_type):
            places[inner.metadata.get("flag", inner.name)] = (field.name, inner.name)
    return places
