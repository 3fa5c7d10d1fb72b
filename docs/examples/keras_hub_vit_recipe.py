"""keras-hub's ViT through tfmp.fit: vit_tiny's recipe against keras-hub's own compile defaults.

    PYTHONPATH=. python docs/examples/keras_hub_vit_recipe.py                # both, the recipe's epochs each
    PYTHONPATH=. python docs/examples/keras_hub_vit_recipe.py --epochs=2     # a shorter comparison

Runs offline on a CPU: keras-hub's `ViTBackbone` at vit_tiny's sizes (4x4 patches of the built-in
32x32 shapes, 6 layers of width 192, 3 heads, MLP 768, class token) under a softmax
`ViTImageClassifier`, built from its constructor (no weights downloaded), trained twice from the
same seed on the same stream of the built-in `shapes` (augmented only if the recipe says so):

- keras-hub's defaults: `classifier.compile()` (Adam 5e-5, constant; sparse cross-entropy);
- vit_tiny's recipe (`tfmp.models.recipes`): `tfmp.optim.for_recipe(...)` (AdamW, warmup, cosine,
  weight decay 0.05 without norms, biases and tokens) and label smoothing 0.1.

Prints one line per run with its eval accuracy after the last epoch; docs/recipes.md has a run's
numbers with the CPU and date.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402
from absl import app, flags  # noqa: E402

import tfmp  # noqa: E402
from tfmp import optim  # noqa: E402
from tfmp.classification import data  # noqa: E402
from tfmp.classification.task import SmoothedSparseCrossentropy  # noqa: E402
from tfmp.models import recipes  # noqa: E402

flags.DEFINE_integer("epochs", recipes.VIT_TINY.values["epochs"], "Epochs of each run.")
flags.DEFINE_integer("global_batch_size", 64, "Batch of both runs.")
flags.DEFINE_integer("seed", 0, "Weights and data order of both runs.")
FLAGS = flags.FLAGS


def classifier(seed: int) -> keras.Model:
    """keras-hub's ViT at vit_tiny's sizes for 10 classes, softmax head in float32."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(32, 32, 3), patch_size=4, num_layers=6, num_heads=3, hidden_dim=192, mlp_dim=768
    )
    return keras_hub.models.ViTImageClassifier(backbone, 10, activation="softmax", head_dtype="float32")


def train(model: keras.Model, epochs: int, seed: int) -> float:
    steps_per_epoch = data.SHAPES_TRAIN_EXAMPLES // FLAGS.global_batch_size
    augment = bool(recipes.VIT_TINY.values.get("augment", False))
    train_stream, _ = data.load("shapes", "train", FLAGS.global_batch_size, augment=augment, seed=seed)
    # 50 divides the 2,000 eval examples: no padding rows, so every row counts.
    eval_stream, _ = data.load("shapes", "eval", 50, training=False)
    tfmp.fit(model, train_stream, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0, seed=seed)
    return float(model.evaluate(eval_stream, verbose=0, return_dict=True)["accuracy"])


def main(argv):
    del argv
    steps_per_epoch = data.SHAPES_TRAIN_EXAMPLES // FLAGS.global_batch_size
    defaults = classifier(FLAGS.seed)
    defaults.compile(metrics=["accuracy"])  # keras-hub's optimizer and loss, named like ours
    recipe = classifier(FLAGS.seed)
    optimizer = optim.for_recipe(
        recipes.VIT_TINY,
        recipe,
        global_batch_size=FLAGS.global_batch_size,
        steps_per_epoch=steps_per_epoch,
        epochs=FLAGS.epochs,
    )
    recipe.compile(optimizer, SmoothedSparseCrossentropy(0.1), metrics=["accuracy"])
    for name, model in (("keras-hub defaults", defaults), ("vit_tiny recipe", recipe)):
        accuracy = train(model, FLAGS.epochs, FLAGS.seed)
        print(f"{name:20s} eval accuracy {accuracy:.4f} after {FLAGS.epochs} epoch(s)", flush=True)


if __name__ == "__main__":
    sys.exit(app.run(main))
