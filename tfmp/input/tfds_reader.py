"""Reading prepared TFDS datasets (never downloading), with one-line errors.

    tfds = tfds_reader.module()
    builder = tfds_reader.builder("voc/2007", data_dir)         # UsageError if unknown or bad
    dataset = tfds_reader.read("voc/2007", "test", data_dir, None, None, {"image": skip})
    tfds_reader.check_readable("voc/2007", ("train", "test"), data_dir)  # UsageError if not prepared

Images stay encoded (the caller passes `tfds.decode.SkipDecoding()` for them) until after the
shuffle and skip, so a resumed run decodes nothing it skips.
"""

from __future__ import annotations

import contextlib
import difflib
import logging

from tfmp.errors import UsageError


def module():
    """`tensorflow_datasets`. Imported here, on first use: it takes seconds and only `tfds:`
    specs need it, so built-in and file datasets start without it."""
    import tensorflow_datasets

    return tensorflow_datasets


def builder(name: str, data_dir: str | None, example: str = ""):
    """`tfds.builder(name)`; an unknown name or a bad config/version is a `UsageError`."""
    tfds = module()
    try:
        return tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        close = difflib.get_close_matches(name, tfds.list_builders(), n=5)
        hint = f"did you mean: {', '.join(close)}? " if close else (f"use e.g. {example} " if example else "")
        raise UsageError(f"unknown tfds dataset {name!r}; {hint}(see tfds.list_builders())") from None
    except (AssertionError, ValueError) as error:  # bad config or version: TFDS says which exist
        raise UsageError(f"bad tfds dataset {name!r}: {str(error).splitlines()[0]}") from None


def read(name: str, split: str, data_dir, file_shard_context, shuffle_seed, decoders, as_supervised=False):
    """The still-encoded records of one split; this pipeline's files only with a context."""
    tfds = module()
    read_config = tfds.ReadConfig(input_context=file_shard_context, shuffle_seed=shuffle_seed)
    try:
        with _without_variant_warnings():
            return tfds.load(
                name,
                split=split,
                data_dir=data_dir,
                as_supervised=as_supervised,
                download=False,
                read_config=read_config,
                shuffle_files=shuffle_seed is not None,
                decoders=decoders,
            )
    except AssertionError as error:  # TFDS's "could not find data in ..."
        raise UsageError(
            f"tfds dataset {name!r} is not prepared in data_dir {data_dir!r}; run `tfds build "
            f"{name} --data_dir DIR` where there is internet and pass that DIR"
        ) from error


class _DropVariantWarnings(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith("Variant folder ")


@contextlib.contextmanager
def _without_variant_warnings():
    """TFDS warns "Variant folder DIR has no dataset_info.json" on its way to the "not prepared"
    error `read` turns into one line: the warning would be a second line saying the same."""
    quiet = _DropVariantWarnings()
    logger = logging.getLogger("absl")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def check_readable(name: str, splits, data_dir) -> None:
    """`read` of each of `splits`: it builds the record pipelines and reads no record, so an
    unprepared dataset is a `UsageError` now, before a run writes anything. (The builder's own
    `is_prepared()` says False under `tfds.testing.mock_data`, which reads fine.)"""
    for split in splits:
        read(name, split, data_dir, None, None, None)
