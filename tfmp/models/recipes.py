"""Training recipes: how each model family trains well by default, owned by the model registry.

A recipe is a set of flag-named values (the same names as `tfmp.training.config.TrainConfig`
and the apps' flags): the optimizer, the learning rate for a reference batch, warmup, decay,
weight decay and what it excludes, label smoothing, augmentation, Mixup/CutMix, stochastic depth
and epochs. The apps apply the model's recipe to every one of those flags the user did not set
(`--recipe=auto`, the default); `--recipe=none` gives the plain defaults every model had before
recipes (Adam 1e-3, constant rate, no warmup, no weight decay, no augmentation, 3 epochs).

    from tfmp.models import recipes
    recipe = recipes.resolve("auto", "vit_tiny")        # the registry's recipe for vit_tiny
    recipe.values["optimizer"], recipe.sources          # "adamw", "DeiT (Touvron et al. 2021) ..."
    recipes.resolve("none", "vit_tiny").values          # {}: the flags' own defaults
    optimizer = optim.for_recipe(recipe, model, global_batch_size=64, steps_per_epoch=187)  # any model

What each recipe reached, with the command and the CPU it ran on: docs/recipes.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from tfmp.errors import UsageError, unknown
from tfmp.models import stochastic_depth

# The flags a recipe may set, in the order the run card lists them (XLA last: how fast, not what
# is learnt). A recipe leaves out the ones whose plain default suits it.
KNOBS = (
    "optimizer",
    "learning_rate",
    "reference_batch_size",
    "lr_scaling",
    "warmup_epochs",
    "lr_decay",
    "weight_decay",
    "exclude_from_weight_decay",
    "label_smoothing",
    "augment",
    "randaugment_ops",
    "randaugment_magnitude",
    "mixup_alpha",
    "cutmix_alpha",
    "stochastic_depth",
    "epochs",
    "xla",
)

# A flag the user sets that stands for a recipe knob under another name: the recipe then leaves
# that knob alone (--warmup_steps=0 means "no warmup", not "use the recipe's warmup epochs").
SUPERSEDED_BY = {"warmup_epochs": ("warmup_steps",), "epochs": ("steps",)}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named set of flag values and where they come from (papers, the measurements here)."""

    name: str
    values: Mapping[str, object]
    sources: str

    def __post_init__(self):
        stray = sorted(set(self.values) - set(KNOBS))
        if stray:
            raise ValueError(f"recipe {self.name!r} sets {', '.join(stray)}, which are not recipe knobs")
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))


NONE = Recipe("none", {}, "the flags' plain defaults (Adam 1e-3, constant, no regularisation)")

# The mixed-precision article's CNN and the small MLPs: Adam at 1e-3 for 3 epochs already reaches
# 0.99 on the built-in shapes, so their recipe is the plain defaults, spelt out.
CNN = Recipe(
    "cnn",
    {"optimizer": "adam", "learning_rate": 1e-3, "lr_decay": "constant", "epochs": 3},
    "Keras' mixed-precision guide (Adam 1e-3); seed_cnn 0.99 on the built-in shapes in 3 epochs",
)

# He et al. 2016 (CIFAR ResNets): SGD 0.1 with momentum 0.9 at batch 128, weight decay 1e-4 on
# every weight, flips and crops; cosine (Loshchilov & Hutter 2017) instead of the step decay.
RESNET_CIFAR = Recipe(
    "resnet_cifar",
    {
        "optimizer": "sgd",
        "learning_rate": 0.1,
        "reference_batch_size": 128,
        "lr_scaling": "linear",
        "warmup_epochs": 0.0,
        "lr_decay": "cosine",
        "weight_decay": 1e-4,
        "augment": True,
    },
    "He et al. 2016 (CIFAR-10 ResNets: SGD 0.1 at batch 128, momentum 0.9, weight decay 1e-4, "
    "flips and crops), cosine decay as configs/resnet20_cifar10.cfg",
)

# Goyal et al. 2017: 0.1 per 256 images scaled linearly, 5 warmup epochs; NVIDIA's
# DeepLearningExamples add cosine decay and label smoothing 0.1 and keep weight decay off the
# batch-norm parameters and biases.
RESNET50 = Recipe(
    "resnet50",
    {
        "optimizer": "sgd",
        "learning_rate": 0.1,
        "reference_batch_size": 256,
        "lr_scaling": "linear",
        "warmup_epochs": 5.0,
        "lr_decay": "cosine",
        "weight_decay": 1e-4,
        "exclude_from_weight_decay": True,
        "label_smoothing": 0.1,
        "augment": True,
        "epochs": 90,
    },
    "Goyal et al. 2017 (linear scaling, 5 warmup epochs); NVIDIA DeepLearningExamples ResNet-50 "
    "v1.5 (cosine, label smoothing 0.1, no weight decay on batch norm and biases)",
)

