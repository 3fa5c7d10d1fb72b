"""Small convolutional image classifiers, plus the input/head helpers every tfmp model shares.

Provides:

* `seed_cnn` - the CNN from the TensorFlow mixed-precision article (three conv+pool stages of
  32/64/128 filters, a 128-unit dense layer, softmax). Written for 224x224x3 inputs, works for
  anything from 8x8 up.
* `lenet` - the `Net` of the PyTorch model-parallelism article (LeNet-style, 20/50 filters of 5x5,
  500-unit dense layer). Written for 28x28x1 MNIST digits, needs at least 16x16.
* `image_input`, `classifier_head` and `functional_model`, shared by the other model modules.

Usage (normally through the registry, `tfmp.models.build("lenet", (28, 28, 1), 10)`):

    from tfmp.models.cnn import seed_cnn
    model = seed_cnn((224, 224, 3), 10, dtype="mixed_float16")

`dtype` is a Keras dtype-policy name ("float32", "mixed_float16", "mixed_bfloat16") or None for
the current global policy. It is handed to every layer explicitly, except the classifier head,
which always computes in float32 so the softmax and the loss never see float16 rounding.
"""

from __future__ import annotations

import keras

from tfmp.errors import UsageError


def image_input(input_shape: tuple[int, ...], name: str, min_size: int = 1) -> keras.KerasTensor:
    """Check that `input_shape` is (height, width, channels) of at least `min_size` pixels per
    side and return the float32 `keras.Input` for it, named `f"{name}_images"`."""
    input_shape = tuple(input_shape)
    if len(input_shape) != 3 or any(not isinstance(size, int) or size < 1 for size in input_shape):
        raise UsageError(
            f"model {name!r} needs an image input shape (height, width, channels) of positive "
            f"integers, got {input_shape}"
        )
    height, width, _ = input_shape
    if height < min_size or width < min_size:
        raise UsageError(
            f"model {name!r} needs images of at least {min_size}x{min_size} pixels, got {height}x{width}"
        )
    # Images arrive as float32 in [0, 1]; the first layer casts them to its compute dtype.
    return keras.Input(shape=input_shape, dtype="float32", name=f"{name}_images")


def classifier_head(
    features: keras.KerasTensor,
    num_classes: int,
    name: str,
    kernel_regularizer: keras.regularizers.Regularizer | None = None,
    kernel_initializer: str = "glorot_uniform",
) -> keras.KerasTensor:
    """Float32 `Dense(num_classes)` logits (`{name}_logits`) and softmax (`{name}_probs`).

    The head ignores the model's policy on purpose: under mixed precision, logits and softmax in
    float16 lose small probabilities and can overflow, so the last two layers run in float32.
    """
    if not isinstance(num_classes, int) or num_classes < 2:
        raise UsageError(f"model {name!r} needs num_classes >= 2 for a softmax, got {num_classes!r}")
    logits = keras.layers.Dense(
        num_classes,
        kernel_regularizer=kernel_regularizer,
        kernel_initializer=kernel_initializer,
        dtype="float32",
        name=f"{name}_logits",
    )(features)
    return keras.layers.Activation("softmax", dtype="float32", name=f"{name}_probs")(logits)


def functional_model(
    inputs: keras.KerasTensor, outputs: keras.KerasTensor, name: str, dtype: str | None
) -> keras.Model:
    """`keras.Model(inputs, outputs, name=name)` whose own `dtype_policy` is `dtype`.

    Keras 3 functional models drop a `dtype=` argument and take the global policy instead, and
    `Model.compile` only wraps the optimizer in a LossScaleOptimizer when the *model's* policy
    is mixed_float16. Setting it here keeps automatic loss scaling working for a model built
    with an explicit policy. (Like any model attribute that is not a layer, it is not part of
    `get_config`, so a model rebuilt from its config has the global policy again.)
    """
    model = keras.Model(inputs, outputs, name=name)
    if dtype is not None:
        model.dtype_policy = dtype
    return model


def seed_cnn(
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    name: str = "seed_cnn",
) -> keras.Model:
    """The mixed-precision article's CNN: 3x(Conv 3x3 relu + MaxPool 2x2), Dense 128, softmax.

    "same" padding keeps every conv size-preserving, so only the three poolings shrink the
    image; 8x8 is the smallest input that still leaves a 1x1 map after them.
    """
    images = image_input(input_shape, name, min_size=8)
    features = images
    for stage, filters in enumerate((32, 64, 128), start=1):
        features = keras.layers.Conv2D(
            filters, 3, padding="same", activation="relu", dtype=dtype, name=f"{name}_conv{stage}"
        )(features)
        features = keras.layers.MaxPooling2D(2, dtype=dtype, name=f"{name}_pool{stage}")(features)
    features = keras.layers.Flatten(dtype=dtype, name=f"{name}_flatten")(features)
    features = keras.layers.Dense(128, activation="relu", dtype=dtype, name=f"{name}_dense")(features)
    return functional_model(images, classifier_head(features, num_classes, name), name, dtype)


def lenet(
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    name: str = "lenet",
) -> keras.Model:
    """The parallelism article's `Net`: Conv 20@5x5, pool, Conv 50@5x5, pool, Dense 500, softmax.

    Valid padding as in the PyTorch original (28x28 -> 24 -> 12 -> 8 -> 4, so 4*4*50 = 800
    features). Each side must be at least 16 pixels for the second pooling to see a 2x2 map.
    """
    images = image_input(input_shape, name, min_size=16)
    features = keras.layers.Conv2D(20, 5, activation="relu", dtype=dtype, name=f"{name}_conv1")(images)
    features = keras.layers.MaxPooling2D(2, dtype=dtype, name=f"{name}_pool1")(features)
    features = keras.layers.Conv2D(50, 5, activation="relu", dtype=dtype, name=f"{name}_conv2")(features)
    features = keras.layers.MaxPooling2D(2, dtype=dtype, name=f"{name}_pool2")(features)
    features = keras.layers.Flatten(dtype=dtype, name=f"{name}_flatten")(features)
    features = keras.layers.Dense(500, activation="relu", dtype=dtype, name=f"{name}_dense")(features)
    return functional_model(images, classifier_head(features, num_classes, name), name, dtype)
