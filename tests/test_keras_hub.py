"""fuse_normalization on keras-hub transformers built from their constructors (no weights
downloaded): ViTBackbone, BertBackbone and a TransformerDecoder (keras-hub's
CachedMultiHeadAttention) list every normalization and attention layer, compute Keras' numbers
within the compute dtype's rounding, train through tfmp.fit like Keras' layers, and their saved
.keras files load where tfmp is never imported.

    .venv/bin/python -m pytest tests/test_keras_hub.py -q -n 0

Skipped when keras-hub is not installed (setup.cfg's `test` extra installs it); importing it
costs about 2 s over TensorFlow's own import, paid only by this module.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from tfmp.precision import attention  # noqa: E402
from tfmp.precision.fused_norm import fuse_normalization  # noqa: E402

keras_hub = pytest.importorskip("keras_hub")

POLICIES = ["float32", "mixed_bfloat16"]
TOKENS, VOCABULARY, WIDTH, HEADS, CLASSES, IMAGE, PATCH = 16, 50, 16, 2, 3, 16, 4
BATCH, STEPS = 8, 4
EXPLICIT = (
    "Keras' explicit path, whose softmax computes and keeps its probabilities in the compute dtype already"
)


def bert_classifier(policy="float32", dropout=0.0, seed=1) -> keras.Model:
    """BertBackbone (2 layers, width 16, 16 tokens) -> its pooled output -> a float32 Dense head
    (logits), as keras-hub's BertTextClassifier puts it together; seeded weights."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=HEADS,
        hidden_dim=WIDTH,
        intermediate_dim=2 * WIDTH,
        max_sequence_length=TOKENS,
        dropout=dropout,
        dtype=policy,
        name="bert",
    )
    inputs = {name: keras.Input((TOKENS,), dtype="int32", name=name) for name in backbone.input}
    pooled = backbone(inputs)["pooled_output"]
    return keras.Model(
        inputs, keras.layers.Dense(CLASSES, dtype="float32", name="head")(pooled), name="classifier"
    )


def vit_classifier(policy="float32", seed=1) -> keras.Model:
    """ViTBackbone (16x16 images, patch 4, 2 layers, width 16) -> its class token -> a float32
    Dense head (logits), as keras-hub's ViTImageClassifier pools ("token"); seeded weights."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(IMAGE, IMAGE, 3),
        patch_size=PATCH,
        num_layers=2,
        num_heads=HEADS,
        hidden_dim=WIDTH,
        mlp_dim=2 * WIDTH,
        dtype=policy,
        name="vit",
    )
    images = keras.Input((IMAGE, IMAGE, 3), name="images")
    token = backbone(images)[:, 0, :]
    return keras.Model(
        images, keras.layers.Dense(CLASSES, dtype="float32", name="head")(token), name="classifier"
    )


def decoder_classifier(policy="float32", seed=1) -> keras.Model:
    """keras-hub's GPT-style block: TokenAndPositionEmbedding -> TransformerDecoder (causal
    CachedMultiHeadAttention, padding mask from token 0) -> mean -> float32 Dense head."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((TOKENS,), dtype="int32", name="token_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(
        VOCABULARY, TOKENS, WIDTH, mask_zero=True, dtype=policy, name="embed"
    )(tokens)
    x = keras_hub.layers.TransformerDecoder(2 * WIDTH, HEADS, dropout=0.0, dtype=policy, name="decoder")(x)
    x = keras.layers.GlobalAveragePooling1D(dtype=policy, name="pool")(x)
    return keras.Model(
        tokens, keras.layers.Dense(CLASSES, dtype="float32", name="head")(x), name="classifier"
    )