# DeiT (Touvron et al. 2021) for ImageNet: AdamW 5e-4 per 512 images, 5 warmup epochs, cosine,
# weight decay 0.05 off norms/biases/tokens, label smoothing 0.1, RandAugment m9, Mixup 0.8,
# CutMix 1.0, stochastic depth 0.1, 300 epochs.
DEIT = Recipe(
    "deit",
    {
        "optimizer": "adamw",
        "learning_rate": 5e-4,
        "reference_batch_size": 512,
        "lr_scaling": "linear",
        "warmup_epochs": 5.0,
        "lr_decay": "cosine",
        "weight_decay": 0.05,
        "exclude_from_weight_decay": True,
        "label_smoothing": 0.1,
        "augment": True,
        "randaugment_ops": 2,
        "randaugment_magnitude": 9.0,
        "mixup_alpha": 0.8,
        "cutmix_alpha": 1.0,
        "stochastic_depth": 0.1,
        "epochs": 300,
    },
    "DeiT (Touvron et al. 2021, Table 9): AdamW 5e-4 x batch/512, warmup 5 epochs, cosine, weight "
    "decay 0.05 without norms/biases/tokens, label smoothing 0.1, RandAugment 2 ops m9, Mixup 0.8, "
    "CutMix 1.0, stochastic depth 0.1, 300 epochs",
)

# DeiT's optimizer and regularisation, sized for vit_tiny's job here: the built-in 12,000 shapes
# in about a quarter of an hour of a 2-core CPU. What was kept and changed, and why (each
# measured): docs/recipes.md.
VIT_TINY = Recipe(
    "vit_tiny",
    {
        "optimizer": "adamw",
        # 1e-3 per 64 (16x DeiT's per-image rate): 3 epochs reach 0.945 where 5e-4 reached 0.928.
        "learning_rate": 1e-3,
        "reference_batch_size": 64,
        "lr_scaling": "linear",
        "warmup_epochs": 0.3,
        "lr_decay": "cosine",
        "weight_decay": 0.05,
        "exclude_from_weight_decay": True,
        "label_smoothing": 0.1,
        "augment": False,
        "stochastic_depth": 0.0,
        "epochs": 4,
        # XLA fuses the transformer's element-wise chains: 109 vs 70 examples/s on a 2-core AVX2
        # CPU (docs/performance.md); on GPUs `auto` compiles anyway.
        "xla": "on",
    },
    "DeiT (Touvron et al. 2021) for the optimizer, schedule and regularisation; rate, warmup, "
    "augmentation and epochs measured on the built-in shapes (docs/recipes.md)",
)

# Every knob's plain value: what `--recipe=none` trains with, and the apps' flags' defaults
# (apps/common.py defines them from here).
NONE_VALUES = {
    "optimizer": "adam",
    "learning_rate": 1e-3,
    "reference_batch_size": 256,
    "lr_scaling": "none",
    "warmup_epochs": 0.0,
    "lr_decay": "constant",
    "weight_decay": 0.0,
    "exclude_from_weight_decay": False,
    "label_smoothing": 0.0,
    "augment": False,
    "randaugment_ops": 0,
    "randaugment_magnitude": 9.0,
    "mixup_alpha": 0.0,
    "cutmix_alpha": 0.0,
    "stochastic_depth": 0.0,
    "epochs": 3,
    "xla": "auto",
}

RECIPES = {recipe.name: recipe for recipe in (NONE, CNN, RESNET_CIFAR, RESNET50, DEIT, VIT_TINY)}

# Registry name -> its recipe: the registry entry owns how its model trains.
MODEL_RECIPES = {
    "seed_cnn": "cnn",
    "lenet": "cnn",
    "mnist_mlp": "cnn",
    "resnet20": "resnet_cifar",
    "resnet56": "resnet_cifar",
    "resnet50": "resnet50",
    "vit_tiny": "vit_tiny",
    "vit_b16": "deit",
}


def resolve(name: str, model: str) -> Recipe:
    """The recipe `name` names: `auto` is `model`'s own (none for a model outside the registry,
    such as apps.detect's), `none` the plain defaults, else a recipe of RECIPES by name."""
    if name == "auto":
        return RECIPES[MODEL_RECIPES.get(model, "none")]
    if name not in RECIPES:
        raise unknown("--recipe", name, ("auto", *RECIPES))
    return RECIPES[name]


def check(values: Mapping[str, object]) -> None:
    """Refuses model and optimizer values no recipe can run with, each in one line naming the flag
    (the plan checks the input pieces' values with the input layer's own checks)."""
    stochastic_depth.check_rate(values.get("stochastic_depth", 0.0), as_flag=True)
    warmup = values.get("warmup_epochs", 0.0)
    if not 0.0 <= warmup < float("inf"):
        raise UsageError(
            f"--warmup_epochs={warmup} must be 0 (no warmup) or a positive number of epochs, e.g. 5"
        )
