"""Image classification as a tfmp task: what `apps.classify` and `apps.mnist` train.

`tfmp.training.run.train_and_evaluate(config, TASK)` runs it; `TASK` implements the
`tfmp.training.task.Task` protocol: what is specific to classification is the model registry
(`tfmp.models`), the datasets (`tfmp.classification.data`), compiling a builder's model (float32
softmax head, sparse cross-entropy, accuracy) and the padded eval pipeline whose padding rows
count nowhere.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp import models
from tfmp.classification import data
from tfmp.training import fit_data


def _targets(y_true, y_pred):
    """Per-class targets: soft labels (Mixup/CutMix rows, rank 2) as they are, class ids one-hot."""
    if y_true.shape.rank == y_pred.shape.rank and y_true.shape[-1] != 1:
        return tf.cast(y_true, y_pred.dtype)
    classes = tf.shape(y_pred)[-1]
    return tf.one_hot(tf.cast(tf.reshape(y_true, [-1]), tf.int32), classes, dtype=y_pred.dtype)


@keras.saving.register_keras_serializable(package="tfmp")
class SmoothedSparseCrossentropy(keras.losses.Loss):
    """Cross-entropy of class ids against probabilities with label smoothing: the one-hot label
    becomes (1 - e) on its class plus e / classes everywhere (Szegedy et al. 2016; DeiT's 0.1).
    Keras' SparseCategoricalCrossentropy has no `label_smoothing` and its categorical one needs
    one-hot labels; this is the categorical one on the ids' one-hot rows. Soft labels (a row of
    class shares per example, as Mixup and CutMix make them) are taken as they are: smoothing a
    mix equals mixing the smoothed labels, as it is linear."""

    def __init__(self, label_smoothing: float, name: str = "smoothed_sparse_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        targets = _targets(y_true, y_pred)
        return keras.losses.categorical_crossentropy(targets, y_pred, label_smoothing=self.label_smoothing)

    def get_config(self) -> dict:
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


@keras.saving.register_keras_serializable(package="tfmp")
def class_accuracy(y_true, y_pred):
    """Accuracy for class ids and for soft labels (their largest share is the class): one metric
    for a Mixup/CutMix training stream and its plain eval stream."""
    targets = tf.argmax(_targets(y_true, y_pred), axis=-1)
    return tf.cast(tf.equal(targets, tf.argmax(y_pred, axis=-1)), tf.float32)


def compile_classifier(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    strategy: tf.distribute.Strategy,
    label_smoothing: float = 0.0,
    soft_labels: bool = False,
) -> keras.Model:
    """Compiles a tfmp classifier (float32 softmax head) as the apps train it, and builds its
    loss and metrics for (images, int labels) batches, or for (images, soft labels) ones with
    `soft_labels` (Mixup/CutMix: a float row of class shares per example; eval keeps int labels)."""
    with strategy.scope():
        # The builders end in float32 probabilities; Keras losses compute in float32 too.
        # Accuracy is a *weighted* metric so that padded eval rows (weight 0) count nowhere.
        # The optimizer has the loss scaling the run chose (precision.wrap_optimizer); Keras'
        # auto_scale_loss would wrap it again and clear a fixed --loss_scale.
        model.compile(
            optimizer=optimizer,
            loss=(
                SmoothedSparseCrossentropy(label_smoothing)
                if label_smoothing or soft_labels
                else keras.losses.SparseCategoricalCrossentropy()
            ),
            weighted_metrics=[
                keras.metrics.MeanMetricWrapper(class_accuracy, name="accuracy")
                if soft_labels
                else "accuracy"
            ],
            auto_scale_loss=False,
        )
    labels = (
        tf.TensorSpec((None, model.output_shape[-1]), tf.float32)
        if soft_labels
        else tf.TensorSpec((None,), tf.int32)
    )
    spec = (tf.TensorSpec((None, *model.input_shape[1:]), tf.float32), labels)
    fit_data.build_for_data(model, strategy, spec)
    return model


def _randaugment(config) -> tuple[int, float] | None:
    ops = config.data.randaugment_ops
    return (ops, config.data.randaugment_magnitude) if ops else None


def _mixing(config) -> dict | None:
    """Mixup/CutMix of each training batch; label smoothing stays the loss's (it applies to the
    mix alike), so the mixed rows hold plain class shares."""
    mixup, cutmix = config.data.mixup_alpha, config.data.cutmix_alpha
    return {"mixup_alpha": mixup, "cutmix_alpha": cutmix} if mixup or cutmix else None


class ClassificationTask:
    models = models.MODELS
    soft_labels = True  # its loss takes Mixup/CutMix's soft labels
    model_kind = "model"
    unit = "examples"

    def describe(self, config) -> data.DatasetInfo:
        return data.describe(
            config.data.dataset,
            image_size=config.data.image_size,
            data_dir=config.data.data_dir,
            max_image_pixels=config.data.max_image_pixels,
        )

    def build_model(self, config, plan) -> keras.Model:
        # Only a rate above 0 is passed: models without residual branches take no such option.
        options = {"stochastic_depth": config.stochastic_depth} if config.stochastic_depth else {}
        with plan.model_strategy.scope():
            return models.build(
                config.model, plan.info.image_shape, plan.info.num_classes, dtype=plan.policy, **options
            )

    def compile(self, model, optimizer, plan) -> keras.Model:
        return compile_classifier(
            model, optimizer, plan.strategy, plan.label_smoothing, soft_labels=plan.soft_labels
        )

    def train_dataset(self, config, plan, input_context=None, skip_examples: int = 0):
        """(endless training stream of (images, labels), shard policy); global batches without
        `input_context`, per-replica batches of this pipeline's shard with one."""
        return data.load(
            config.data.dataset,
            "train",
            config.data.global_batch_size,
            image_size=config.data.image_size,
            data_dir=config.data.data_dir,
            input_context=input_context,
            training=True,
            augment=config.data.augment,
            cache=config.data.cache,
            seed=config.seed,
            skip_examples=skip_examples,
            randaugment=_randaugment(config),
            mixing=_mixing(config),
        )

    def inputs(self, config, plan, engine, start_step: int):
        """The loop's data (one endless stream, positioned at `start_step`) and its evaluation."""
        shard_policies = []
        strategy = plan.strategy

        def train_input(input_context):
            # Resume: each input pipeline skips what it fed before the checkpoint.
            skip = start_step * config.data.global_batch_size // input_context.num_input_pipelines
            dataset, shard_policy = self.train_dataset(config, plan, input_context, skip)
            shard_policies.append(shard_policy)
            return data.with_threads(dataset, config.data.data_threads)

        def eval_input(input_context):
            dataset = data.load(
                config.data.dataset,
                "eval",
                config.data.global_batch_size,
                image_size=config.data.image_size,
                data_dir=config.data.data_dir,
                input_context=input_context,
                training=False,
                cache=config.data.cache,
            )[0]
            # Eval batches are padded to full size with label -1: padded rows weigh (and count) 0.
            dataset = dataset.map(
                lambda images, labels: (
                    images,
                    tf.maximum(labels, 0),
                    tf.cast(labels >= 0, tf.float32),
                    tf.cast(labels >= 0, tf.float32),
                )
            )
            return data.with_threads(dataset, config.data.data_threads)

        train_iterator = iter(strategy.distribute_datasets_from_function(train_input))
        eval_dataset = strategy.distribute_datasets_from_function(eval_input) if config.evaluate else None
        evaluate = (lambda: engine.evaluate(eval_dataset)) if eval_dataset is not None else None
        return (lambda epoch, steps_done: train_iterator), evaluate, shard_policies

    def card(self, config, plan, model) -> dict:
        info = plan.info
        return {
            "dataset": f"{config.data.dataset} {info.image_shape}, {info.num_classes} classes, "
            f"{info.train_examples} train / {info.eval_examples} eval",
            "head dtype": model.layers[-1].dtype_policy.compute_dtype,
            "output dtype": model.output.dtype,
            "loss": (
                "categorical cross-entropy of Mixup/CutMix soft labels"
                if plan.soft_labels
                else "sparse categorical cross-entropy"
            )
            + " on float32 probabilities"
            + (f", label smoothing {plan.label_smoothing:g}" if plan.label_smoothing else "")
            + ", metric accuracy",
        }

    def headline(self, last_eval: dict) -> tuple[dict, str]:
        accuracy = last_eval.get("accuracy")
        fields = {"eval_accuracy": accuracy, "eval_loss": last_eval.get("loss")}
        return fields, f"eval accuracy {accuracy:.4f}" if accuracy is not None else "eval accuracy n/a"


TASK = ClassificationTask()
