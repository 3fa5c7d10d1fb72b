"""tfmp: mixed-precision and data-parallel Keras 3 training on TensorFlow that just works.

    import tfmp
    history = tfmp.fit(model, dataset, epochs=3)     # any compiled Keras model, any strategy
    tfmp.evaluate(model, eval_dataset)

`fit` and `evaluate` are loaded on first use, so `python -m tfmp.launch` starts without
importing TensorFlow.
"""

__all__ = ["fit", "evaluate"]


def __getattr__(name):
    if name in __all__:
        from tfmp.training import fitting

        return getattr(fitting, name)
    raise AttributeError(f"module 'tfmp' has no attribute {name!r}")