def token_inputs(examples=BATCH, seed=2) -> dict:
    """BERT's three inputs: tokens 1..49 with each row's last 0-5 positions padding."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(1, VOCABULARY, (examples, TOKENS)).astype(np.int32)
    padding_mask = np.ones_like(token_ids)
    for row, pad in enumerate(rng.integers(0, 6, examples)):
        padding_mask[row, TOKENS - pad :] = 0
    return {
        "token_ids": token_ids * padding_mask,
        "segment_ids": np.zeros_like(token_ids),
        "padding_mask": padding_mask,
    }


def images(examples=BATCH, seed=2) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (examples, IMAGE, IMAGE, 3)).astype(np.float32)


MODELS = {
    "vit": (vit_classifier, images),
    "bert": (bert_classifier, token_inputs),
    "decoder": (decoder_classifier, lambda examples=BATCH: token_inputs(examples)["token_ids"]),
}


def _eps(policy) -> float:
    return float(np.finfo(tf.as_dtype(keras.mixed_precision.Policy(policy).compute_dtype).as_numpy_dtype).eps)


def _tolerance(policy, fused_layers, steps=1) -> float:
    """Relative bound: each fused layer's output rounds once differently on each side (2 epsilons
    of the compute dtype), forward and in each step; float32 sums of at most the width x tokens
    terms in another order."""
    return 2 * fused_layers * steps * _eps(policy) + WIDTH * TOKENS * steps * _eps("float32")


def _blocks(prefix, names, count, start=0):
    return tuple(f"{prefix}_{index}/{name}" for index in range(start, start + count) for name in names)


def test_every_normalization_and_attention_layer_is_listed():
    """ViT: 5 LayerNormalization, 2 MultiHeadAttention and the MLPs' 2 GELU Dense layers fused
    (none silently skipped, the original bug). BERT as built (dropout 0.1): its 5
    LayerNormalization and 2 Dense(gelu_approximate) fused, its attention
    left alone on Keras' explicit path, which keeps half-precision probabilities already; with
    dropout 0 fused too. A TransformerDecoder's CachedMultiHeadAttention (its call goes through
    _compute_attention) is fused; keras-hub's own RMSNormalization and XLNet's attention, whose
    call has its own core, are named and left alone."""
    vit = fuse_normalization(vit_classifier())
    encoder = "classifier/vit/vit_encoder"
    assert vit.fused == (
        *_blocks(f"{encoder}/transformer_block", ("ln_1", "mha", "ln_2", "mlp/dense_1"), 2, 1),
        f"{encoder}/ln",
    )
    assert vit.left_alone == ()

    bert = fuse_normalization(bert_classifier(dropout=0.1))
    layers = "classifier/bert/transformer_layer"
    norms = ("self_attention_layer_norm", "feedforward_layer_norm", "feedforward_intermediate_dense")
    assert bert.fused == ("classifier/bert/embeddings_layer_norm", *_blocks(layers, norms, 2))
    assert bert.left_alone == tuple(
        (path, f"dropout 0.1: {EXPLICIT}") for path in _blocks(layers, ["self_attention_layer"], 2)
    )
    no_dropout = fuse_normalization(bert_classifier(dropout=0.0))
    assert no_dropout.fused == (
        "classifier/bert/embeddings_layer_norm",
        *_blocks(layers, ("self_attention_layer", *norms), 2),
    )

    model = decoder_classifier()
    hub_rms = keras_hub.layers.RMSNormalization(WIDTH)  # takes no name or dtype: listed by class
    model = keras.Model(model.input, hub_rms(model.get_layer("pool").output), name="decoder_model")
    decoder = fuse_normalization(model)
    assert decoder.fused == tuple(
        f"decoder_model/decoder/{name}"
        for name in ("self_attention", "self_attention_layer_norm", "feedforward_layer_norm")
    )
    assert decoder.left_alone == (
        (
            f"decoder_model/{hub_rms.name}",
            "keras_hub.src.layers.modeling.rms_normalization.RMSNormalization: not a layer tfmp fuses "
            "(its own computation)",
        ),
    )
    relative = pytest.importorskip("keras_hub.src.models.xlnet.relative_attention")
    assert attention.unfusable_reason(relative.TwoStreamRelativeAttention(num_heads=2, key_dim=4)) == (
        "TwoStreamRelativeAttention overrides call without calling self._compute_attention"
    )


def _hand_flops(name) -> int:
    """Forward FLOPs of MODELS[name] by hand: Q/K/V/output projections, Q K^T and scores x V,
    the MLP (hidden 2 x WIDTH), ViT's patch convolution, BERT's pooler (a Dense on the first
    token) and the head; embeddings are gathers."""

    def block(tokens):
        return (
            4 * 2 * tokens * WIDTH * WIDTH
            + 2 * 2 * tokens * tokens * WIDTH
            + 2 * 2 * tokens * WIDTH * 2 * WIDTH
        )

    patches, head = (IMAGE // PATCH) ** 2, 2 * WIDTH * CLASSES
    return {
        "vit": 2 * patches * PATCH * PATCH * 3 * WIDTH + 2 * block(patches + 1) + head,
        "bert": 2 * block(TOKENS) + 2 * WIDTH * WIDTH + head,
        "decoder": block(TOKENS) + head,
    }[name]


# The decoder's Keras mask reaches layers inside keras-hub's blocks that drop it (they take the
# padding mask through the block's own call): Keras warns, keras-hub's design, not ours.
@pytest.mark.filterwarnings("ignore:Layer '.*' .* was passed an input with a mask attached")
@pytest.mark.parametrize("fused", [False, True])
def test_count_flops_sees_inside_keras_hub_layers(fused):
    """keras-hub's encoders and decoders call their Dense and attention layers inside `call`,
    where no layer graph records shapes: count_flops counts them on the traced graph, fused or
    not, to the hand count."""
    for name, (build, _) in MODELS.items():
        model = build("mixed_bfloat16")
        if fused:
            fuse_normalization(model)
        assert tfmp.models.count_flops(model, batch_size=3) == 3 * _hand_flops(name), name


@pytest.mark.filterwarnings("ignore:Layer '.*' .* was passed an input with a mask attached")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_outputs_equal_keras(name, policy):
    """Inference and a training-mode forward pass (masks, causal mask, class token) before and
    after fusing the same model: within the compute dtype's rounding per fused layer."""
    build, data = MODELS[name]
    model, inputs = build(policy), data()
    before = [np.asarray(model(inputs, training=training), np.float64) for training in (False, True)]
    fused = len(fuse_normalization(model).fused)
    assert fused >= 3
    for training, reference in zip((False, True), before):
        actual = np.asarray(model(inputs, training=training), np.float64)
        bound = _tolerance(policy, fused) * np.abs(reference).max()
        np.testing.assert_allclose(actual, reference, rtol=0, atol=bound, err_msg=f"training={training}")


