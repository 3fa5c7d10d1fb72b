"""tfmp: mixed-precision and data-parallel Keras 3 training on TensorFlow that just works.

    import tfmp
    history = tfmp.fit(model, dataset, epochs=3)     # any compiled Keras model, any strategy
    tfmp.evaluate(model, eval_dataset)               # model.evaluate's return; tfmp.predict likewise
    tfmp.fuse_normalization(model)                   # Batch/GroupNormalization on fused kernels

`fit`, `evaluate`, `predict` and `fuse_normalization` are loaded on first use, so `python -m tfmp.launch`
starts without importing TensorFlow.
"""

__all__ = ["fit", "evaluate", "predict", "fuse_normalization"]


def __getattr__(name):
    # Imported on first use, not at the top: the launcher imports tfmp without TensorFlow.
    if name == "fuse_normalization":
        from tfmp.precision import fused_norm

        return fused_norm.fuse_normalization
    if name == "fit":
        from tfmp.training import fitting

        return fitting.fit
    if name in ("evaluate", "predict"):
        from tfmp.training import evaluating

        return getattr(evaluating, name)
    raise AttributeError(f"module 'tfmp' has no attribute {name!r}")
