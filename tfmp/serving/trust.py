"""A SavedModel is a program: which ones `apps.predict` runs, and what export.json records for it.

    from tfmp.serving import trust
    trust.check("RUN/export/float32/saved_model", metadata, trusted=False)   # UsageError if unknown
    trust.graph_digest("RUN/export/float32/saved_model")                     # sha256 of saved_model.pb

Loading a SavedModel and calling its `serving_default` runs whatever TensorFlow ops its graph
holds (`tf.io.read_file`, `tf.io.write_file`, ...) with the caller's permissions: it is code, not
data. A `.keras` file loads in Keras' safe mode (`safe_mode=True`, the default: a Lambda layer's
bytecode is refused) and a `.tflite` runs built-in ops only; images and COCO JSON are data.

`tfmp.serving.export` records the SHA-256 of the SavedModel's graph file in export.json
(`saved_model_sha256`); `check` runs a SavedModel only when that record is there and matches,
unless the caller trusts it (`--trust_saved_model`). What the digest covers: `saved_model.pb`
holds every op the model can run (the graph, its functions, the object graph). `variables/`
holds tensor values that restore into those variables and can add no op (and TensorFlow checks
each tensor's crc32c as it reads it), so it is not hashed: that would read every weight on every
predict. `fingerprint.pb` is TensorFlow's own record written beside the graph: whoever can
replace the graph can replace it too.

What it does not prove: export.json is no signature. It catches a SavedModel apps.export did not
write (downloaded, hand-made, or an export whose graph was replaced afterwards), but a directory
made elsewhere with a matching export.json passes: take SavedModels only from sources you trust,
or serve the export's `model.keras`.
"""

from __future__ import annotations

import hashlib
import os

from tfmp import run_dir
from tfmp.errors import UsageError

GRAPH_FILE = "saved_model.pb"
RECORD_KEY = "saved_model_sha256"  # export.json's field: the digest of saved_model/saved_model.pb
FLAG = "--trust_saved_model"


def graph_digest(saved_model_dir: str) -> str:
    """Hex SHA-256 of `saved_model_dir/saved_model.pb` (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(os.path.join(saved_model_dir, GRAPH_FILE), "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def untrusted(saved_model_dir: str, metadata: dict | None) -> str | None:
    """Why the SavedModel in `saved_model_dir` is not one apps.export wrote (None: it is).
    `metadata`: the export.json beside it (its own directory's or its parent's), or None."""
    if metadata is None:
        return f"was not written by apps.export (no {run_dir.EXPORT_METADATA_FILE} beside it)"
    recorded = metadata.get(RECORD_KEY)
    if not isinstance(recorded, str):
        return (
            f"has an {run_dir.EXPORT_METADATA_FILE} without the graph digest apps.export records "
            "(an export made before tfmp recorded one: export the run again)"
        )
    actual = graph_digest(saved_model_dir)
    if actual != recorded:
        return (
            f"holds a {GRAPH_FILE} that is not the one apps.export wrote (sha256 {actual[:12]}..., "
            f"{run_dir.EXPORT_METADATA_FILE} records {recorded[:12]}...)"
        )
    return None


def check(saved_model_dir: str, metadata: dict | None, trusted: bool = False) -> str:
    """Returns the one-line notice to print before running the SavedModel, or raises a UsageError
    naming the directory and `--trust_saved_model` when it is untrusted and `trusted` is False."""
    if trusted:
        return (
            f"note: running SavedModel {saved_model_dir}, a program with your permissions, unchecked ({FLAG})"
        )
    reason = untrusted(saved_model_dir, metadata)
    if reason:
        raise UsageError(
            f"SavedModel {saved_model_dir} {reason}; a SavedModel is a program that runs with your "
            f"permissions: pass {FLAG} if you trust its source, or predict with the export's "
            "model.keras (loaded in Keras' safe mode)"
        )
    return (
        f"note: running SavedModel {saved_model_dir}, a program with your permissions: its graph is "
        f"the one apps.export recorded in {run_dir.EXPORT_METADATA_FILE}"
    )
