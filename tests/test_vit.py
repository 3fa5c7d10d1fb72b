"""Tests for tfmp.models.vit: dtypes of every layer and sublayer, layer names, parameter counts and
FLOPs against hand counts, the size checks, a .keras round trip, stochastic depth (DeiT's linear
per-block rates, a step under MirroredStrategy with and without XLA, a serving graph without a
random op) and a run of apps.classify.

Tiny shapes (8x8 images, width 8) except where a published size is the point; the file runs in
seconds apart from the one app run, which starts a process and is marked slow.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import run_python
from fused_scaffolding import assert_replicas_identical, replica_batches
from test_stochastic_depth import random_op_types

import tfmp.models
from tfmp.errors import UsageError
from tfmp.models import build, count_flops
from tfmp.models.stochastic_depth import StochasticDepth
from tfmp.models.vit import VIT_TINY, drop_rates, vit
from tfmp.precision import float32_layers, fuse_normalization
from tfmp.serving import classifier
from tfmp.training.engine import Engine

TINY = {"patch_size": 4, "width": 8, "depth": 1, "heads": 2, "mlp_ratio": 2}
# The stochastic depth tests' model: vit_tiny's shape, scaled down (3 blocks, width 16).
DEEPER = {"depth": 3, "width": 16}


@pytest.fixture(autouse=True)
def restore_float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def tiny_vit(dtype=None, **options):
    return vit((8, 8, 3), 3, dtype=dtype, name="tiny", **{**TINY, **options})


def vit_parameters(image, patch, channels, width, depth, mlp, classes):
    """ViT's parameter count by hand: patch embedding, class token, positions, blocks, norm, head."""
    tokens = (image // patch) ** 2 + 1
    block = 2 * 2 * width + 4 * (width * width + width) + (width * mlp + mlp) + (mlp * width + width)
    embedding = patch * patch * channels * width + width + width + tokens * width
    return embedding + depth * block + 2 * width + width * classes + classes


def vit_flops(image, patch, channels, width, depth, heads, mlp, classes):
    """Forward FLOPs by hand: patch convolution, Q/K/V/output projections, Q K^T and scores x V
    (2 * T * T * width each, over all heads), the MLP and the head."""
    patches = (image // patch) ** 2
    tokens = patches + 1
    attention = 4 * 2 * tokens * width * width + 2 * 2 * tokens * tokens * width
    mlp_flops = 2 * 2 * tokens * width * mlp
    return (
        2 * patches * patch * patch * channels * width + depth * (attention + mlp_flops) + 2 * width * classes
    )


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_every_layer_and_attention_sublayer_computes_in_the_policy(policy):
    model = tiny_vit(policy)
    compute_dtype = keras.DTypePolicy(policy).compute_dtype
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    attention = model.get_layer("tiny_block1_attention")
    sublayers = [attention.query_dense, attention.key_dense, attention.value_dense, attention.output_dense]
    for layer in layers + sublayers:
        expected = "float32" if layer.name in ("tiny_logits", "tiny_probs") else compute_dtype
        assert layer.dtype_policy.compute_dtype == expected, layer.name
    assert all(weight.dtype == "float32" for weight in model.weights)
    # The tokens flow in the compute dtype from the patches to the pooled features.
    for name in ("tiny_positions", "tiny_block1_add1", "tiny_block1_add2", "tiny_features"):
        assert model.get_layer(name).output.dtype == compute_dtype, name
    images = np.random.default_rng(0).random((2, 8, 8, 3), dtype=np.float32)
    probabilities = model(images)
    assert probabilities.dtype == "float32"
    np.testing.assert_allclose(keras.ops.sum(probabilities, axis=-1), 1.0, atol=1e-6)


def test_an_untrained_vit_head_is_random_so_the_first_step_reaches_the_blocks():
    # A zero head (big_vision's) gives the blocks zero gradients on the first step; Glorot's does not.
    model = tiny_vit()
    images = np.random.default_rng(2).random((2, 8, 8, 3), dtype=np.float32)
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(np.array([0, 1]), model(images))
    kernel = model.get_layer("tiny_block1_mlp1").kernel
    assert float(tf.reduce_max(tf.abs(tape.gradient(loss, kernel)))) > 0
    assert float(tf.math.reduce_std(model.get_layer("tiny_class_token").token)) > 0


def test_layer_names_follow_the_model_name():
    names = [layer.name for layer in tiny_vit(dropout=0.1).layers]
    block = ["norm1", "attention", "attention_dropout", "add1", "norm2", "mlp1", "mlp_dropout1"]
    block += ["mlp2", "mlp_dropout2", "add2"]
    assert names == [
        "tiny_images",
        "tiny_patches",
        "tiny_tokens",
        "tiny_class_token",
        "tiny_positions",
        "tiny_embedding_dropout",
        *[f"tiny_block1_{part}" for part in block],
        "tiny_norm",
        "tiny_pool",
        "tiny_features",
        "tiny_logits",
        "tiny_probs",
    ]
    assert len(build("vit_tiny", (32, 32, 3), 10).layers) == 5 + 6 * 7 + 5


def test_count_flops_counts_attention_by_hand():
    # T = 2*2 patches + class token = 5, width 8, 2 heads of 4, MLP 16, 3 classes.
    patches = 2 * 4 * (4 * 4 * 3) * 8
    projections = 4 * 2 * 5 * 8 * 8
    scores_and_weighted_values = 2 * 2 * (5 * 5) * (4 + 4)
    mlp = 2 * 2 * 5 * 8 * 16
    head = 2 * 8 * 3
    expected = patches + projections + scores_and_weighted_values + mlp + head
    assert expected == vit_flops(8, 4, 3, 8, 1, 2, 16, 3) == 9040
    assert count_flops(tiny_vit()) == expected
    assert count_flops(tiny_vit(), batch_size=4) == 4 * expected


def test_count_flops_of_cross_attention_over_chosen_axes():
    # Query (4, 6) positions, value (4, 5), attending over the second axis only: the first axis
    # multiplies like a batch. Projections: query/output on 24 positions, key/value on 20.
    query, value = keras.Input((4, 6, 8)), keras.Input((4, 5, 8))
    attention = keras.layers.MultiHeadAttention(2, key_dim=3, value_dim=5, attention_axes=2)
    model = keras.Model([query, value], attention(query, value))
    projections = 24 * (8 * 2 * 3 + 2 * 5 * 8) + 20 * (8 * 2 * 3 + 8 * 2 * 5)
    matmuls = 4 * 6 * 5 * 2 * (3 + 5)
    assert count_flops(model) == 2 * (projections + matmuls)


def test_vit_sizes_and_flops_match_the_hand_formulas():
    vit_tiny = build("vit_tiny", (32, 32, 3), 10)
    assert vit_tiny.count_params() == vit_parameters(32, 4, 3, 192, 6, 768, 10) == 2_693_578
    assert count_flops(vit_tiny) == vit_flops(32, 4, 3, 192, 6, 3, 768, 10) == 365_699_328
    # DeiT-Tiny (12 blocks, 16x16 patches at 224x224): 5.7M parameters in Touvron et al. 2021.
    deit_tiny = vit((224, 224, 3), 1000, name="deit_tiny", **{**VIT_TINY, "patch_size": 16, "depth": 12})
    assert deit_tiny.count_params() == vit_parameters(224, 16, 3, 192, 12, 768, 1000) == 5_717_416


def test_vit_b16_has_the_published_size():
    model = build("vit_b16", (224, 224, 3), 1000)
    # Dosovitskiy et al. 2021, table 1: ViT-Base 86M; timm's vit_base_patch16_224 86,567,656.
    assert model.count_params() == vit_parameters(224, 16, 3, 768, 12, 3072, 1000) == 86_567_656
    # 17.6 G multiply-adds per image, as published for ViT-B/16 at 224x224.
    assert count_flops(model) == vit_flops(224, 16, 3, 768, 12, 12, 3072, 1000) == 35_127_656_448
    assert round(count_flops(model) / 2 / 1e9, 1) == 17.6


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: build("vit_tiny", (30, 30, 3), 10),
            "model 'vit_tiny' cuts images into 4x4 patches, and 30x30 is not a multiple of 4; use images "
            "of 28x28 or 32x32 (--image_size=28 or 32 in the apps)",
        ),
        (
            lambda: vit((32, 32, 3), 10, name="wide", patch_size=4, width=192, depth=1, heads=5),
            "model 'wide': 5 heads do not divide its width 192; use 4 or 6 heads, or a width that is a "
            "multiple of 5",
        ),
        (
            lambda: build("vit_tiny", (64, 64, 3), 10, positions=65),
            "model 'vit_tiny' makes a sequence of 257 tokens (256 patches of 64x64 images + the class "
            "token), more than its 65 position embeddings; use images of at most 32x32 or positions >= 257",
        ),
        (
            lambda: build("vit_b16", (8, 8, 3), 10),
            "8x8 is not a multiple of 16; use images of 16x16 (--image_size=16 in",
        ),
        (lambda: build("vit_tiny", (32, 32, 3), 10, heads=4), "does not take option(s) heads"),
        (lambda: tiny_vit(positions=1), "positions >= 2"),
        (lambda: tiny_vit(depth=0), "positive integer depth, got 0"),
        (lambda: tiny_vit(dropout=1.0), "dropout in [0, 1), got 1.0"),
        (lambda: tiny_vit(stochastic_depth=1.0), "stochastic_depth 1.0 must be in [0, 1)"),
        (lambda: tiny_vit(stochastic_depth=-0.1), "stochastic_depth -0.1 must be in [0, 1)"),
    ],
)
def test_bad_sizes_are_one_line_usage_errors(call, message):
    with pytest.raises(UsageError) as raised:
        call()
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_position_table_longer_than_the_sequence_uses_its_first_rows():
    model = tiny_vit(positions=9)
    table = model.get_layer("tiny_positions").table
    assert tuple(table.shape) == (9, 8)
    images = np.zeros((1, 8, 8, 3), np.float32)
    assert tuple(model(images).shape) == (1, 3)


