"""tfmp.optim's weight-decay exclusions: which variables `decay_exclusions` picks (tfmp's ViT,
resnet20, keras-hub's ViT, the fallback rules), and one optimizer step in which only decay acts
(zero gradients: Adam's and Nesterov SGD's updates are then 0) leaving the excluded variables
exactly as they were and shrinking the kernels by learning_rate * weight_decay, on one device,
on 2 mirrored replicas and through tfmp's LossScaleOptimizer. Runs in seconds.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import optim, precision
from tfmp.errors import UsageError
from tfmp.models import build
from tfmp.models.vit import vit
from tfmp.pipeline import plan as pipeline

LEARNING_RATE, WEIGHT_DECAY = 0.1, 0.5
DECAYED = 1.0 - LEARNING_RATE * WEIGHT_DECAY  # a variable of ones after one decoupled decay step


def tiny_vit(dtype=None):
    return vit((8, 8, 3), 3, dtype=dtype, name="tiny", patch_size=4, width=8, depth=1, heads=2, mlp_ratio=2)


def paths(variables) -> set[str]:
    return {variable.path for variable in variables}


def test_vit_exclusions_are_norms_biases_and_embeddings_and_no_kernel():
    model = tiny_vit()
    excluded = paths(optim.decay_exclusions(model))
    block = "tiny_block1"
    attention_biases = {
        f"{block}_attention/{part}/bias" for part in ("query", "key", "value", "attention_output")
    }
    assert excluded == {
        "tiny_patches/bias",
        "tiny_class_token/token",
        "tiny_positions/table",
        f"{block}_norm1/gamma",
        f"{block}_norm1/beta",
        *attention_biases,  # (heads, key_dim) matrices but the query's, key's and value's
        f"{block}_norm2/gamma",
        f"{block}_norm2/beta",
        f"{block}_mlp1/bias",
        f"{block}_mlp2/bias",
        "tiny_norm/gamma",
        "tiny_norm/beta",
        "tiny_logits/bias",
    }
    assert {variable.name for variable in model.trainable_variables if variable.path not in excluded} == {
        "kernel"
    }


def test_resnet20_exclusions_are_its_batch_norms_and_the_head_bias():
    model = build("resnet20", (32, 32, 3), 10)
    excluded = optim.decay_exclusions(model)
    batch_norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    expected = {f"{layer.name}/{part}" for layer in batch_norms for part in ("gamma", "beta")}
    assert paths(excluded) == expected | {"resnet20_logits/bias"}
    kept = [variable for variable in model.trainable_variables if variable.path not in paths(excluded)]
    assert {variable.name for variable in kept} == {"kernel"} and len(kept) == 19 + 1  # 19 convs, the head
    # Listed in the model's own order, each once.
    order = [variable.path for variable in model.trainable_variables]
    assert [variable.path for variable in excluded] == [
        path for path in order if path in expected | {"resnet20_logits/bias"}
    ]


def test_keras_hub_vit_exclusions_by_layer_type_and_name():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16
    )
    excluded = paths(optim.decay_exclusions(backbone))
    embedding, block = "vit_patching_and_embedding", "vit_encoder/transformer_block_1"
    assert {f"{embedding}/class_token", f"{embedding}/position_embedding/embeddings"} <= excluded
    assert {f"{block}/ln_1/gamma", f"{block}/mha/query/bias", f"{block}/mlp/dense_2/bias"} <= excluded
    kept = {variable.path for variable in backbone.trainable_variables} - excluded
    assert {path.rsplit("/", 1)[1] for path in kept} == {"kernel"} and len(kept) == 7


class Mixer(keras.layers.Layer):
    """A layer the rule does not know: only its variables' ranks and names decide."""

    def build(self, input_shape):
        width = input_shape[-1]
        self.scale = self.add_weight(shape=(width,), initializer="ones", name="scale")
        self.pos_embed = self.add_weight(shape=(3, width), name="pos_embed")
        self.relative_position_bias_table = self.add_weight(shape=(5, 2), name="relative_position_bias_table")
        self.mixing = self.add_weight(shape=(width, width), name="mixing")

    def call(self, inputs):
        return inputs * self.scale @ self.mixing + self.pos_embed


