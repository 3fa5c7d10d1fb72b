"""Image files read and decoded one way everywhere: the datasets, the pre-run check, apps.predict.

    image = decoding.decode(tf.io.read_file(decoding.tf_path(path)), channels=3)  # uint8 [H, W, 3]
    decoding.problem(path)            # None, or the decoder's reason ("Invalid PNG data, size 12420")
    decoding.failing_file(paths, error)   # (path, reason): the file a run's decode error came from
    decoding.stopped_by("folder:/data", path, reason)   # what the run's one error line says of it
    decoding.shown(path)              # the name to print: bytes that are not UTF-8 escaped ("\\xff")

Channels: `tf.io.decode_image` converts a PNG to 1, 3 or 4 channels itself, a JPEG to 1 or 3, a
GIF to 3, a BMP to 3 or 4, but returns a WebP's own channels (3, or 4 with alpha) and refuses any
other request ("Number of channels requested does not match input"). `decode` lets it convert
what it can and otherwise decodes the file's own channels and converts them: alpha dropped (as
libpng drops a PNG's when asked for RGB), gray repeated into RGB, RGB made gray by
`tf.image.rgb_to_grayscale`, an opaque alpha added. So a WebP (also one named .png) decodes
wherever a PNG does, and the pre-run check decodes exactly what the run will.

Names: a Linux file name is bytes and need not be UTF-8. Python holds such a name with surrogate
escapes ("\\udcff"), which TensorFlow's string conversion and its own directory listing refuse;
`tf_path` hands TensorFlow the name's own bytes, `listdir` and `isdir` read local folders with
Python, and `shown` gives a printable name.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

import tensorflow as tf

# The formats whose decoder gives each channel count itself (first bytes of the file).
_SIGNATURES = {
    "PNG": b"\x89PNG",
    "JPEG": b"\xff\xd8\xff",
    "GIF": b"GIF8",
    "BMP": b"BM",
    "JPEG XL": b"\xff\x0a",
    "JPEG XL box": b"\x00\x00\x00\x0cJXL ",
}
_DIRECT = {1: ("PNG", "JPEG"), 3: ("PNG", "JPEG", "GIF", "BMP", "JPEG XL", "JPEG XL box"), 4: ("PNG", "BMP")}
# What a decoder's error says: "Invalid PNG data, size 12420", "Invalid GIF data (size 6340), ...".
_DECODER_ERROR = re.compile(
    r"decod|invalid \w+ data|channels|\b(png|gif|jpe?g|bmp|webp|jxl)\b", re.IGNORECASE
)
_SIZE_HINT = re.compile(r"\bsize\W{0,2}(\d+)")


def tf_path(path) -> bytes:
    """`path` as the bytes TensorFlow's file ops take: a name that is not UTF-8 included."""
    return os.fsencode(path)


def shown(path) -> str:
    """`path` as a message prints it: bytes that are not UTF-8 as `\\xff` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def is_remote(path) -> bool:
    """gs://, s3://, ...: read through TensorFlow's file systems."""
    return "://" in os.fsdecode(path)


def listdir(folder: str) -> list[str]:
    """The names in `folder` (a local name that is not UTF-8 surrogate-escaped, as os.listdir
    gives it; TensorFlow's listing would fail on it)."""
    if is_remote(folder):
        return [name.rstrip("/") for name in tf.io.gfile.listdir(folder)]
    return os.listdir(folder)


def isdir(path: str) -> bool:
    return tf.io.gfile.isdir(path) if is_remote(path) else os.path.isdir(path)


def exists(path: str) -> bool:
    return tf.io.gfile.exists(path) if is_remote(path) else os.path.exists(path)


def decode(contents, channels: int = 3):
    """The encoded image `contents` (a scalar string tensor) as uint8 [H, W, channels], for
    channels 1, 3 or 4 from any format `tf.io.decode_image` reads (the first frame of an
    animation); other channel counts are passed to it as they are."""
    if channels not in _DIRECT:
        return tf.io.decode_image(contents, channels=channels, expand_animations=False)
    head = tf.strings.substr(contents, 0, 8)
    direct = tf.reduce_any(
        tf.stack(
            [
                tf.strings.substr(head, 0, len(_SIGNATURES[name])) == _SIGNATURES[name]
                for name in _DIRECT[channels]
            ]
        )
    )
    image = tf.cond(
        direct,
        lambda: tf.io.decode_image(contents, channels=channels, expand_animations=False),
        lambda: _converted(contents, channels),
    )
    return tf.ensure_shape(image, [None, None, channels])


