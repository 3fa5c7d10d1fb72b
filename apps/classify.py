"""Train an image classifier with mixed precision on one CPU, many GPUs or many hosts.

    python -m apps.classify --mixed                        # built-in shapes, offline, ~1 min on 2 cores
    python -m apps.classify --model=resnet20 --dataset=tfds:cifar10 --data_dir=~/tensorflow_datasets
    python -m apps.classify --strategy=mirrored --cpu_replicas=2   # data-parallel without GPUs
    python -m apps.classify --flagfile=configs/article_cnn_224_mixed.cfg

Defaults: the article's CNN (`seed_cnn`) on the built-in `shapes` dataset at 32x32, 3 epochs.
Ends with one summary line: eval accuracy, examples/s, precision, replicas.
"""

from absl import flags

from apps import cli, common
from tfmp.classification.task import TASK
from tfmp.training.run import train_and_evaluate

flags.FLAGS.set_default("image_size", 32)


def main(argv):
    del argv
    config = common.config_from_flags()
    train_and_evaluate(config, TASK, resolved_flags=common.resolved_flags("classify", config))


if __name__ == "__main__":
    cli.run(main)
