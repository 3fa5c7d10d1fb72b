"""A multilayer perceptron for MNIST-sized inputs.

Provides:

* `mnist_mlp` - the model of the PyTorch/TensorFlow parallelism article: Flatten, Dense 512 relu,
  Dropout 0.2, Dense num_classes, softmax.
* `mlp` - the same shape with configurable hidden layers and dropout rate.

Both accept any input shape, flat vectors or images such as (28, 28, 1), and flatten inside the
model so the same data pipeline feeds them and the CNNs.

Usage (normally through the registry, `tfmp.models.build("mnist_mlp", (28, 28, 1), 10)`):

    from tfmp.models.mlp import mnist_mlp
    model = mnist_mlp((28, 28, 1), 10, dtype="mixed_bfloat16")

`dtype` is a Keras dtype-policy name or None for the current global policy; the classifier head
always computes in float32 (see `tfmp.models.cnn.classifier_head`).
"""

from __future__ import annotations

import keras

from tfmp.errors import UsageError
from tfmp.models.cnn import classifier_head, functional_model


def mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    name: str = "mlp",
    *,
    hidden_units: tuple[int, ...] = (512,),
    dropout_rate: float = 0.2,
) -> keras.Model:
    """Flatten, then per entry of `hidden_units` a relu Dense layer followed by Dropout, then the
    float32 Dense(num_classes) + softmax head. Layers are `{name}_dense{i}`/`{name}_dropout{i}`."""
    input_shape = tuple(input_shape)
    if not input_shape or any(not isinstance(size, int) or size < 1 for size in input_shape):
        raise UsageError(f"model {name!r} needs an input shape of positive integers, got {input_shape}")
    if not 0.0 <= dropout_rate < 1.0:
        raise UsageError(f"model {name!r} needs 0 <= dropout_rate < 1, got {dropout_rate}")
    inputs = keras.Input(shape=input_shape, dtype="float32", name=f"{name}_images")
    features = keras.layers.Flatten(dtype=dtype, name=f"{name}_flatten")(inputs)
    for index, units in enumerate(hidden_units, start=1):
        features = keras.layers.Dense(units, activation="relu", dtype=dtype, name=f"{name}_dense{index}")(
            features
        )
        # A rate of 0 would add a layer that does nothing but still shows up in summaries.
        if dropout_rate:
            features = keras.layers.Dropout(dropout_rate, dtype=dtype, name=f"{name}_dropout{index}")(
                features
            )
    return functional_model(inputs, classifier_head(features, num_classes, name), name, dtype)


def mnist_mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    name: str = "mnist_mlp",
) -> keras.Model:
    """The article's model: Flatten -> Dense 512 relu -> Dropout 0.2 -> float32 head.

    With (28, 28, 1) inputs and 10 classes that is 784*512+512 + 512*10+10 = 407,050 parameters.
    """
    return mlp(input_shape, num_classes, dtype, name, hidden_units=(512,), dropout_rate=0.2)
