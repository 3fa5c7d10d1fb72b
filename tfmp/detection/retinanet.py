"""RetinaNet (Lin et al., "Focal Loss for Dense Object Detection", 2017) as pure Keras builders.

Provides:

* `retinanet(image_size, num_classes, dtype=None, name="retinanet", *, backbone, levels, ...)`:
  a backbone giving C3-C5 (strides 8, 16, 32), an FPN with P3-P5 from a top-down pathway and
  P6/P7 from stride-2 convs on C5 / relu(P6) (the paper's layout; any consecutive run of levels
  starting at 3 up to 7), and class and box subnets whose layers are SHARED across levels.
* `DETECTORS`: "retinanet_tiny" (a small conv backbone with group norm, P3-P5, 64-wide heads of
  depth 2 with group norm: trains on CPU in minutes; the norm in the heads, as in later
  RetinaNet/FCOS recipes, reached mAP 0.77 in 500 steps on `shapes` where plain heads got 0.68) and
  "retinanet_resnet50" (tfmp's ResNet-50 v1.5 C3-C5, P3-P7, 256-wide heads of depth 4, as in the paper).
* `build_detector(name, image_size, num_classes, dtype=None, **options)` and
  `anchor_config(name)`: the `tfmp.detection.boxes.AnchorConfig` the detector's outputs follow.

Usage:

    model = build_detector("retinanet_tiny", 128, num_classes=6, dtype="mixed_bfloat16")
    outputs = model(images)   # {"classes": [B, A, 6] logits, "boxes": [B, A, 4] deltas}

The input is float32 images in [0, 1] of shape (image_size, image_size, 3), image_size a
multiple of 32 (so the top-down pathway's 2x upsampling lands exactly on the next level).
Both outputs are float32 whatever the policy: the heads' last conv, reshapes and concatenation
run in float32, so the loss, the box decoder and NMS never see float16. Anchors: 9 per location
(3 scales x 3 ratios), in the order `tfmp.detection.boxes.generate_anchors` lists them. The
class subnet's last bias starts at -log((1 - 0.01) / 0.01) (the paper's prior), so the focal
loss of the ~100k background anchors does not swamp the first steps.
"""

from __future__ import annotations

import functools
import math

import keras

from tfmp.detection.boxes import AnchorConfig
from tfmp.errors import UsageError, unknown
from tfmp.models import check_dtype_policy
from tfmp.models.cnn import functional_model, image_input
from tfmp.models.resnet import resnet50

CLASS_PRIOR = 0.01
TINY_BACKBONE_WIDTHS = (16, 32, 64, 96, 128)  # strides 2, 4, 8 (C3), 16 (C4), 32 (C5)
TINY_NORM_GROUPS = 8
# ResNet-50's last block of stages 2-4 gives C3-C5 (strides 8, 16, 32).
RESNET50_FEATURE_BLOCKS = ("stage2_block4", "stage3_block6", "stage4_block3")


def _regularizer(weight_decay):
    if weight_decay < 0:
        raise UsageError(f"weight_decay must be >= 0, got {weight_decay}")
    # The SGD convention of tfmp.models.resnet: the gradient gains weight_decay * kernel.
    return keras.regularizers.L2(weight_decay / 2) if weight_decay else None


def _conv_group_norm(x, width, stride, name, dtype, regularizer):
    """3x3 conv -> GroupNorm -> relu. Group norm, not batch norm: its statistics are per image,
    so N replicas compute exactly what one device computes for the global batch (batch norm
    would normalise each replica's share on its own), at any batch size."""
    x = conv(
        width,
        3,
        f"{name}_conv",
        dtype,
        regularizer,
        stride=stride,
        use_bias=False,
        kernel_initializer="he_normal",
    )(x)
    x = keras.layers.GroupNormalization(TINY_NORM_GROUPS, dtype=dtype, name=f"{name}_gn")(x)
    return keras.layers.Activation("relu", dtype=dtype, name=f"{name}_relu")(x)


def tiny_backbone(images, name, dtype, regularizer, widths=TINY_BACKBONE_WIDTHS):
    """Five stride-2 stages of two 3x3 conv-gn-relu layers each; returns [C3, C4, C5]."""
    x, features = images, []
    for stage, width in enumerate(widths, start=1):
        x = _conv_group_norm(x, width, 2, f"{name}_backbone_stage{stage}_1", dtype, regularizer)
        x = _conv_group_norm(x, width, 1, f"{name}_backbone_stage{stage}_2", dtype, regularizer)
        if stage >= 3:
            features.append(x)
    return images, features


