"""The detection cells of the shared multi-worker group (tests/mwms_worker.py): the tiny
RetinaNet (tests/test_detect_app.py, 2 steps) and the tiny Faster R-CNN (tests/test_faster_rcnn.py,
1 step: its XLA cells compile the most), every precision with XLA off and on, through the engine;
prints one JSON line per cell with the loss, finiteness and a digest of every model and optimizer
variable for the tests to compare across workers.

    python -m tfmp.launch --workers=2 -- python tests/mwms_detect_worker.py   (these cells alone)
"""

import hashlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmp import precision  # noqa: E402
from tfmp.detection import (  # noqa: E402
    boxes,
    data,
    faster_rcnn,
    rcnn_losses,
    rcnn_task,
    retinanet,
)
from tfmp.detection.task import compile_detector  # noqa: E402
from tfmp.distribute import strategies as distribute  # noqa: E402
from tfmp.training.engine import Engine  # noqa: E402

SIZE, GLOBAL_BATCH, CLASSES = 64, 4, 6
RETINANET_STEPS, FASTER_RCNN_STEPS = 2, 1
HEAD_DEPTH = 1  # as tests/test_detect_app.py: one conv + GroupNorm per subnet compiles faster


def main():
    detection_cells(distribute.get_strategy("multi_worker"))


def detection_cells(strategy):
    """RetinaNet's cells (kind "detect"), then Faster R-CNN's (kind "faster_rcnn")."""
    anchors = boxes.generate_anchors(SIZE, retinanet.anchor_config("retinanet_tiny"))
    retinanet_batches = strategy.distribute_datasets_from_function(
        lambda context: data.load(
            "shapes", "train", GLOBAL_BATCH, anchors=anchors, image_size=SIZE, input_context=context
        )[0]
    )

    def build_retinanet(policy, optimizer):
        model = retinanet.build_detector("retinanet_tiny", SIZE, CLASSES, dtype=policy, head_depth=HEAD_DEPTH)
        compile_detector(model, optimizer, strategy, int(anchors.shape[0]))
        return model

    rcnn_batches = strategy.distribute_datasets_from_function(
        lambda context: rcnn_task.model_elements(
            data.load("shapes", "train", GLOBAL_BATCH, image_size=SIZE, input_context=context, augment=True)[
                0
            ]
        )
    )

    def build_faster_rcnn(policy, optimizer):
        model = faster_rcnn.build_detector("faster_rcnn_tiny", SIZE, CLASSES, dtype=policy)
        model.compile(optimizer=optimizer, loss=rcnn_losses.FasterRCNNLoss("focal"))
        return model

    for kind, build, batches, steps in (
        ("detect", build_retinanet, retinanet_batches, RETINANET_STEPS),
        ("faster_rcnn", build_faster_rcnn, rcnn_batches, FASTER_RCNN_STEPS),
    ):
        for policy in precision.POLICIES:
            for xla in (False, True):
                _cell(strategy, kind, build, batches, steps, policy, xla)


def _cell(strategy, kind, build, batches, steps, policy, xla):
    """Trains one model `steps` steps from seed 0 and prints the cell's JSON line."""
    started = time.process_time()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        optimizer = precision.wrap_optimizer(
            keras.optimizers.SGD(0.01, momentum=0.9), policy, initial_scale=1024.0
        )
        model = build(policy, optimizer)
    engine = Engine(strategy, model, optimizer, xla=xla)
    result = engine.train(iter(batches), steps)
    weights = np.concatenate([w.numpy().ravel() for w in model.trainable_weights])
    print(
        json.dumps(
            {
                "kind": kind,
                "policy": policy,
                "xla": xla,
                "xla_parts": engine.xla_parts,
                "replicas": strategy.num_replicas_in_sync,
                "loss": result.metrics["loss"],
                "nonfinite": result.nonfinite_steps,
                "float32": all(w.dtype == "float32" for w in model.trainable_weights),
                "finite": bool(np.isfinite(weights).all()),
                "checksum": _variables_digest(model, optimizer),
                "cpu_seconds": round(time.process_time() - started, 1),  # for speed work
            }
        ),
        flush=True,
    )


def _variables_digest(model, optimizer):
    """Digest of every model and optimizer variable (weights, BatchNorm statistics, iterations,
    loss scale, momentum slots): equal digests mean the workers' replicas ended identical."""
    digest = hashlib.sha256()
    for variable in model.variables + optimizer.variables:
        digest.update(variable.path.encode())
        digest.update(np.asarray(variable.numpy()).tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    main()