class PatchNorm(keras.layers.Layer):
    """A normalization layer of a user's (named like one): all its own variables are excluded."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=tuple(input_shape[1:]), initializer="ones", name="gain")

    def call(self, inputs):
        return inputs * self.gain


def test_fallback_rules_for_layers_the_rule_does_not_know():
    tokens = keras.Input((3,), dtype="int32")
    x = keras.layers.Embedding(10, 4, name="words")(tokens)
    x = Mixer(name="mixer")(x)
    x = keras.layers.LayerNormalization(axis=(-2, -1), name="norm")(x)  # a (3, 4) gamma
    x = PatchNorm(name="patch_norm")(x)
    x = keras.layers.SpectralNormalization(keras.layers.Dense(4, name="dense"), name="spectral")(x)
    model = keras.Model(tokens, x)
    excluded = paths(optim.decay_exclusions(model))
    assert excluded == {
        "words/embeddings",
        "mixer/scale",
        "mixer/pos_embed",
        "mixer/relative_position_bias_table",
        "norm/gamma",
        "norm/beta",
        "patch_norm/gain",
        "spectral/dense/bias",
    }
    # A wrapper named like a normalization keeps the kernel it wraps decayed.
    assert paths(model.trainable_variables) - excluded == {"mixer/mixing", "spectral/dense/kernel"}


def ones_and_zero_gradients(model):
    """Sets every trainable variable to ones (the biases and tokens start at zero, which decay
    leaves as they are); returns zero gradients for them."""
    for variable in model.trainable_variables:
        variable.assign(tf.ones(variable.shape, variable.dtype))
    return [tf.zeros(variable.shape, variable.dtype) for variable in model.trainable_variables]


def assert_only_kernels_decayed(model, excluded_paths, replicas=1):
    for variable in model.trainable_variables:
        copies = [copy.numpy() for copy in getattr(variable.value, "values", [variable.value])]
        assert len(copies) == replicas, variable.path
        expected = 1.0 if variable.path in excluded_paths else DECAYED
        for copy in copies:
            np.testing.assert_allclose(
                copy, np.full(copy.shape, expected, np.float32), rtol=1e-6, err_msg=variable.path
            )
    assert any(variable.path not in excluded_paths for variable in model.trainable_variables)


@pytest.mark.parametrize("setting", ["one_device", "mirrored", "loss_scaled"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_one_step_decays_the_kernels_and_not_the_exclusions(mirrored, name, setting):
    strategy = tf.distribute.get_strategy() if setting == "one_device" else mirrored
    policy = "mixed_float16" if setting == "loss_scaled" else None
    with strategy.scope():
        model = tiny_vit(policy)
        excluded = optim.decay_exclusions(model)
        if setting == "loss_scaled" and name == "sgd":
            # Registered on the wrapper: it goes to the inner optimizer, which applies the decay.
            optimizer = precision.wrap_optimizer(optim.build(name, LEARNING_RATE, WEIGHT_DECAY), policy)
            optim.exclude_from_decay(optimizer, excluded)
        else:  # registered on the optimizer before any wrapping (adamw: then wrapped)
            optimizer = optim.build(name, LEARNING_RATE, WEIGHT_DECAY, exclude=excluded)
            optimizer = precision.wrap_optimizer(optimizer, policy or "float32")
        assert isinstance(optimizer, precision.LossScaleOptimizer) == (setting == "loss_scaled")
        optimizer.build(model.trainable_variables)
    gradients = ones_and_zero_gradients(model)

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply(gradients, model.trainable_variables))

    step()
    assert_only_kernels_decayed(model, paths(excluded), replicas=strategy.num_replicas_in_sync)


def test_without_exclusions_every_variable_decays():
    model = tiny_vit()
    optimizer = optim.build("adamw", LEARNING_RATE, WEIGHT_DECAY)
    optimizer.apply(ones_and_zero_gradients(model), model.trainable_variables)
    assert_only_kernels_decayed(model, excluded_paths=set())


def test_exclusions_registered_after_pipeline_placement_hold():
    # pipeline.place re-creates each variable on its stage's device (a new TensorFlow variable,
    # which Keras keys exclusions by): a list registered before it excludes nothing.
    model = tiny_vit()
    before = optim.build("sgd", LEARNING_RATE, WEIGHT_DECAY, exclude=optim.decay_exclusions(model))
    pipeline.place(model, pipeline.plan(model, ["/CPU:0", "/CPU:1"], micro_batches=1))
    after = optim.build("sgd", LEARNING_RATE, WEIGHT_DECAY, exclude=optim.decay_exclusions(model))
    excluded = paths(optim.decay_exclusions(model))
    after.apply(ones_and_zero_gradients(model), model.trainable_variables)
    assert_only_kernels_decayed(model, excluded)
    before.apply(ones_and_zero_gradients(model), model.trainable_variables)
    assert_only_kernels_decayed(model, excluded_paths=set())


def test_exclusions_must_be_variables_registered_before_the_optimizer_is_built():
    model = tiny_vit()
    with pytest.raises(UsageError, match=r"exclusions are the model's variables .* got str 'bias'"):
        optim.build("adamw", LEARNING_RATE, WEIGHT_DECAY, exclude=["bias"])
    optimizer = optim.build("adamw", LEARNING_RATE, WEIGHT_DECAY)
    optimizer.build(model.trainable_variables)
    with pytest.raises(UsageError, match="before the optimizer is built") as raised:
        optim.exclude_from_decay(optimizer, optim.decay_exclusions(model))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name", ["adamw", "sgd", "adam"])
def test_no_weight_decay_means_none(name):
    """0 is no decay for every optimizer: AdamW too (Keras' AdamW refuses None; tfmp once
    replaced 0 with 1e-4 there, a decay nobody asked for)."""
    model = tiny_vit()
    optimizer = optim.build(name, LEARNING_RATE, 0.0)
    optimizer.apply(ones_and_zero_gradients(model), model.trainable_variables)
    for variable in model.trainable_variables:
        np.testing.assert_array_equal(variable.numpy(), np.ones(variable.shape, np.float32), variable.path)