def _converted(contents, channels: int):
    """The file's own channels (1 to 4), converted to `channels`."""
    image = tf.io.decode_image(contents, channels=0, expand_animations=False)
    own = tf.shape(image)[-1]
    rgb = tf.cond(own >= 3, lambda: image[..., :3], lambda: tf.tile(image[..., :1], [1, 1, 3]))
    rgb = tf.ensure_shape(rgb, [None, None, 3])
    if channels == 3:
        return rgb
    if channels == 1:
        return tf.image.rgb_to_grayscale(rgb)
    opaque = tf.fill(tf.shape(image[..., :1]), tf.constant(255, image.dtype))
    alpha = tf.cond(own % 2 == 0, lambda: image[..., -1:], lambda: opaque)  # 2 and 4: gray/RGB + alpha
    return tf.concat([rgb, tf.ensure_shape(alpha, [None, None, 1])], axis=-1)


def reason(error: tf.errors.OpError) -> str:
    """A decoder's error in a few words: its first line, without TensorFlow's node names."""
    message = getattr(error, "message", None) or str(error)
    line = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    line = re.sub(r"^\{\{[^}]*\}\}\s*", "", line)
    return re.sub(r"\s*\[Op:\w+\].*$", "", line).strip()


@contextlib.contextmanager
def quiet_stderr():
    """libjpeg prints its complaints about a broken file itself ("Corrupt JPEG data..."): the
    refusal that follows says it in one line, so they go to /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def problem(path, channels: int = 3) -> str | None:
    """None if `path` decodes as a run decodes it (`decode`, `channels`), else why not (the
    decoder's words, or why it cannot be read). Call it inside `quiet_stderr`."""
    try:
        decode(tf.io.read_file(tf_path(path)), channels)
    except tf.errors.OpError as error:
        return reason(error)
    except OSError as error:
        return error.strerror or str(error)
    return None


def failing_file(paths, error: Exception) -> tuple[str, str] | None:
    """(path, reason) of the file among `paths` that a run's decode `error` came from (TensorFlow
    names the op, not the file), or None when `error` is no decoder's or no file of `paths` fails.

    The files are decoded again to find it, the ones of the size the error names first (a PNG's
    and a GIF's "size N"): with that hint, the few files of that size; without, every file."""
    if not paths or not isinstance(error, tf.errors.OpError):
        return None
    message = getattr(error, "message", "") or ""
    if not (isinstance(error, tf.errors.NotFoundError) or _DECODER_ERROR.search(message)):
        return None
    candidates = list(paths)
    hint = _SIZE_HINT.search(message)
    if isinstance(error, tf.errors.NotFoundError):
        candidates = [path for path in candidates if shown(path) in message] or candidates
    elif hint:
        size = int(hint.group(1))
        candidates.sort(key=lambda path: _size(path) != size)  # those of that size first
    with quiet_stderr():
        for path in candidates:
            found = problem(path)
            if found is not None:
                return path, found
    return None


def _size(path) -> int | None:
    try:
        return tf.io.gfile.stat(path).length if is_remote(path) else os.path.getsize(path)
    except (OSError, tf.errors.OpError):
        return None


def stopped_by(dataset: str, path, reason: str) -> str:
    """What a run stopped by `failing_file`'s (path, reason) says, up to what a rerun does."""
    if not exists(path):
        return (
            f"{dataset}: {shown(path)} disappeared while the run read it ({reason}); training stopped; "
            "put it back, or let the dataset be without it"
        )
    return (
        f"{dataset}: {shown(path)} does not decode ({reason}): it is damaged inside, which the check "
        "before the run (each file's ends) cannot see; training stopped; remove or repair it"
    )