def _fit_losses(name, policy, fused) -> list:
    """Per-step losses of STEPS SGD steps through tfmp.fit (one device), fused or Keras' layers."""
    build, data = MODELS[name]
    model = build(policy)
    if fused:
        assert fuse_normalization(model).fused
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    labels = np.random.default_rng(3).integers(0, CLASSES, BATCH * STEPS).astype(np.int32)
    history = tfmp.fit(
        model,
        data(BATCH * STEPS),
        labels,
        batch_size=BATCH,
        epochs=STEPS,
        steps_per_epoch=1,
        shuffle=False,
        verbose=0,
    )
    return history.history["loss"]


@pytest.mark.slow  # two fits per case: 10-15 s each on 2 cores
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("name", ["vit", "bert"])
def test_trains_through_fit_like_keras(name, policy):
    """tfmp.fit, fused vs Keras' layers from the same weights: each step's loss within the
    compute dtype's rounding of every fused layer, forward and backward, per step so far."""
    reference, fused = _fit_losses(name, policy, False), _fit_losses(name, policy, True)
    assert len(fused) == STEPS and np.all(np.isfinite(fused))
    layers = len(fuse_normalization(MODELS[name][0](policy)).fused)
    for step, (mine, theirs) in enumerate(zip(fused, reference), start=1):
        assert abs(mine - theirs) <= 2 * _tolerance(policy, layers, step) * abs(theirs), (step, mine, theirs)


