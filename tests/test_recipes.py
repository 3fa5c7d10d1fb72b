"""Recipes (tfmp.models.recipes): each registry model's own, applied to the flags a user leaves
unset, shown on the run card with their source, and refused when they cannot run."""

import dataclasses

import keras
import numpy as np
import pytest
from absl.testing import flagsaver

from apps import common
from tfmp import models, optim, precision
from tfmp.classification import data
from tfmp.classification.task import TASK, compile_classifier
from tfmp.errors import UsageError
from tfmp.models import recipes
from tfmp.models.vit import vit
from tfmp.training import run_card
from tfmp.training.config import TrainConfig
from tfmp.training.engine import Engine
from tfmp.training.plan import make_plan


def _app_config(*argv: str) -> TrainConfig:
    """apps.classify's config for this command line, flags restored afterwards."""
    with flagsaver.flagsaver():
        common.FLAGS.unparse_flags()
        common.FLAGS(["classify", *argv])
        return common.config_from_flags()


def test_every_registry_model_has_a_recipe_of_valid_flags():
    plain = TrainConfig().flat()
    assert set(recipes.MODEL_RECIPES) == set(models.MODELS)
    for recipe in recipes.RECIPES.values():
        assert set(recipe.values) <= set(recipes.KNOBS) <= set(plain)
        for knob, value in recipe.values.items():  # each value has its flag's type
            assert isinstance(value, type(plain[knob])) or (type(plain[knob]) is float and type(value) is int)
        recipes.check(recipe.values)
    assert recipes.resolve("auto", "vit_tiny").name == "vit_tiny"
    assert recipes.resolve("auto", "retinanet_resnet50").name == "none"  # outside the registry
    with pytest.raises(UsageError, match="unknown --recipe 'deit3'"):
        recipes.resolve("deit3", "vit_tiny")


def test_the_recipe_fills_only_the_flags_left_unset():
    config = _app_config("--model=vit_tiny", "--learning_rate=0.002", "--steps=40")
    optimization = config.optimization
    assert (optimization.optimizer, optimization.learning_rate) == ("adamw", 0.002)  # the flag wins
    assert optimization.weight_decay == 0.05 and optimization.exclude_from_weight_decay
    assert config.recipe == "vit_tiny" and "learning_rate" not in config.recipe_fields
    # --steps stands for the length: the recipe's epochs are left alone, as they mean the same.
    assert "epochs" not in config.recipe_fields and "optimizer" in config.recipe_fields
    none = _app_config("--model=vit_tiny", "--recipe=none")
    assert none.flat() == {**_app_config("--model=seed_cnn", "--recipe=none").flat(), "model": "vit_tiny"}
    assert (none.optimization.optimizer, none.optimization.weight_decay, none.data.augment) == (
        "adam",
        0.0,
        False,
    )
    # The resolved flags are the run's flags.txt: read back, every value is explicit and the same.
    flagfile = [line for line in common.resolved_flags("classify", config).splitlines()[1:]]
    again = _app_config(*flagfile)
    assert again.flat() | {"recipe_fields": ()} == config.flat() | {"recipe_fields": ()}


