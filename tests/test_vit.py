"""Tests for tfmp.models.vit: dtypes of every layer and sublayer, layer names, parameter counts and
FLOPs against hand counts, the size checks, a .keras round trip and a run of apps.classify.

Tiny shapes (8x8 images, width 8) except where a published size is the point; the file runs in
seconds apart from the one app run, which starts a process and is marked slow.
"""

import keras
import numpy as np
import pytest
from conftest import run_python

import tfmp.models
from tfmp.errors import UsageError
from tfmp.models import build, count_flops
from tfmp.models.vit import VIT_TINY, vit

TINY = {"patch_size": 4, "width": 8, "depth": 1, "heads": 2, "mlp_ratio": 2}


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


def test_an_untrained_vit_gives_every_class_the_same_probability():
    # The zero head of the reference ViT: the first loss is ln(num_classes), whatever the image.
    model = tiny_vit()
    images = np.random.default_rng(2).random((2, 8, 8, 3), dtype=np.float32)
    np.testing.assert_array_equal(model(images), np.full((2, 3), 1 / 3, np.float32))


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
