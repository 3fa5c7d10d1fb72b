"""Image files checked before a run starts: each file's first and last bytes, no full decode.

    image_files.check(paths, "folder:/data/pets")     # UsageError naming the first bad file
    image_files.problem("/data/pets/cat/1.jpg")       # None, or why it is not a readable image

What `tf.io.decode_image` (every file reader's decoder) accepts is told by the first bytes: JPEG,
PNG, GIF, BMP, WebP or JPEG XL; anything else (an empty file, an HTML error page or a Git LFS
pointer saved as .jpg) is refused at once. A whole file ends in a known way: a JPEG with its
end-of-image marker, a PNG with its IEND chunk, a GIF with its trailer, a BMP or WebP at least
as long as its header says. A file that does not (cut short, or with bytes appended, as phones
append a video to a "motion photo") is decoded once, in full, as the run decodes it
(`tfmp.input.decoding.decode`: 3 channels, a WebP's alpha dropped), and refused only if that
fails: the verdict is the decoder's own, the cost two small reads per good file (about 0.2 s per
10,000 cached files on 2 cores, 0.7 s uncached; ImageNet's 1.3M: ~30 s and ~90 s). A BMP of a
bit depth TensorFlow's decoder does not read (1, 4 or 16 bits) is refused from its header.

Damage in the middle of a file that keeps its ends intact passes: a JPEG then decodes to a
partly grey image (libjpeg prints "Corrupt JPEG data"), a PNG or GIF fails in training, where
the run names it (`decoding.failing_file`) and stops in one line.

Decompression bombs: a file far smaller than its image (a 1 MB PNG of 20000x20000 zeros decodes
to 1.2 GB of uint8, 4.8 GB as float32) is refused from its header, before anything decodes it:
`max_pixels` (default `MAX_IMAGE_PIXELS`, Pillow's limit; 0: none) caps the pixels the decoder
would allocate. The header gives them: PNG's IHDR, JPEG's SOFn (found by walking the segments
before it), BMP's and WebP's (VP8, VP8L, VP8X canvas) size fields, and for GIF every frame's
descriptor (`tf.io.decode_image` decodes every frame of a GIF onto a canvas of the largest
frame's size, even when it keeps only the first). A JPEG XL's size is not read (not checked).

    image_files.declared_size("big.png")           # (20000, 20000, 400000000): width, height, pixels
    image_files.oversized("big.png", 89_478_485)   # "PNG of 20000x20000 = 400,000,000 pixels ..."
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io

import tensorflow as tf

from tfmp.errors import UsageError
from tfmp.input import decoding

FORMATS = "JPEG, PNG, GIF, BMP, WebP or JPEG XL"
HEAD, TAIL = 32, 64  # bytes read from each end: every signature and end marker fits
_PADDING = b"\x00\xff\r\n\t "  # what writers leave after a JPEG's end-of-image marker
_THREADS = 16  # cold files: 16 threads read ~3x faster than one here; cached ones about as fast
_CHUNK = 512  # files per task: thread hand-offs cost more than reading a cached file
MAX_IMAGE_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS: 1024**3 // 4 // 3, 256 MiB as RGB
_JPEG_SEGMENTS = 1024  # markers walked to find a JPEG's SOFn (a camera file has about 10 before it)
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_NO_LENGTH = {0x01, *range(0xD0, 0xDA)}  # TEM, RSTn, SOI, EOI: markers without a length
_BMP_BITS = (8, 24, 32)  # bits per pixel TensorFlow's BMP decoder reads (1, 3 or 4 bytes a pixel)


def _format(head: bytes) -> str | None:
    """The format `tf.io.decode_image` finds in these first bytes, or None."""
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"GIF8"):
        return "GIF"
    if head.startswith(b"BM"):
        return "BMP"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WebP"
    if head.startswith((b"\xff\x0a", b"\x00\x00\x00\x0cJXL \r\n\x87\n")):
        return "JPEG XL"
    return None


def _whole(kind: str, head: bytes, tail: bytes, size: int) -> str | None:
    """None if the file ends as a whole `kind` file does, else what is missing."""
    if kind == "JPEG" and not tail.rstrip(_PADDING).endswith(b"\xff\xd9"):
        return "no end-of-image marker"
    if kind == "PNG" and b"IEND\xaeB`\x82" not in tail:
        return "no IEND chunk at the end"
    if kind == "GIF" and not tail.rstrip(_PADDING).endswith(b"\x3b"):
        return "no trailer byte"
    if kind == "BMP" and len(head) >= 30:
        offset, width, height, bits = (
            int.from_bytes(head[10:14], "little"),
            int.from_bytes(head[18:22], "little", signed=True),
            int.from_bytes(head[22:26], "little", signed=True),
            int.from_bytes(head[28:30], "little"),
        )
        if size < offset + (abs(width) * bits + 31) // 32 * 4 * abs(height):
            return "shorter than its header says"
    if kind == "WebP" and size < 8 + int.from_bytes(head[4:8], "little"):
        return "shorter than its header says"
    return None


def _jpeg_size(handle) -> tuple[int, int] | None:
    """(width, height) of the first SOFn marker, walking the segments before it (EXIF, ICC
    profiles, thumbnails: each says its length), or None when the walk finds none."""
    position = 2
    for _ in range(_JPEG_SEGMENTS):
        handle.seek(position)
        marker = handle.read(2)
        if len(marker) < 2 or marker[0] != 0xFF:
            return None
        if marker[1] == 0xFF:  # a fill byte before the marker
            position += 1
            continue
        if marker[1] in _JPEG_NO_LENGTH:
            position += 2
            continue
        field = handle.read(7)  # length, then (SOFn) precision, height, width
        if marker[1] in _JPEG_SOF and len(field) == 7:
            return int.from_bytes(field[5:7], "big"), int.from_bytes(field[3:5], "big")
        if marker[1] in _JPEG_SOF:
            return None
        if len(field) < 2:
            return None
        position += 2 + int.from_bytes(field[:2], "big")
    return None


def _libjpeg_size(handle) -> tuple[int, int] | None:
    """libjpeg's own reading of the header (it skips stray bytes between segments, which the walk
    above stops at): the whole file is read, nothing decoded."""
    handle.seek(0)
    try:
        height, width, _ = tf.io.extract_jpeg_shape(handle.read()).numpy().tolist()
    except tf.errors.OpError:
        return None  # no header libjpeg reads: decoding fails too
    return width, height


def _gif_size(data: bytes) -> tuple[int, int, int, int] | None:
    """(canvas width, height, pixels the decoder holds, frames) of a whole GIF: the decoder
    inflates every frame (each its own descriptor's size) and paints them on a canvas of the
    largest frame's width and height, whichever frame it returns."""
    if len(data) < 13:
        return None
    position = 13 + ((3 << ((data[10] & 7) + 1)) if data[10] & 0x80 else 0)  # global color table
    width = height = area = frames = 0
    while position < len(data) and data[position] != 0x3B:  # 0x3B: the trailer
        if data[position] == 0x21:  # an extension: label, then data sub-blocks
            position += 2
        elif data[position] == 0x2C and position + 10 <= len(data):  # an image descriptor
            frame_width = int.from_bytes(data[position + 5 : position + 7], "little")
            frame_height = int.from_bytes(data[position + 7 : position + 9], "little")
            width, height = max(width, frame_width), max(height, frame_height)
            area, frames = area + frame_width * frame_height, frames + 1
            packed = data[position + 9]
            position += 10 + ((3 << ((packed & 7) + 1)) if packed & 0x80 else 0) + 1  # + LZW code size
        else:
            break
        while position < len(data) and data[position]:  # sub-blocks, each led by its length
            position += data[position] + 1
        position += 1
    if not frames:
        return None
    return width, height, max(width * height, area), frames


def _declared(kind: str, head: bytes, handle) -> tuple[int, int, int, int] | None:
    """(width, height, pixels, frames) the header of a `kind` file declares, or None if unknown."""
    size = None
    if kind == "PNG" and head[12:16] == b"IHDR":
        size = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    elif kind == "JPEG":
        size = _jpeg_size(handle) or _libjpeg_size(handle)
    elif kind == "GIF":
        handle.seek(0)
        return _gif_size(handle.read())
    elif kind == "BMP" and len(head) >= 26:
        if int.from_bytes(head[14:18], "little") == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes
            size = int.from_bytes(head[18:20], "little"), int.from_bytes(head[20:22], "little")
        else:  # a negative height: rows stored top-down
            size = tuple(abs(int.from_bytes(head[at : at + 4], "little", signed=True)) for at in (18, 22))
    elif kind == "WebP":
        chunk = head[12:16]
        if chunk == b"VP8 ":
            size = tuple(int.from_bytes(head[at : at + 2], "little") & 0x3FFF for at in (26, 28))
        elif chunk == b"VP8L":
            bits = int.from_bytes(head[21:25], "little")
            size = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        elif chunk == b"VP8X":  # the canvas of an extended (animated, alpha) file
            size = tuple(int.from_bytes(head[at : at + 3], "little") + 1 for at in (24, 27))
    return (size[0], size[1], size[0] * size[1], 1) if size else None


def _open(path: str):
    opener = tf.io.gfile.GFile if "://" in path else open  # gs://, s3://: TensorFlow's file systems
    return opener(path, "rb")


def _ends(path: str, sized: bool = False):
    """(first HEAD bytes, last TAIL bytes, size, declared): two reads, whatever the file's size,
    and with `sized` a few more to read the image size its header declares (`_declared`)."""
    with _open(path) as handle:
        head = handle.read(HEAD)
        if len(head) < HEAD:
            return head, head, len(head), None
        size = handle.seek(0, 2) if isinstance(handle, io.IOBase) else tf.io.gfile.stat(path).length
        handle.seek(max(size - TAIL, 0))
        tail = handle.read(TAIL)
        kind = _format(head)
        return head, tail, size, _declared(kind, head, handle) if sized and kind else None


def declared_size(path: str) -> tuple[int, int, int] | None:
    """(width, height, pixels) that `path`'s header declares (pixels: what decoding it holds;
    for a GIF every frame), or None when it is no image or the size is not in a header read here."""
    _, _, _, declared = _ends(path, sized=True)
    return declared[:3] if declared else None


def pixel_limit(max_pixels: int | None) -> int:
    """`max_pixels` as a limit: None is `MAX_IMAGE_PIXELS`, 0 no limit; a negative or
    non-integer value is a UsageError naming --max_image_pixels."""
    if max_pixels is None:
        return MAX_IMAGE_PIXELS
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 0:
        raise UsageError(
            f"--max_image_pixels={max_pixels} must be 0 (no limit) or a number of pixels, "
            f"e.g. {MAX_IMAGE_PIXELS} (Pillow's limit, the default)"
        )
    return max_pixels


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


def _too_large(kind: str, declared, size: int, max_pixels: int) -> str | None:
    if not max_pixels or declared is None or declared[2] <= max_pixels:
        return None
    width, height, pixels, frames = declared
    shape = f"{width}x{height}" + (f" in {frames} frames" if frames > 1 else "")
    return (
        f"a {_megabytes(size)} {kind} of {shape} = {pixels:,} pixels, more than "
        f"--max_image_pixels={max_pixels:,}"
    )


@dataclasses.dataclass(frozen=True)
class _Verdict:
    why: str | None = None  # why the file cannot be used (None: it looks whole)
    lacking: str | None = None  # what its end lacks: decode it to be sure
    oversized: bool = False  # `why` is its declared size


def _sniff(path: str, max_pixels: int = 0) -> _Verdict:
    try:
        head, tail, size, declared = _ends(path, sized=max_pixels > 0)
    except (OSError, tf.errors.OpError) as error:
        reason = getattr(error, "strerror", None) or getattr(error, "message", error)
        return _Verdict(f"cannot be read: {reason}")
    if not size:
        return _Verdict("empty file")
    kind = _format(head)
    if kind is None:
        return _Verdict(f"starts with {head[:12]!r}: not a {FORMATS} image")
    too_large = _too_large(kind, declared, size, max_pixels)
    if too_large:  # refused before the decode a doubtful end would cost
        return _Verdict(too_large, oversized=True)
    bits = int.from_bytes(head[28:30], "little") if kind == "BMP" and len(head) >= 30 else None
    if bits is not None and bits not in _BMP_BITS:
        return _Verdict(
            f"a {bits}-bit BMP: TensorFlow's decoder reads 8, 24 and 32-bit ones; convert it, e.g. to PNG"
        )
    missing = _whole(kind, head, tail, size)
    return _Verdict(lacking=missing and f"{kind}: {missing}")


def oversized(path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> str | None:
    """Why `path` is too large to decode ("a 1.1 MB PNG of 20000x20000 = 400,000,000 pixels, more
    than --max_image_pixels=89,478,485"), or None: within the limit, no limit (0), unreadable or
    of a size no header read here gives (the decoder then has the last word)."""
    verdict = _sniff(path, pixel_limit(max_pixels))
    return verdict.why if verdict.oversized else None


def unit_float(image, size=None):
    """A decoded integer image (uint8 or uint16, [..., H, W, C]) as float32 in [0, 1], resized
    first (bilinear, antialias) to `size` (height, width) when given. The resize reads the integers
    and writes float32 at the target size only, so a large photo is never held as full-size float32
    (4x its decoded bytes); the result equals converting first, to float32 rounding."""
    scale = 1.0 / image.dtype.max
    if size is None:
        return tf.image.convert_image_dtype(image, tf.float32)
    return tf.clip_by_value(tf.image.resize(image, size, antialias=True) * scale, 0.0, 1.0)


def _sniff_all(paths, max_pixels: int) -> list[_Verdict]:
    return [_sniff(path, max_pixels) for path in paths]


def _verdicts(paths: list, threads: int, max_pixels: int) -> list[_Verdict]:
    """A verdict per file of `paths`: sniffed, and the doubtful ones decoded (`find_problems`)."""
    sniff = functools.partial(_sniff_all, max_pixels=pixel_limit(max_pixels))
    chunks = [paths[start : start + _CHUNK] for start in range(0, len(paths), _CHUNK)]
    if len(chunks) <= 1 or threads <= 1:
        sniffed = sniff(paths)
    else:  # file reads wait on the disk or network, not on the interpreter
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(chunks))) as pool:
            sniffed = [verdict for part in pool.map(sniff, chunks) for verdict in part]
    doubtful = [index for index, verdict in enumerate(sniffed) if verdict.lacking]
    if doubtful:  # cut short, or bytes appended after the image: only the decoder can tell
        with decoding.quiet_stderr():
            for index in doubtful:
                if decoding.problem(paths[index]) is not None:  # as the run decodes it
                    sniffed[index] = _Verdict(
                        f"truncated or corrupt {sniffed[index].lacking}, and it does not decode"
                    )
    return sniffed