def test_warmup_steps_override_the_recipes_warmup_epochs_and_epochs_fit_short_runs():
    config = _app_config("--model=vit_tiny", "--warmup_steps=0")
    assert "warmup_epochs" not in config.recipe_fields  # --warmup_steps=0 means no warmup
    config = _app_config("--model=vit_tiny", "--steps=20", "--cpu_replicas=0")
    plan = make_plan(config, TASK)
    assert config.optimization.warmup_epochs == 0.3 and plan.warmup_steps == 20  # 56 cut to the run
    plan = make_plan(
        dataclasses.replace(config, optimization=dataclasses.replace(config.optimization, steps=0)), TASK
    )
    assert plan.warmup_steps == round(0.3 * (12_000 // 64))  # 0.3 of an epoch of the built-in shapes


def test_run_card_shows_each_recipe_value_with_its_source():
    rows = run_card.recipe_rows(_app_config("--model=vit_tiny", "--epochs=2"))
    assert rows["recipe"].startswith("vit_tiny: DeiT")
    shown = rows["recipe values"]
    assert "optimizer=adamw (recipe)" in shown and "epochs=2 (flag)" in shown
    assert "mixup_alpha=0.0 (flag)" in shown  # a knob this recipe leaves at the flag's default
    assert all(f"{knob}=" in shown for knob in recipes.KNOBS)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"stochastic_depth": -0.1}, "--stochastic_depth=-0.1 must be in [0, 1)"),
        ({"warmup_epochs": float("nan")}, "--warmup_epochs=nan must be 0"),
    ],
)
def test_check_refuses_values_no_piece_runs_with(values, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        recipes.check(values)


# Each precision once and XLA both ways: the pieces are input-pipeline ops and one layer, so the
# precision x XLA product adds no path the three cells miss (tests/test_matrix.py has the product).
@pytest.mark.parametrize(
    ("policy", "xla"),
    [("float32", False), ("mixed_bfloat16", True), ("mixed_float16", True)],
    ids=["float32-xla_off", "mixed_bfloat16-xla_on", "mixed_float16-xla_on"],
)
def test_every_piece_trains_on_two_replicas_under_every_precision_and_xla(mirrored, policy, xla):
    """DeiT's pieces at once (stochastic depth, weight decay without norms/biases/tokens,
    RandAugment, Mixup/CutMix soft labels with label smoothing) on a two-block ViT over two
    logical CPUs: every step applies, the soft-label loss is finite, the replicas stay identical."""
    keras.utils.set_random_seed(0)
    with mirrored.scope():
        model = vit(
            (16, 16, 3), 10, dtype=policy, patch_size=4, width=16, depth=2, heads=2, stochastic_depth=0.5
        )
        optimizer = precision.wrap_optimizer(
            optim.build("adamw", 1e-3, 0.05, exclude=optim.decay_exclusions(model)), policy, "auto"
        )
    compile_classifier(model, optimizer, mirrored, label_smoothing=0.1, soft_labels=True)
    engine = Engine(mirrored, model, optimizer, xla=xla)
    train = mirrored.distribute_datasets_from_function(
        lambda context: data.load(
            "shapes",
            "train",
            16,
            image_size=16,
            input_context=context,
            augment=True,
            randaugment=(2, 9.0),
            mixing={"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
        )[0]
    )
    result = engine.train(iter(train), 2)
    assert np.isfinite(result.metrics["loss"]) and result.nonfinite_steps == 0
    assert 0.0 <= result.metrics["accuracy"] <= 1.0
    assert int(optimizer.iterations.numpy()) == 2
    for variable in model.variables + optimizer.variables:
        copies = [copy.numpy() for copy in mirrored.experimental_local_results(variable.value)]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=variable.path)


def test_recipe_none_is_the_apps_flag_defaults():
    values = _app_config("--recipe=none").flat()
    assert {knob: values[knob] for knob in recipes.KNOBS} == recipes.NONE_VALUES


def test_a_recipes_optimizer_for_any_keras_model_scales_its_rate_and_spares_norms():
    """recipes.optimizer on a model outside the registry: the learning rate scaled to the batch,
    and one step of zero gradients decays the kernels only (norms, biases, tokens kept)."""
    model = vit((8, 8, 3), 3, patch_size=4, width=8, depth=1, heads=2, name="mine")
    optimizer = optim.for_recipe(recipes.VIT_TINY, model, global_batch_size=32, steps_per_epoch=10, epochs=2)
    schedule = optimizer.get_config()["learning_rate"]["config"]
    assert schedule["peak"] == pytest.approx(recipes.VIT_TINY.values["learning_rate"] * 32 / 64)
    assert (schedule["total_steps"], schedule["warmup_steps"], schedule["decay"]) == (20, 3, "cosine")
    before = [variable.numpy() for variable in model.trainable_variables]
    zeros = [np.zeros(variable.shape, "float32") for variable in model.trainable_variables]
    optimizer.apply(zeros, model.trainable_variables)
    excluded = {id(variable) for variable in optim.decay_exclusions(model)}
    assert excluded and len(excluded) < len(model.trainable_variables)
    # Decay shrinks what it reaches (zeros stay zeros either way: those prove nothing).
    for variable, start in zip(model.trainable_variables, before):
        if np.any(start):
            decayed = not np.array_equal(variable.numpy(), start)
            assert decayed == (id(variable) not in excluded), variable.path
