"""Keras layers an exported model holds, registered for loading wherever a `.keras` export is read.

`tfmp.serving.copies` puts `FoldedBatchNorm` where it folded a BatchNormalization into the layer
before it; `tfmp.serving.predictors` imports this module so an exported `model.keras` loads in a
process that never exported anything:

    from tfmp.serving import layers  # registers "tfmp>FoldedBatchNorm" with Keras
    keras.saving.load_model("runs/x/export/bfloat16/model.keras", compile=False)
"""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="tfmp")
class FoldedBatchNorm(keras.layers.Layer):
    """Stands where a folded BatchNormalization stood: passes its input through. (Keras'
    Identity layer does not accept the `mask` argument the functional graph replays.)"""

    def call(self, inputs, mask=None, training=None):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape
