"""What the precision doctor counts: float16's limits, magnitudes and relative errors.

magnitudes = Magnitudes()
magnitudes.add(gradient, scale=32768.0)    # counts as float16 would hold gradient * scale
magnitudes.summary()                        # {"max_abs": ..., "overflow": share, ...}
error = RelativeError()
error.add([half_output], [float32_output])
error.value()                               # ||half - float32|| / ||float32||
"""

from __future__ import annotations

import math

import numpy as np

FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14  # 6.1e-5
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24  # 6.0e-8
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # spacing of numbers just above 1
# A well-conditioned layer's own relative error is its inputs', weights' and output's rounding:
# 0.2-0.7 epsilon measured on every layer of seed_cnn, lenet, mnist_mlp, resnet20 and retinanet_tiny.
# 8 epsilon (over 10x that) means the layer amplifies rounding (cancellation, exp, huge sums) or overflows.
ERROR_FACTOR = 8.0


class Magnitudes:
    """Running summary of |values|: largest, and how many would overflow/underflow float16."""

    def __init__(self):
        self.max_abs = 0.0
        self.values = self.nonzero = self.nonfinite = 0
        self.overflow = self.below_normal = self.below_subnormal = 0

    def add(self, values, scale: float = 1.0) -> None:
        """Adds values (a tensor or array); the float16 counts are of `values * scale`."""
        magnitudes = np.abs(np.asarray(values, np.float32)).ravel()
        finite = np.isfinite(magnitudes)
        self.values += magnitudes.size
        self.nonfinite += int(magnitudes.size - np.count_nonzero(finite))
        magnitudes = magnitudes[finite]
        if magnitudes.size:
            self.max_abs = max(self.max_abs, float(magnitudes.max()))
        scaled = magnitudes[magnitudes > 0] * np.float32(scale)  # zeros are exact in float16
        self.nonzero += scaled.size
        self.overflow += int(np.count_nonzero(scaled > FLOAT16_MAX))
        self.below_normal += int(np.count_nonzero(scaled < FLOAT16_SMALLEST_NORMAL))
        self.below_subnormal += int(np.count_nonzero(scaled < FLOAT16_SMALLEST_SUBNORMAL))

    def summary(self) -> dict:
        share = lambda count: count / self.nonzero if self.nonzero else 0.0  # noqa: E731
        return {
            "max_abs": self.max_abs,
            "values": self.values,
            "nonzero": self.nonzero,
            "nonfinite_in_float32": self.nonfinite,
            "overflow": share(self.overflow),
            "below_normal": share(self.below_normal),
            "below_subnormal": share(self.below_subnormal),
        }


class RelativeError:
    """||half - reference|| / ||reference|| accumulated over calls (inf once half is not finite)."""

    def __init__(self):
        self.difference_squared = self.reference_squared = 0.0
        self.nonfinite = False
        self.calls = 0

    def add(self, half: list[np.ndarray], reference: list[np.ndarray]) -> None:
        for half_values, reference_values in zip(half, reference):
            if not np.all(np.isfinite(reference_values)):
                continue  # float32 itself is not finite: no precision question to answer
            half_values = half_values.astype(np.float64)
            reference_values = reference_values.astype(np.float64)
            if not np.all(np.isfinite(half_values)):
                self.nonfinite = True
                continue
            self.difference_squared += float(np.sum((half_values - reference_values) ** 2))
            self.reference_squared += float(np.sum(reference_values**2))
            self.calls += 1

    def value(self) -> float | None:
        if self.nonfinite:
            return math.inf
        if not self.calls:
            return None
        if not self.reference_squared:
            return 0.0 if not self.difference_squared else math.inf
        return math.sqrt(self.difference_squared / self.reference_squared)
