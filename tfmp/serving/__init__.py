"""Serving: export a trained model and predict with any artifact.

    layers       the Keras layer an exported .keras holds (FoldedBatchNorm)
    artifacts    which artifact a path holds (run dir, export, SavedModel, file), its kind, export.json checked
    predictors   load a run dir, an export, a SavedModel, a .tflite or a .keras; preprocess; predict
    trust        a SavedModel is a program: run only what apps.export wrote (export.json's digest)
    copies       the inference copy: one precision, BatchNorm folded
    export       SavedModel / TFLite / .keras writers, export.json and its difference table
    classifier   the "classifier" model kind (probabilities; top-k for apps.predict)
    detector     the "detector" model kind (NMS in the SavedModel, raw outputs in TFLite)
    two_stage    the "two_stage_detector" kind (Faster R-CNN: its own NMS in the SavedModel, no TFLite)

Imports run one way: trust, copies <- artifacts; artifacts, layers <- predictors <- export <-
classifier, detector <- two_stage (copies between layers and export). `export.KINDS` and
`artifacts.KINDS` map a model kind to what is specific to it; the module that knows a kind
registers it. This package imports every such module, so any `from tfmp.serving import export`
finds every kind registered (as torchvision's `models/__init__.py` imports every builder so
each registers itself).
"""

# Each registers its kind in export.KINDS and artifacts.KINDS; the classifier first.
from tfmp.serving import (  # noqa: F401
    classifier,
    detector,
    two_stage,
)