LOAD_WITHOUT_TFMP = """
import json, sys
import keras, keras_hub, numpy
model = keras.saving.load_model(sys.argv[1])
data = dict(numpy.load(sys.argv[2]))
data = data["x"] if list(data) == ["x"] else data
numpy.save(sys.argv[3], numpy.asarray(model(data, training=False), "float32"))
print(json.dumps({"tfmp": sorted(m for m in sys.modules if m.split(".")[0] == "tfmp")}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit", "bert"])
def test_saved_fused_model_loads_without_tfmp(name, tmp_path):
    """A fused mixed_bfloat16 model trained through tfmp.fit, saved to .keras: the same config as
    unfused, and a fresh process importing only keras and keras_hub predicts what it predicts."""
    from conftest import run_python

    build, data = MODELS[name]
    model = build("mixed_bfloat16")
    config = model.get_config()
    fused = len(fuse_normalization(model).fused)
    assert model.get_config() == config
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    labels = np.arange(BATCH * 2, dtype=np.int32) % CLASSES
    tfmp.fit(model, data(BATCH * 2), labels, batch_size=BATCH, epochs=1, verbose=0)
    inputs = data()
    predictions = np.asarray(model(inputs, training=False), np.float64)
    model.save(tmp_path / "fused.keras")
    np.savez(tmp_path / "inputs.npz", **(inputs if isinstance(inputs, dict) else {"x": inputs}))
    paths = [str(tmp_path / name) for name in ("fused.keras", "inputs.npz", "loaded.npy")]
    result = run_python(["-c", LOAD_WITHOUT_TFMP, *paths], cwd=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["tfmp"] == []
    bound = _tolerance("mixed_bfloat16", fused) * np.abs(predictions).max()
    np.testing.assert_allclose(np.load(paths[2]), predictions, rtol=0, atol=bound)


@pytest.mark.parametrize("policy", [pytest.param("float32", marks=pytest.mark.slow), "mixed_bfloat16"])
def test_cached_decoding_through_the_fused_core_equals_keras(policy):
    """A TransformerDecoder decoding token by token with its key/value cache (keras-hub's
    generation path: CachedMultiHeadAttention's cached keys and values go through the replaced
    _compute_attention) gives Keras' outputs within the dtype's rounding per fused layer."""
    keras.utils.set_random_seed(0)
    decoder = keras_hub.layers.TransformerDecoder(2 * WIDTH, HEADS, dropout=0.0, dtype=policy, name="decoder")
    sequence = tf.random.normal((2, TOKENS // 2, WIDTH))
    model = keras.Sequential([keras.Input(sequence.shape[1:]), decoder], name="model")

    def decode():
        cache, outputs = tf.zeros((2, 2, TOKENS // 2, HEADS, WIDTH // HEADS)), []
        for index in range(TOKENS // 2):
            output, cache = decoder(
                sequence[:, index : index + 1],
                self_attention_cache=cache,
                self_attention_cache_update_index=index,
            )
            outputs.append(np.asarray(output, np.float64))
        return np.concatenate(outputs, axis=1)

    reference = decode()
    fused = fuse_normalization(model).fused
    assert fused == (
        "model/decoder/self_attention",
        "model/decoder/self_attention_layer_norm",
        "model/decoder/feedforward_layer_norm",
    )
    bound = _tolerance(policy, len(fused)) * np.abs(reference).max()
    np.testing.assert_allclose(decode(), reference, rtol=0, atol=bound)


WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "brown", "fox", "lazy", "dog", "jumps"]


def text_classifier() -> keras.Model:
    """keras-hub's main workflow: a BertTextClassifier with its preprocessor (a tokenizer of its
    own vocabulary), trained on raw strings; seeded weights, no dropout."""
    keras.utils.set_random_seed(1)
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=WORDS)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=TOKENS)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(WORDS),
        num_layers=1,
        num_heads=HEADS,
        hidden_dim=WIDTH,
        intermediate_dim=2 * WIDTH,
        max_sequence_length=TOKENS,
        dropout=0.0,
    )
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, dropout=0.0
    )
    return _compiled(model)


def image_classifier() -> keras.Model:
    """A ViTImageClassifier whose preprocessor resizes and rescales raw 8-bit images of another size."""
    keras.utils.set_random_seed(1)
    converter = keras_hub.layers.ViTImageConverter(image_size=(IMAGE, IMAGE), scale=1 / 255.0)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(IMAGE, IMAGE, 3),
        patch_size=PATCH,
        num_layers=1,
        num_heads=HEADS,
        hidden_dim=WIDTH,
        mlp_dim=WIDTH,
    )
    model = keras_hub.models.ViTImageClassifier(
        backbone, CLASSES, preprocessor=keras_hub.models.ViTImageClassifierPreprocessor(converter)
    )
    return _compiled(model)


def _compiled(task: keras.Model) -> keras.Model:
    task.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return task


def _raw_data(kind: str):
    rng = np.random.default_rng(0)
    if kind == "text":
        texts = [" ".join(rng.choice(WORDS[5:], 4)) for _ in range(32)]
        return texts, np.array([int("fox" in text) for text in texts])
    images = rng.integers(0, 256, size=(32, 24, 24, 3)).astype("uint8")
    return images, (images[..., 0].mean(axis=(1, 2)) // 86).astype("int32")


@pytest.mark.slow  # 10-15 s each: keras-hub's own fit, then tfmp's, twice over
@pytest.mark.parametrize(
    "kind, given",
    [("text", "list"), ("text", "tf_data"), ("image", "array")],
    ids=["strings", "dataset", "images"],
)
def test_a_task_that_preprocesses_in_its_own_fit_trains_through_tfmp_fit_as_there(kind, given):
    """keras-hub's tasks (PipelineModel) map their preprocessor over the data in their own fit,
    evaluate and predict; tfmp.fit, evaluate and predict do the same: History, weights, results
    and predictions equal keras-hub's own."""
    build = text_classifier if kind == "text" else image_classifier
    x, y = _raw_data(kind)
    ours, theirs = build(), build()
    ours.set_weights(theirs.get_weights())
    if given == "tf_data":
        arguments = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    else:
        arguments = dict(x=x, y=y, batch_size=8, validation_data=(x[:16], y[:16]))
    expected = theirs.fit(**arguments, epochs=2, shuffle=False, verbose=0)
    history = tfmp.fit(ours, **arguments, epochs=2, shuffle=False, verbose=0)
    assert history.history.keys() == expected.history.keys()
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    for mine, their in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(mine, their, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        tfmp.evaluate(ours, x, y, batch_size=8, verbose=0),
        theirs.evaluate(x, y, batch_size=8, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        tfmp.predict(ours, x[:5], verbose=0), theirs.predict(x[:5], verbose=0), rtol=1e-5, atol=1e-6
    )
