"""The parallelism article's example: an MNIST MLP trained data-parallel with MirroredStrategy.

    python -m apps.mnist                                   # built-in digits, all local devices
    python -m apps.mnist --dataset=tfds:mnist --data_dir=~/tensorflow_datasets
    python -m apps.mnist --flagfile=configs/mnist_two_replicas.cfg

By default every local GPU is a replica; without GPUs the CPU is split into one logical device
per core, so the same MirroredStrategy code runs (and is tested) anywhere. Started by the
launcher (`python -m tfmp.launch --workers=2 -- python -m apps.mnist`, a TF_CONFIG of several
tasks) it trains multi-worker instead, with no extra flags. The model is evaluated on the
validation split after every epoch.
"""

import os

import tensorflow as tf
from absl import flags

from apps import cli, common
from tfmp.classification.task import TASK
from tfmp.distribute.cluster import parse_tf_config
from tfmp.training.run import train_and_evaluate

FLAGS = flags.FLAGS
FLAGS.set_default("model", "mnist_mlp")
FLAGS.set_default("dataset", "digits")
FLAGS.set_default("strategy", "mirrored")
FLAGS.set_default("global_batch_size", 128)


def main(argv):
    del argv
    cpu_replicas, strategy = FLAGS.cpu_replicas, FLAGS.strategy
    cluster = parse_tf_config(os.environ.get("TF_CONFIG"))
    if not FLAGS["strategy"].present and cluster is not None and cluster.num_workers > 1:
        strategy = "multi_worker"  # the default MirroredStrategy would train each worker alone
    if not FLAGS["strategy"].present and FLAGS.pipeline_stages > 1:
        strategy = "auto"  # the pipeline's stages take the devices replicas would use
    if (
        strategy == "mirrored"
        and not FLAGS["cpu_replicas"].present
        and not tf.config.list_physical_devices("GPU")
    ):
        # One logical device per core, as many as split the global batch evenly.
        cpu_replicas = max(n for n in range(1, (os.cpu_count() or 1) + 1) if FLAGS.global_batch_size % n == 0)
    config = common.config_from_flags(cpu_replicas=cpu_replicas, strategy=strategy)
    train_and_evaluate(config, TASK, resolved_flags=common.resolved_flags("mnist", config))


if __name__ == "__main__":
    cli.run(main)
