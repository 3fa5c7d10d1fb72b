"""Every input `keras.Model.fit` takes, as the global batches `tfmp.fit` distributes.

    train = fit_inputs.of(x, y, sample_weight, batch_size, shuffle, seed, class_weight, "training data")
    train.stream(position)        # an endless tf.data.Dataset of (x, y[, sample_weight]) from batch `position`

Kinds, with Keras 3.15's meaning (keras/src/trainers/data_adapters):

- arrays: NumPy arrays, tensors, and dicts, lists and tuples of them for several inputs and
  outputs; `batch_size` defaults to 32, the last batch may be short, `shuffle=True` reshuffles
  every pass. tfmp seeds pass p's order with `seed + p`, so a resumed run reads the batches the
  interrupted one would have;
- a `tf.data.Dataset` of batches `(x, y[, sample_weight])`: `y` and `sample_weight` must be
  None, `batch_size` and `shuffle` are ignored (the dataset batches and shuffles itself);
- a `keras.utils.PyDataset` and a Python generator, read through Keras' own adapters (workers,
  multiprocessing, `on_epoch_end`, `shuffle` of a PyDataset's batch order: as in `model.fit`).
  Both run in this process only: under several workers each would read everything, so they are
  refused there with the conversion to make.

`class_weight` becomes each example's sample weight, as Keras' `make_class_weight_map_fn` does:
a single output, class ids (sparse labels, or the argmax of one-hot ones), classes not named get
1.0; with sample weights already in the data it is refused.

`stream(position)` is how epochs read the data: one pass after another (`steps_per_epoch` shorter
than the data continues where the last epoch stopped, as Keras does), starting at global batch
`position` of the endless sequence, so a resume starts where the checkpoint was taken.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfmp import compat
from tfmp.errors import UsageError

KERAS_DEFAULT_BATCH_SIZE = 32


class FitData:
    """A user's data as global batches: `dataset(pass)` is one pass (endless for an endless
    source), `stream(position)` every pass from global batch `position` on."""

    def __init__(
        self,
        make: Callable[[object], tf.data.Dataset],
        what: str,
        kind: str,
        sample: tuple | None = None,
        repeatable: bool = True,
        global_batch_size: int | None = None,
    ):
        self.what, self.kind = what, kind
        self._make, self.repeatable = make, repeatable
        self.epoch_ended = lambda: None  # called at each epoch's end (a PyDataset's on_epoch_end)
        first_pass = make(0)
        self.element_spec = first_pass.element_spec
        cardinality = int(first_pass.cardinality())
        self.batches = cardinality if cardinality >= 0 else None  # None: infinite or unknown
        self.infinite = cardinality == tf.data.INFINITE_CARDINALITY
        if sample is not None:
            self._sample = sample  # arrays: every label is checked
        self.global_batch_size = global_batch_size or self._first_batch_rows()

    def sample(self) -> tuple | None:
        """(x, y, sample_weight) to check: all of an array input, a dataset's first batch."""
        if not hasattr(self, "_sample"):
            first = next(iter(self._make(0).take(1)), None)
            self._sample = None if first is None else x_y_weight(first)
        return self._sample

    def _first_batch_rows(self) -> int:
        first = self.sample()
        if first is None:
            raise UsageError(f"{self.what}: the data are empty")
        return int(tf.shape(tf.nest.flatten(first[0])[0])[0])

    def dataset(self, pass_index: int = 0) -> tf.data.Dataset:
        return self._make(pass_index)

    def stream(self, position: int) -> tf.data.Dataset:
        """Global batches from `position` on: the rest of its pass, then pass after pass."""
        if self.infinite or not self.batches or not self.repeatable:
            return self._make(0).skip(position) if position else self._make(0)
        first_pass, offset = divmod(position, self.batches)
        later = tf.data.Dataset.range(first_pass + 1, np.iinfo(np.int64).max).flat_map(self._make)
        return self._make(first_pass).skip(offset).concatenate(later)


def x_y_weight(element) -> tuple:
    """(x, y, sample_weight) of a Keras element (tfmp's padded eval 4-tuple: its first three)."""
    if isinstance(element, (list, tuple)):
        return (tuple(element) + (None, None))[:3] if len(element) > 1 else (element[0], None, None)
    return element, None, None


def is_stream(x) -> bool:
    """Whether `x` yields its own batches (x, y[, sample_weight]): a `tf.data.Dataset`, a
    `keras.utils.PyDataset` or a Python generator, rather than arrays for tfmp to batch."""
    return isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or inspect.isgenerator(x)


def preprocessor(model: keras.Model) -> Callable | None:
    """A model's `preprocess_samples(x, y, sample_weight)` when it preprocesses in its own `fit`
    (keras-hub's tasks, `PipelineModel`: tokenizers, image and audio converters), else None."""
    preprocess = getattr(model, "preprocess_samples", None)
    return preprocess if callable(preprocess) else None


def of(
    x, y, sample_weight, batch_size, shuffle, seed, class_weight, what, preprocess: Callable | None = None
) -> FitData:
    """The `FitData` of `model.fit`-style arguments (see the module docstring); `preprocess`
    (from `preprocessor`) maps every batch, before class weights, as keras-hub's `fit` does."""
    if isinstance(x, tf.data.Dataset):
        _no_separate("a tf.data.Dataset", what, y=y, sample_weight=sample_weight)
        data = FitData(lambda pass_index: x, what, "dataset")
    elif is_stream(x):
        kind = "PyDataset" if isinstance(x, keras.utils.PyDataset) else "generator"
        _no_separate(f"a {kind}", what, y=y, sample_weight=sample_weight)
        data = _python_data(x, kind, shuffle, what)
    elif x is None:
        raise UsageError(f"{what}: x is None; pass arrays, a tf.data.Dataset, a PyDataset or a generator")
    else:
        data = _arrays(x, y, sample_weight, batch_size, shuffle, seed, what)
    data = with_preprocessing(data, preprocess) if preprocess else data
    return with_class_weight(data, class_weight) if class_weight else data


def _no_separate(kind: str, what: str, **arguments) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise UsageError(
                f"{what}: {name} must be None when x is {kind}: it yields (x, y[, sample_weight]) itself"
            )


def _python_data(x, kind: str, shuffle: bool, what: str) -> FitData:
    """A PyDataset or generator through Keras' adapter; a generator is read once."""
    try:
        adapter = compat.keras_data_adapter(x, shuffle=shuffle)
    except ValueError as error:
        raise UsageError(f"{what}: {str(error).splitlines()[0]}") from None
    dataset = adapter.get_tf_dataset()
    if adapter.num_batches is not None:
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(adapter.num_batches))
    data = FitData(lambda pass_index: dataset, what, kind, repeatable=kind == "PyDataset")
    data.epoch_ended = adapter.on_epoch_end  # the PyDataset's on_epoch_end, as model.fit calls it
    return data