def find_problems(
    paths, threads: int = _THREADS, max_pixels: int | None = MAX_IMAGE_PIXELS
) -> list[tuple[str, str]]:
    """[(path, why)] of every file of `paths` that is not a readable image or declares more than
    `max_pixels` pixels (0: no limit), in `paths` order."""
    paths = list(paths)
    verdicts = _verdicts(paths, threads, max_pixels)
    return [(path, verdict.why) for path, verdict in zip(paths, verdicts) if verdict.why]


def problem(path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> str | None:
    """Why `path` is not an image `tf.io.decode_image` reads (or one too large to decode), or None
    when it looks whole."""
    found = find_problems([path], max_pixels=max_pixels)
    return found[0][1] if found else None


def check(
    paths, what: str, fix: str = "remove or repair them", max_pixels: int | None = MAX_IMAGE_PIXELS
) -> None:
    """Raises one `UsageError` line naming how many of `paths` are not readable images and the
    first of them, with why; `what` names the dataset (the spec, an annotation file). A file
    declaring more than `max_pixels` pixels (0: no limit) is named first, with its sizes."""
    paths = list(paths)
    verdicts = _verdicts(paths, _THREADS, max_pixels)
    bad = [(path, verdict) for path, verdict in zip(paths, verdicts) if verdict.why]
    if not bad:
        return
    large = [(path, verdict) for path, verdict in bad if verdict.oversized]
    if large:
        path, verdict = large[0]
        others = f" ({len(bad) - 1} more unusable file(s))" if len(bad) > 1 else ""
        raise UsageError(
            f"{what}: {decoding.shown(path)} is {verdict.why}{others}; shrink or remove it, or raise "
            "--max_image_pixels (0: no limit) if you trust the file"
        )
    path, verdict = bad[0]
    raise UsageError(
        f"{what}: {len(bad)} file(s) are not readable images, first {decoding.shown(path)} ({verdict.why}); {fix}"
    )
