"""Tests for tfmp.models: dtype policies, layer names, registry errors, FLOPs and sizes.

CPU only, tiny inputs; the whole file runs in well under a minute. Models are cached per
(name, policy) so the sweeps build each one once.
"""

import functools

import keras
import numpy as np
import pytest

import tfmp.models
from tfmp.errors import UsageError
from tfmp.models import MODELS, build, count_flops
from tfmp.models.cnn import lenet, seed_cnn
from tfmp.models.resnet import resnet_cifar

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
SMALL_INPUT_SHAPES = {
    "seed_cnn": (32, 32, 3),
    "lenet": (28, 28, 1),
    "mnist_mlp": (28, 28, 1),
    "resnet20": (32, 32, 3),
    "resnet56": (32, 32, 3),
    "resnet50": (32, 32, 3),
    "vit_tiny": (32, 32, 3),
    "vit_b16": (32, 32, 3),
}
# The deep ones are only built: a forward pass through them adds seconds and tests nothing new.
FORWARD_PASS_MODELS = ("seed_cnn", "lenet", "mnist_mlp", "resnet20", "vit_tiny")
HEAD_SUFFIXES = ("_logits", "_probs")


@pytest.fixture(autouse=True)
def restore_float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


@functools.cache
def cached_model(name: str, policy: str) -> keras.Model:
    return build(name, SMALL_INPUT_SHAPES[name], 10, dtype=policy)


def is_head(layer: keras.layers.Layer) -> bool:
    return layer.name.endswith(HEAD_SUFFIXES)


def test_registry_lists_every_model():
    assert sorted(MODELS) == sorted(SMALL_INPUT_SHAPES)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_policy_reaches_every_layer_and_head_stays_float32(name, policy):
    model = cached_model(name, policy)
    compute_dtype = keras.DTypePolicy(policy).compute_dtype

    assert model.weights and all(weight.dtype == "float32" for weight in model.weights)
    assert model.dtype_policy.name == policy
    body = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    assert sorted(layer.name for layer in body if is_head(layer)) == [
        f"{name}_logits",
        f"{name}_probs",
    ]
    for layer in body:
        expected = "float32" if is_head(layer) else compute_dtype
        assert layer.dtype_policy.compute_dtype == expected, layer.name
        assert layer.dtype_policy.variable_dtype == "float32", layer.name
    assert model.inputs[0].dtype == "float32"
    assert model.outputs[0].dtype == "float32"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", FORWARD_PASS_MODELS)
def test_forward_pass_gives_float32_probabilities(name, policy):
    model = cached_model(name, policy)
    images = np.random.default_rng(0).random((2, *SMALL_INPUT_SHAPES[name]), dtype=np.float32)
    probabilities = model(images, training=False)
    assert probabilities.dtype == "float32"
    assert tuple(probabilities.shape) == (2, 10)
    np.testing.assert_allclose(keras.ops.sum(probabilities, axis=-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_layer_name_starts_with_the_model_name(name):
    model = cached_model(name, "float32")
    assert model.name == name
    assert all(layer.name.startswith(f"{name}_") for layer in model.layers)


def test_builder_defaults_name_layers_after_the_builder():
    assert lenet((28, 28, 1), 10).name == "lenet"
    assert resnet_cifar((8, 8, 3), 10, depth=8).name == "resnet8"


def test_dtype_none_follows_the_global_policy():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = lenet((28, 28, 1), 10)
    for layer in model.layers[1:]:
        expected = "float32" if is_head(layer) else "bfloat16"
        assert layer.dtype_policy.compute_dtype == expected, layer.name


def test_mixed_float16_model_compiles_with_loss_scaling():
    model = build("mnist_mlp", (28, 28, 1), 10, dtype="mixed_float16")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_unknown_model_lists_the_choices():
    with pytest.raises(UsageError) as error:
        build("nope", (28, 28, 1), 10)
    message = str(error.value)
    assert "'nope'" in message
    assert (
        "choose one of: lenet, mnist_mlp, resnet20, resnet50, resnet56, seed_cnn, vit_b16, vit_tiny"
        in message
    )


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: build("lenet", (28, 28, 1), 10, weight_decay=1e-4), "weight_decay"),
        (lambda: build("resnet20", (32, 32, 3), 10, depth=56), "depth"),
        (lambda: build("lenet", (28, 28, 1), 10, dtype="mixed_float32"), "mixed_float32"),
        (lambda: lenet((15, 15, 1), 10), "15x15"),
        (lambda: seed_cnn((7, 8, 3), 10), "7x8"),
        (lambda: seed_cnn((32, 32), 10), "(32, 32)"),
        (lambda: lenet((28, 28, 1), 1), "num_classes"),
        (lambda: resnet_cifar((32, 32, 3), 10, depth=21), "21"),
        (lambda: build("resnet20", (32, 32, 3), 10, weight_decay=-1.0), "weight_decay"),
    ],
)
def test_bad_arguments_raise_usage_error(call, fragment):
    with pytest.raises(UsageError) as error:
        call()
    assert fragment in str(error.value)