def resnet50_backbone(image_size, name, dtype, weight_decay):
    """tfmp's ResNet-50 graph, cut at C3-C5 (its pooling and classifier are left out). Its batch
    norm normalises each replica's share of the batch (16 images per GPU in the COCO config)."""
    classifier = resnet50(
        (image_size, image_size, 3), 2, dtype=dtype, name=f"{name}_backbone", weight_decay=weight_decay
    )
    features = [
        classifier.get_layer(f"{name}_backbone_{block}_out").output for block in RESNET50_FEATURE_BLOCKS
    ]
    return classifier.inputs[0], features


def conv(filters, kernel_size, name, dtype, regularizer, stride=1, **kwargs):
    return keras.layers.Conv2D(
        filters,
        kernel_size,
        strides=stride,
        padding="same",
        name=name,
        dtype=dtype,
        kernel_regularizer=regularizer,
        **kwargs,
    )


def feature_pyramid(features, levels, width, name, dtype, regularizer):
    """FPN: 1x1 laterals + nearest 2x top-down sums, 3x3 smoothing; P6/P7 by stride-2 convs."""
    c3, c4, c5 = features
    laterals = {
        level: conv(width, 1, f"{name}_fpn_lateral_p{level}", dtype, regularizer)(c)
        for level, c in zip((3, 4, 5), (c3, c4, c5))
    }
    merged = {5: laterals[5]}
    for level in (4, 3):
        upsampled = keras.layers.UpSampling2D(2, dtype=dtype, name=f"{name}_fpn_upsample_p{level}")(
            merged[level + 1]
        )
        merged[level] = keras.layers.Add(dtype=dtype, name=f"{name}_fpn_add_p{level}")(
            [laterals[level], upsampled]
        )
    pyramid = {
        level: conv(width, 3, f"{name}_fpn_p{level}", dtype, regularizer)(merged[level])
        for level in (3, 4, 5)
        if level in levels
    }
    if 6 in levels:
        pyramid[6] = conv(width, 3, f"{name}_fpn_p6", dtype, regularizer, stride=2)(c5)
    if 7 in levels:
        relu6 = keras.layers.Activation("relu", dtype=dtype, name=f"{name}_fpn_p6_relu")(pyramid[6])
        pyramid[7] = conv(width, 3, f"{name}_fpn_p7", dtype, regularizer, stride=2)(relu6)
    return [pyramid[level] for level in levels]


def _subnet(
    pyramid,
    levels,
    outputs_per_anchor,
    anchors,
    width,
    depth,
    norm,
    kind,
    name,
    dtype,
    regularizer,
    bias_initializer,
):
    """One subnet (class or box) applied to every level with the same layers; float32 output
    [B, sum(H*W*anchors), outputs_per_anchor]. `norm`: group norm after each hidden conv."""
    hidden = []
    for index in range(1, depth + 1):
        hidden.append(
            conv(
                width,
                3,
                f"{name}_{kind}_conv{index}",
                dtype,
                regularizer,
                activation=None if norm else "relu",
                kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
            )
        )
        if norm:  # group norm (per image, so shared across levels like the convs)
            hidden.append(
                keras.layers.GroupNormalization(
                    TINY_NORM_GROUPS, dtype=dtype, name=f"{name}_{kind}_gn{index}"
                )
            )
            hidden.append(keras.layers.Activation("relu", dtype=dtype, name=f"{name}_{kind}_relu{index}"))
    # float32: the logits/deltas, their reshapes and the concatenation never round to float16.
    final = conv(
        anchors * outputs_per_anchor,
        3,
        f"{name}_{kind}_output",
        "float32",
        regularizer,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        bias_initializer=bias_initializer,
    )
    per_level = []
    for level, features in zip(levels, pyramid):
        for layer in hidden:
            features = layer(features)
        per_level.append(
            keras.layers.Reshape(
                (-1, outputs_per_anchor), dtype="float32", name=f"{name}_{kind}_reshape_p{level}"
            )(final(features))
        )
    return keras.layers.Concatenate(axis=1, dtype="float32", name=f"{name}_{kind}")(per_level)


