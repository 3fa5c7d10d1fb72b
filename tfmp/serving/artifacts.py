"""Which tfmp artifact a path holds, and what it says about itself, checked before anything runs.

    from tfmp.serving import artifacts
    artifacts.kind_of("runs/x")                   # "classifier", "detector", "two_stage_detector"
    artifacts.export_metadata("runs/x/export")    # export.json, checked (None: there is none)
    artifacts.saved_model_dir("runs/x/export")    # the SavedModel a load would run, or None

An artifact is a training run dir (its resolved `flags.txt` names the model and dataset), an
export dir (`export.json`, written by `apps.export`), a SavedModel dir, or a `.keras` / `.tflite`
file. export.json is data from outside the process: it is read only up to MAX_METADATA_BYTES and
every field a predictor uses is checked for its type, so a malformed file is one UsageError naming
it, never a traceback later. Kinds (`KINDS`) are registered by `tfmp.serving.classifier`,
`.detector` and `.two_stage`; `tfmp.serving.predictors` loads and runs the artifacts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

from tfmp import run_dir
from tfmp.errors import UsageError
from tfmp.serving import copies, trust


@dataclasses.dataclass(frozen=True)
class PredictionKind:
    """What predicting with one kind of model needs beyond the generic loaders.

    `trains(name)`: whether a run that trained `--model=name` is of this kind.
    `class_names(dataset, image_size, data_dir)`: the dataset's class names (None if unknown).
    `predict_files(model, image_paths, settings)`: one JSON-able record per image, for
    `apps.predict` (`settings`: its flags top_k, batch_size, score_threshold, max_detections,
    output_dir, trust_saved_model, max_image_pixels; each kind reads the ones it uses).
    `section`: what export.json's section named after the kind must hold, {key: "number" |
    "count" | "counts"} (a number; a positive integer; a list of them), checked on reading."""

    trains: Callable[[str | None], bool]
    class_names: Callable[[str, int | None, str | None], list[str] | None]
    predict_files: Callable[[str, list[str], dict], list[dict]]
    section: dict[str, str] = dataclasses.field(default_factory=dict)


KINDS: dict[str, PredictionKind] = {}  # filled by the modules that know a kind (tfmp.serving.__init__)


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """How an image file becomes a model input."""

    height: int
    width: int
    channels: int

    def to_json(self) -> dict:
        return {
            "image_shape": [self.height, self.width, self.channels],
            "dtype": "float32",
            "value_range": [0.0, 1.0],
            "resize": "bilinear, antialias, clipped to [0, 1]",
        }

    @classmethod
    def from_shape(cls, shape) -> Preprocessing:
        height, width, channels = (int(size) for size in shape)
        return cls(height, width, channels)


def run_kind(path: str) -> str:
    """The kind of model a training run dir trained: the first kind whose registry entry trains
    its `--model` (a name no kind lists is served as a classifier: one probabilities output)."""
    name = run_dir.read_flags(path).get("model")
    return next((kind for kind, spec in KINDS.items() if spec.trains(name)), "classifier")


def run_metadata(path: str) -> dict:
    """Dataset, model and class names of a training run dir (what export.json carries)."""
    flags = run_dir.read_flags(path)
    dataset = flags.get("dataset")
    if dataset is None:
        dataset = str(run_dir.read_run_card(path).get("dataset", "")).split(" ")[0] or None
    image_size = flags.get("image_size")
    metadata = {
        "model": flags.get("model"),
        "dataset": dataset,
        "data_dir": flags.get("data_dir"),
        "image_size": int(image_size) if image_size and image_size.isdigit() else None,
        "class_names": None,
    }
    if dataset:
        try:  # names need the dataset's description only (a folder listing, TFDS metadata)
            names = KINDS[run_kind(path)].class_names(dataset, metadata["image_size"], metadata["data_dir"])
            metadata["class_names"] = list(names) if names else None
        except Exception:  # the data moved or TFDS is missing: predict without names
            pass
    return metadata


def kind_of(path: str) -> str:
    """The kind of model --model `path` (run dir, export dir, SavedModel dir, file) holds."""
    path = os.path.normpath(os.path.expanduser(path))
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    for folder in (directory, os.path.dirname(directory)):  # an export's SavedModel: its parent
        metadata = export_metadata(folder)
        if metadata is not None:
            return metadata.get("kind", "classifier")
    return run_kind(directory)


MAX_METADATA_BYTES = 64 << 20  # export.json holds names and numbers: ImageNet-21k's names are ~0.5 MB
_SECTION_CHECKS = {
    "number": (lambda value: isinstance(value, (int, float)) and not isinstance(value, bool), "a number"),
    "count": (lambda value: isinstance(value, int) and not isinstance(value, bool) and value > 0, "a count"),
    "counts": (
        lambda value: isinstance(value, list) and all(_SECTION_CHECKS["count"][0](item) for item in value),
        "a list of counts",
    ),
}


def export_metadata(directory: str) -> dict | None:
    """`directory`'s export.json (None if it has none), checked to be what apps.export writes: a
    JSON object, a known "kind" (none: a classifier, as exports before kinds), class names as a
    list of strings, and the kind's section; anything else is one UsageError naming the file."""
    path = os.path.join(directory, run_dir.EXPORT_METADATA_FILE)
    if not os.path.isfile(path):
        return None
    fix = "export the run again with apps.export"
    try:
        too_large = os.path.getsize(path) > MAX_METADATA_BYTES
        if not too_large:
            with open(path, encoding="utf-8") as file:
                metadata = json.load(file)
    except (OSError, ValueError, RecursionError) as error:  # ValueError: bad JSON or UTF-8
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0] or type(error).__name__
        raise UsageError(f"{path} is not readable JSON ({reason}); {fix}") from None
    if too_large:
        raise UsageError(
            f"{path} is larger than {MAX_METADATA_BYTES >> 20} MiB, more than any export writes; {fix}"
        )
    if not isinstance(metadata, dict):
        raise UsageError(
            f"{path} holds a JSON {type(metadata).__name__}, not the object apps.export writes; {fix}"
        )
    kind = metadata.get("kind", "classifier")
    if kind not in KINDS:
        raise UsageError(
            f"{path} names kind {kind!r}, which apps.predict does not know ({', '.join(KINDS)}); {fix}"
        )
    names = metadata.get("class_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise UsageError(
            f"{path}: class_names must be a list of strings, not {json.dumps(names)[:60]}; {fix}"
        )
    _check_common(path, metadata, fix)
    _check_section(path, metadata, kind, fix)
    return metadata