def test_smallest_supported_inputs_build():
    assert lenet((16, 16, 1), 10).output_shape == (None, 10)
    assert seed_cnn((8, 8, 3), 10).output_shape == (None, 10)


def test_count_flops_matches_hand_count():
    images = keras.Input((8, 8, 3))
    features = keras.layers.Conv2D(4, 3, padding="same")(images)
    features = keras.layers.MaxPooling2D(2)(features)  # not counted
    features = keras.layers.Flatten()(features)
    logits = keras.layers.Dense(5)(features)
    model = keras.Model(images, logits)
    conv = 2 * 8 * 8 * (3 * 3 * 3) * 4
    dense = 2 * (4 * 4 * 4) * 5
    assert count_flops(model) == conv + dense == 14464
    assert count_flops(model, batch_size=3) == 3 * 14464


class _Block(keras.layers.Layer):
    """A user's own block: its sublayers and ops run inside `call`, where no layer graph
    records their shapes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.depthwise = keras.layers.DepthwiseConv2D(3, padding="same")
        self.dense = keras.layers.Dense(6)

    def build(self, input_shape):
        self.mix = self.add_weight(shape=(6, 2), name="mix")

    def call(self, images, scale):
        tokens = keras.ops.reshape(self.depthwise(images), (-1, 16, 4)) * scale
        tokens = self.dense(tokens)  # (batch, 16, 6)
        gram = keras.ops.einsum("b...i,bsi->b...s", tokens, tokens)  # (batch, 16, 16)
        return keras.ops.matmul(gram, tokens) @ self.mix  # (batch, 16, 2)


def test_count_flops_traces_a_layer_it_has_no_rule_for():
    images, scale = keras.Input((4, 4, 4)), keras.Input((1, 1))
    model = keras.Model([images, scale], _Block()(images, scale=scale))
    depthwise = 2 * (4 * 4 * 4) * (3 * 3)
    dense = 2 * 16 * 4 * 6
    einsum = 2 * (16 * 16) * 6
    matmuls = 2 * (16 * 6) * 16 + 2 * (16 * 2) * 6
    assert count_flops(model, batch_size=2) == 2 * (depthwise + dense + einsum + matmuls)


def test_count_flops_refuses_an_open_shape_naming_the_layer():
    tokens = keras.Input((None, 8))
    model = keras.Model(tokens, keras.layers.Dense(3, name="open")(tokens))
    with pytest.raises(
        UsageError,
        match=r"count_flops needs a fixed input shape; layer 'open' has a tensor of shape \(None, None, 3\): build",
    ):
        count_flops(model)


def test_count_flops_of_lenet():
    conv1 = 2 * 24 * 24 * (5 * 5 * 1) * 20
    conv2 = 2 * 8 * 8 * (5 * 5 * 20) * 50
    dense = 2 * 800 * 500 + 2 * 500 * 10
    assert count_flops(cached_model("lenet", "float32")) == conv1 + conv2 + dense


def test_resnet_cifar_has_the_published_size():
    # He et al. 2016, table 6: ResNet-20 0.27M and ResNet-56 0.85M parameters (10 classes).
    resnet20 = cached_model("resnet20", "float32")
    resnet56 = cached_model("resnet56", "float32")
    assert trainable_parameters(resnet20) == 269_722
    assert round(trainable_parameters(resnet20) / 1e6, 2) == 0.27
    assert round(trainable_parameters(resnet56) / 1e6, 2) == 0.85
    # Option-A shortcuts add no parameters; ~41M multiply-adds per 32x32 image.
    assert round(count_flops(resnet20) / 2 / 1e6) == 41


def test_resnet50_has_the_published_size():
    model = build("resnet50", (224, 224, 3), 1000)
    # torchvision's resnet50 count: 25,557,032, plus the BatchNorm moving statistics in Keras.
    assert trainable_parameters(model) == 25_557_032
    assert round(count_flops(model) / 2 / 1e9, 1) == 4.1
    assert model.output_shape == (None, 1000)


def test_weight_decay_regularizes_every_kernel():
    model = tfmp.models.build("resnet20", (8, 8, 3), 10, weight_decay=2e-4)
    kernels = [layer.kernel for layer in model.layers if hasattr(layer, "kernel")]
    assert len(kernels) == 20  # 19 convolutions and the classifier
    assert len(model.losses) == len(kernels)
    # SGD-convention decay: loss = weight_decay / 2 * sum(kernel ** 2).
    expected = sum(1e-4 * float(keras.ops.sum(kernel**2)) for kernel in kernels)
    np.testing.assert_allclose(float(sum(model.losses)), expected, rtol=1e-4)


def test_resnet_survives_a_config_round_trip():
    model = build("resnet20", (8, 8, 3), 10, dtype="mixed_float16")
    clone = keras.Model.from_config(model.get_config())
    assert [layer.name for layer in clone.layers] == [layer.name for layer in model.layers]
    assert clone.get_layer("resnet20_stage2_block1_shortcut").dtype_policy.name == "mixed_float16"
    assert clone.count_params() == model.count_params()


def trainable_parameters(model: keras.Model) -> int:
    return sum(int(np.prod(weight.shape)) for weight in model.trainable_weights)