def test_saved_model_loads_with_the_same_outputs(tmp_path):
    model = tiny_vit("mixed_bfloat16")
    path = str(tmp_path / "vit.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    images = np.random.default_rng(1).random((2, 8, 8, 3), dtype=np.float32)
    np.testing.assert_array_equal(loaded(images), model(images))
    assert loaded.get_layer("tiny_positions").dtype_policy.name == "mixed_bfloat16"


def test_registry_entries_fix_the_architecture():
    assert tfmp.models.MODELS["vit_tiny"].keywords == {"patch_size": 4, "width": 192, "depth": 6, "heads": 3}
    assert tfmp.models.MODELS["vit_b16"].keywords == {
        "patch_size": 16,
        "width": 768,
        "depth": 12,
        "heads": 12,
    }


def residual_adds(model):
    return [layer for layer in model.layers if layer.name.endswith(("_add1", "_add2"))]


def test_stochastic_depth_rates_grow_linearly_over_the_blocks():
    # DeiT's and timm's torch.linspace(0, rate, depth): the first block 0, the last the full rate.
    np.testing.assert_allclose(drop_rates(0.1, 6), [0.0, 0.02, 0.04, 0.06, 0.08, 0.1], atol=1e-12)
    assert drop_rates(0.1, 1) == [0.0]
    model = tiny_vit(**DEEPER, stochastic_depth=0.2)
    adds = residual_adds(model)
    assert [layer.name for layer in adds] == [f"tiny_block{b}_add{i}" for b in (1, 2, 3) for i in (1, 2)]
    assert all(type(layer) is StochasticDepth for layer in adds)
    assert [layer.rate for layer in adds] == [0.0, 0.0, 0.1, 0.1, 0.2, 0.2]


def test_without_stochastic_depth_the_adds_are_keras_add_layers():
    plain, dropping = tiny_vit(**DEEPER), tiny_vit(**DEEPER, stochastic_depth=0.1)
    assert all(type(layer) is keras.layers.Add for layer in residual_adds(plain))
    assert [layer.name for layer in plain.layers] == [layer.name for layer in dropping.layers]
    assert plain.count_params() == dropping.count_params() and count_flops(plain) == count_flops(dropping)
    # fuse_normalization fuses the same layers either way (the adds are none of its business).
    assert fuse_normalization(plain).fused == fuse_normalization(dropping).fused
    # --float32_layers patterns name the adds as before; the copy keeps each layer's rate.
    copy = float32_layers(dropping, ["tiny_block3_add[12]"]).get_layer("tiny_block3_add2")
    assert (type(copy), copy.rate, copy.dtype_policy.name) == (StochasticDepth, 0.1, "float32")


def test_the_registry_passes_stochastic_depth_to_vit_tiny():
    model = build("vit_tiny", (8, 8, 3), 10, stochastic_depth=0.1)
    assert model.get_layer("vit_tiny_block6_add2").rate == 0.1
    assert model.get_layer("vit_tiny_block1_add1").rate == 0.0


def test_stochastic_depth_vit_serves_deterministically(tmp_path):
    model = tiny_vit("mixed_bfloat16", **DEEPER, stochastic_depth=0.5)
    images = np.random.default_rng(3).random((4, 8, 8, 3), dtype=np.float32)
    np.testing.assert_array_equal(model.predict(images, verbose=0), model.predict(images, verbose=0))
    serve = classifier.serving(model, {})  # the function tfmp.serving.export writes as serving_default
    assert random_op_types(serve, tf.TensorSpec([None, 8, 8, 3], tf.float32)) == set()
    assert random_op_types(lambda x: model(x, training=True), tf.TensorSpec([None, 8, 8, 3], tf.float32))
    model.save(tmp_path / "vit.keras")
    loaded = keras.saving.load_model(tmp_path / "vit.keras")
    assert [layer.rate for layer in residual_adds(loaded)] == [layer.rate for layer in residual_adds(model)]
    np.testing.assert_array_equal(loaded(images), model(images))


@pytest.mark.parametrize("xla", [False, True])
def test_stochastic_depth_vit_trains_a_step_on_mirrored_replicas(mirrored, xla):
    keras.utils.set_random_seed(4)
    with mirrored.scope():
        model = tiny_vit(**{**DEEPER, "depth": 2}, stochastic_depth=0.5)
        # A head of std 1 (Glorot's is smaller), so one SGD step moves the blocks visibly.
        model.get_layer("tiny_logits").kernel.assign(np.random.default_rng(5).normal(size=(16, 3)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy())
    engine = Engine(mirrored, model, xla=xla)
    block = model.get_layer("tiny_block2_mlp2").kernel
    before = block.numpy()
    rng = np.random.default_rng(6)
    arrays = (rng.random((8, 8, 8, 3), dtype=np.float32), rng.integers(0, 3, 8).astype(np.int32))
    result = engine.train(replica_batches(mirrored, arrays, 8), 1)
    assert np.isfinite(result.metrics["loss"]) and not np.array_equal(block.numpy(), before)
    assert_replicas_identical(model)
    # Block 2 draws (block 1's rate is 0): each state moved once, alike on both replicas.
    states = [variable for variable in model.variables if "seed_generator" in variable.path]
    assert len(states) == 2
    for state in states:
        copies = [copy.numpy() for copy in state.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
        assert copies[0][1] == 1


@pytest.mark.slow  # starts TensorFlow in a new process
def test_classify_trains_vit_tiny(tmp_path):
    # 16x16 images (4x4 patches, 17 tokens) keep the real vit_tiny's run and its 2,000-image eval short.
    result = run_python(
        [
            "-m",
            "apps.classify",
            "--model=vit_tiny",
            "--image_size=16",
            "--steps=3",
            "--global_batch_size=64",
            "--optimizer=adamw",
            "--warmup_steps=1",
            f"--model_dir={tmp_path}",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("tfmp summary:")]
    assert summary and "3 steps (3 applied)" in summary[-1], result.stdout[-3000:]
    assert (tmp_path / "model.keras").exists()