def _check_common(path: str, metadata: dict, fix: str) -> None:
    """The fields every export writes, where present: its precision, and the preprocessing a
    server applies (its image shape is checked against the model's own when the model loads)."""
    precision = metadata.get("precision")
    if precision is not None and precision not in copies.PRECISIONS:
        raise UsageError(
            f"{path}: precision must be one of {', '.join(copies.PRECISIONS)}, not {json.dumps(precision)[:60]}; {fix}"
        )
    if "preprocessing" not in metadata:
        return
    preprocessing = metadata["preprocessing"]
    shape = preprocessing.get("image_shape") if isinstance(preprocessing, dict) else None
    if not (isinstance(shape, list) and len(shape) == 3 and _SECTION_CHECKS["counts"][0](shape)):
        raise UsageError(
            f"{path}: preprocessing.image_shape must be [height, width, channels], not "
            f"{json.dumps(shape)[:60] if shape is not None else 'missing'}; {fix}"
        )
    wanted = Preprocessing.from_shape(shape).to_json()
    for key in ("dtype", "value_range"):  # what every tfmp model takes, and apps.predict gives
        if preprocessing.get(key, wanted[key]) != wanted[key]:
            raise UsageError(
                f"{path}: preprocessing.{key} must be {json.dumps(wanted[key])} (what the model was trained "
                f"on), not {json.dumps(preprocessing[key])[:60]}; {fix}"
            )


def _check_section(path: str, metadata: dict, kind: str, fix: str) -> None:
    """export.json's section of `kind` holds every key its predictor reads, of the right type."""
    wanted = KINDS[kind].section
    if not wanted:
        return
    section = metadata.get(kind)
    if not isinstance(section, dict):
        raise UsageError(f"{path} has no {kind!r} section (an object), which a {kind} export holds; {fix}")
    for key, expected in wanted.items():
        accepts, noun = _SECTION_CHECKS[expected]
        if not accepts(section.get(key)):
            found = json.dumps(section[key])[:60] if key in section else "missing"
            raise UsageError(f"{path}: {kind}.{key} must be {noun}, not {found}; {fix}")


def saved_model_dir(path: str) -> str | None:
    """The SavedModel directory `load(path)` would run (a SavedModel dir, or an export dir's
    saved_model/), or None when it loads a .keras or .tflite."""
    path = os.path.normpath(os.path.expanduser(path))
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, trust.GRAPH_FILE)):
        return path
    saved = os.path.join(path, "saved_model")
    if os.path.exists(saved) and export_metadata(path) is not None:
        return saved
    return None


def saved_model_metadata(path: str) -> dict | None:
    """The export.json of the SavedModel dir `path`: its own, or its export dir's (the parent)."""
    return export_metadata(path) or export_metadata(os.path.dirname(path))
