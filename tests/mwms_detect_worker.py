"""The detection cells of the shared multi-worker group (tests/mwms_worker.py) for
tests/test_detect_app.py: the tiny RetinaNet, every precision with XLA off and on, 2 steps each
through the engine; prints one JSON line per cell with the loss, finiteness and a digest of
every model and optimizer variable for the test to compare across workers.

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
    retinanet,  # noqa: E402
)
from tfmp.detection.task import compile_detector  # noqa: E402
from tfmp.distribute import strategies as distribute
from tfmp.training.engine import Engine  # noqa: E402

SIZE, GLOBAL_BATCH, STEPS = 64, 4, 2


def main():
    detection_cells(distribute.get_strategy("multi_worker"))


def detection_cells(strategy):
    anchors = boxes.generate_anchors(SIZE, retinanet.anchor_config("retinanet_tiny"))
    train = strategy.distribute_datasets_from_function(
        lambda context: data.load(
            "shapes", "train", GLOBAL_BATCH, anchors=anchors, image_size=SIZE, input_context=context
        )[0]
    )
    for policy in precision.POLICIES:
        for xla in (False, True):
            started = time.process_time()
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = retinanet.build_detector("retinanet_tiny", SIZE, 6, dtype=policy)
                optimizer = precision.wrap_optimizer(
                    keras.optimizers.SGD(0.01, momentum=0.9), policy, initial_scale=1024.0
                )
            compile_detector(model, optimizer, strategy, int(anchors.shape[0]))
            result = Engine(strategy, model, optimizer, xla=xla).train(iter(train), STEPS)
            weights = np.concatenate([w.numpy().ravel() for w in model.trainable_weights])
            print(
                json.dumps(
                    {
                        "kind": "detect",
                        "policy": policy,
                        "xla": xla,
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