def _as_tuples(structure):
    """Lists become tuples (tf.data reads a list as one tensor to stack: several inputs or outputs
    given as a list of differently shaped arrays would fail), but a list of strings is one array
    of them (raw text for a model that preprocesses, as keras-hub reads it)."""
    if (
        isinstance(structure, list)
        and structure
        and all(isinstance(item, (str, bytes)) for item in structure)
    ):
        return np.asarray(structure)
    if isinstance(structure, dict):
        return {key: _as_tuples(value) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        return tuple(_as_tuples(item) for item in structure)
    return structure


def _as_array(leaf):
    """An array-like as NumPy or a tensor, floats in Keras' floatx (float32): Keras' arrays adapter
    casts float64 (and float16) inputs the same way."""
    if not isinstance(leaf, tf.Tensor):
        leaf = np.asarray(leaf)
    dtype = tf.as_dtype(leaf.dtype)
    if dtype.is_floating and dtype.name != keras.config.floatx():
        leaf = (
            tf.cast(leaf, keras.config.floatx())
            if isinstance(leaf, tf.Tensor)
            else leaf.astype(keras.config.floatx())
        )
    return leaf


def _arrays(x, y, sample_weight, batch_size, shuffle, seed, what) -> FitData:
    batch_size = KERAS_DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if batch_size < 1:
        raise UsageError(f"{what}: batch_size={batch_size} must be positive")
    arrays = tuple(
        tf.nest.map_structure(_as_array, _as_tuples(item))
        for item in (x, y, sample_weight)
        if item is not None
    )
    lengths = {int(np.shape(leaf)[0]) if np.ndim(leaf) else 0 for leaf in tf.nest.flatten(arrays)}
    if len(lengths) != 1:
        raise UsageError(
            f"{what}: x, y and sample_weight have different numbers of examples {sorted(lengths)}; "
            "give every array the same first dimension"
        )
    size = lengths.pop()
    if size == 0:
        raise UsageError(f"{what}: the arrays hold no examples")
    # x alone is the element (x,), as Keras' array adapter packs it for a step that unpacks it.
    tensors = tf.nest.map_structure(tf.convert_to_tensor, arrays)

    def make(pass_index):
        rows = tf.data.Dataset.range(size)
        if shuffle:
            # A permutation per pass from (seed, pass): pass p reads the same order in every run
            # and every worker, whether the pass index is a number or a tensor (flat_map).
            key = tf.stack([tf.cast(seed, tf.int64), tf.cast(pass_index, tf.int64)])
            rows = rows.map(lambda row: tf.random.experimental.index_shuffle(row, key, size - 1))
        return rows.batch(batch_size).map(
            lambda batch: tf.nest.map_structure(lambda t: tf.gather(t, batch), tensors)
        )

    return FitData(make, what, "arrays", sample=(x, y, sample_weight), global_batch_size=batch_size)


def validation_split(x, y, sample_weight, fraction: float) -> tuple[tuple, tuple]:
    """((x, y, sample_weight) to train on, the same for validation): the last `fraction` of the
    examples, taken before any shuffling, as Keras' `train_validation_split` does."""
    if not 0.0 < fraction < 1.0:
        raise UsageError(f"validation_split={fraction} must be between 0 and 1, e.g. 0.2")
    if is_stream(x):
        raise UsageError(
            f"validation_split={fraction} needs arrays, not {type(x).__name__} (as in Keras): "
            "pass validation_data= instead"
        )
    leaves = [leaf for leaf in tf.nest.flatten((x, y, sample_weight)) if leaf is not None]
    size = int(np.shape(leaves[0])[0])
    split_at = int(np.floor(size * (1.0 - fraction)))
    if split_at == 0 or split_at == size:
        raise UsageError(
            f"validation_split={fraction} of {size} examples leaves {split_at} to train and "
            f"{size - split_at} to validate; both need at least one"
        )
    arrays = _as_tuples((x, y, sample_weight))
    train = tf.nest.map_structure(lambda leaf: None if leaf is None else leaf[:split_at], arrays)
    validation = tf.nest.map_structure(lambda leaf: None if leaf is None else leaf[split_at:], arrays)
    return train, validation


def with_preprocessing(data: FitData, preprocess: Callable) -> FitData:
    """`data` whose batches went through `preprocess(x, y, sample_weight)` (see `preprocessor`)."""

    def preprocessed(*element):
        return preprocess(*x_y_weight(element))

    return FitData(
        lambda pass_index: data.dataset(pass_index).map(preprocessed, num_parallel_calls=tf.data.AUTOTUNE),
        data.what,
        data.kind,
        repeatable=data.repeatable,
        global_batch_size=data.global_batch_size,
    )


def with_class_weight(data: FitData, class_weight: dict) -> FitData:
    """`data` whose batches carry each example's class weight as its sample weight."""
    _, labels_spec, weight_spec = x_y_weight(data.element_spec)
    if not isinstance(class_weight, dict) or not class_weight:
        raise UsageError(f"class_weight must be a dict {{class id: weight}}, got {class_weight!r:.60}")
    if weight_spec is not None:
        raise UsageError(
            f"{data.what}: class_weight and sample weights at the same time (as Keras, refused): "
            "fold the class weights into the sample weights"
        )
    if labels_spec is None or not isinstance(labels_spec, tf.TensorSpec):
        raise UsageError(
            f"{data.what}: class_weight works for a model with a single output (as in Keras); "
            "pass sample weights per output instead"
        )
    if labels_spec.shape.rank is not None and labels_spec.shape.rank > 2:
        raise UsageError(
            f"{data.what}: class_weight works for labels of rank 1 or 2 (class ids or one-hot), "
            f"not rank {labels_spec.shape.rank} (as in Keras); pass sample_weight instead"
        )
    numbers = (int, float, np.integer, np.floating)
    if not all(isinstance(key, numbers) and float(key).is_integer() and key >= 0 for key in class_weight):
        raise UsageError(f"class_weight keys must be class ids 0, 1, ...; got {list(class_weight)!r:.80}")
    if not all(isinstance(value, numbers) and np.isfinite(value) for value in class_weight.values()):
        raise UsageError(
            f"class_weight values must be finite numbers; got {list(class_weight.values())!r:.80}"
        )
    table = tf.constant(
        [float(class_weight.get(index, 1.0)) for index in range(int(max(class_weight)) + 1)], tf.float32
    )

    def add_weights(*element):
        x, labels, _ = x_y_weight(element)
        if labels.shape.rank == 2:
            classes = tf.cond(
                tf.shape(labels)[-1] > 1,
                lambda: tf.argmax(labels, axis=-1, output_type=tf.int32),
                lambda: tf.cast(tf.round(tf.squeeze(labels, axis=-1)), tf.int32),
            )
        else:
            classes = tf.cast(tf.round(labels), tf.int32)
        # Classes past the largest key weigh 1.0, as Keras' `class_weight.get(c, 1.0)`.
        inside = classes < tf.size(table)
        weights = tf.where(inside, tf.gather(table, tf.minimum(classes, tf.size(table) - 1)), 1.0)
        return x, labels, weights

    return FitData(
        lambda pass_index: data.dataset(pass_index).map(add_weights),
        data.what,
        data.kind,
        sample=data.sample() if data.kind == "arrays" else None,
        repeatable=data.repeatable,
        global_batch_size=data.global_batch_size,
    )