def retinanet(
    image_size: int,
    num_classes: int,
    dtype: str | None = None,
    name: str = "retinanet",
    *,
    backbone: str = "tiny",
    levels: tuple[int, ...] = (3, 4, 5, 6, 7),
    fpn_width: int = 256,
    head_width: int = 256,
    head_depth: int = 4,
    head_norm: bool = False,
    weight_decay: float = 0.0,
) -> keras.Model:
    """RetinaNet for square `image_size` images (see the module docstring); `backbone` is
    "tiny" or "resnet50". Layers: `{name}_backbone_*`, `{name}_fpn_*`, `{name}_classes_*`,
    `{name}_boxes_*`; outputs "classes" and "boxes"."""
    if (
        not isinstance(image_size, int)
        or isinstance(image_size, bool)
        or image_size < 32
        or (image_size % 32)
    ):
        raise UsageError(f"detector {name!r} needs image_size a multiple of 32 (>= 32), got {image_size!r}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise UsageError(f"detector {name!r} needs num_classes >= 1, got {num_classes!r}")
    levels = tuple(levels)
    if not levels or levels != tuple(range(3, 3 + len(levels))) or levels[-1] > 7:
        raise UsageError(
            f"bad FPN levels {levels!r} for {name!r}; use consecutive levels from 3 "
            "up to at most 7, e.g. (3, 4, 5) or (3, 4, 5, 6, 7)"
        )
    regularizer = _regularizer(weight_decay)
    if backbone == "tiny":
        images, features = tiny_backbone(
            image_input((image_size, image_size, 3), name), name, dtype, regularizer
        )
    elif backbone == "resnet50":
        images, features = resnet50_backbone(image_size, name, dtype, weight_decay)
    else:
        raise unknown("detector backbone", backbone, ("tiny", "resnet50"))
    pyramid = feature_pyramid(features, levels, fpn_width, name, dtype, regularizer)
    anchors = AnchorConfig(levels=levels).anchors_per_location
    prior_bias = keras.initializers.Constant(-math.log((1 - CLASS_PRIOR) / CLASS_PRIOR))
    classes = _subnet(
        pyramid,
        levels,
        num_classes,
        anchors,
        head_width,
        head_depth,
        head_norm,
        "classes",
        name,
        dtype,
        regularizer,
        prior_bias,
    )
    boxes = _subnet(
        pyramid,
        levels,
        4,
        anchors,
        head_width,
        head_depth,
        head_norm,
        "boxes",
        name,
        dtype,
        regularizer,
        "zeros",
    )
    return functional_model(images, {"classes": classes, "boxes": boxes}, name, dtype)


DETECTORS = {
    "retinanet_tiny": functools.partial(
        retinanet,
        backbone="tiny",
        levels=(3, 4, 5),
        fpn_width=64,
        head_width=64,
        head_depth=2,
        head_norm=True,
    ),
    "retinanet_resnet50": functools.partial(retinanet, backbone="resnet50", levels=(3, 4, 5, 6, 7)),
}


def anchor_config(name: str) -> AnchorConfig:
    """The anchors detector `name` predicts for (levels from its registry entry)."""
    if name not in DETECTORS:
        raise unknown("detector", name, DETECTORS)
    return AnchorConfig(levels=DETECTORS[name].keywords["levels"])


def build_detector(
    name: str, image_size: int, num_classes: int, dtype: str | None = None, **options
) -> keras.Model:
    """Builds registered detector `name` with layers named `f"{name}_..."`; `options` such as
    `weight_decay` or `head_width` go to `retinanet` (an unknown one is a UsageError)."""
    if name not in DETECTORS:
        raise unknown("detector", name, DETECTORS)
    check_dtype_policy(dtype)
    allowed = {"weight_decay", "fpn_width", "head_width", "head_depth", "head_norm"}
    rejected = sorted(set(options) - allowed)
    if rejected:
        raise UsageError(
            f"detector {name!r} does not take option(s) {', '.join(rejected)}; "
            f"its options: {', '.join(sorted(allowed))}"
        )
    return DETECTORS[name](image_size, num_classes, dtype=dtype, name=name, **options)
