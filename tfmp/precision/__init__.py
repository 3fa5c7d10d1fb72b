"""Mixed precision for Keras 3 on TensorFlow: policies, loss scaling and the precision doctor.

    from tfmp import precision
    choice = precision.resolve("auto")            # or "mixed", "float32", "mixed_float16", ...
    optimizer = precision.wrap_optimizer(keras.optimizers.Adam(1e-3), choice.policy, "auto")
    report = precision.diagnose(model, dataset)   # which layers break in float16 / bfloat16
    model = precision.float32_layers(model, report.float32_layers)

Modules: `policy` (which policy on which hardware), `probe` (this host's float32, bfloat16 and
float16 speeds, measured once and cached, which "auto" and "mixed" choose by), `loss_scaling`
(tfmp's replica-safe LossScaleOptimizer and the loss-scale flags), `doctor` (per-layer measurements, counted by
`measures`), `report` (the table and precision_report.json), `layers` (copies of a model with
float32 layers), `fused_norm` (BatchNormalization on the fused kernel, GroupNormalization on `group_norm`'s,
LayerNormalization and RMSNormalization on `layer_norm`'s, MultiHeadAttention's softmax on
`attention`'s: half precision in and out).
"""

from tfmp.precision.doctor import diagnose
from tfmp.precision.fused_norm import FusedNormalization, fuse_normalization
from tfmp.precision.layers import clone_with_policies, float32_layers, layer_names, matching_layers
from tfmp.precision.loss_scaling import (
    DEFAULT_GROWTH_STEPS,
    DEFAULT_INITIAL_SCALE,
    LossScaleOptimizer,
    check_compiled_with,
    current_loss_scale,
    ensure_loss_scaling,
    loss_scale_mode,
    parse_loss_scale,
    wrap_optimizer,
)
from tfmp.precision.measures import (
    EPSILON,
    ERROR_FACTOR,
    FLOAT16_MAX,
    FLOAT16_SMALLEST_NORMAL,
    FLOAT16_SMALLEST_SUBNORMAL,
)
from tfmp.precision.policy import (
    CHOICES,
    MARGIN,
    POLICIES,
    Hardware,
    PolicyChoice,
    by_rule,
    choose,
    compute_dtype,
    detect_hardware,
    model_compute_dtypes,
    resolve,
)
from tfmp.precision.report import HEALTHY, REPORT_FILE, LayerReport, Report, format_report, save_report

__all__ = [
    "CHOICES",
    "DEFAULT_GROWTH_STEPS",
    "DEFAULT_INITIAL_SCALE",
    "EPSILON",
    "ERROR_FACTOR",
    "FLOAT16_MAX",
    "FLOAT16_SMALLEST_NORMAL",
    "FLOAT16_SMALLEST_SUBNORMAL",
    "HEALTHY",
    "POLICIES",
    "REPORT_FILE",
    "Hardware",
    "LayerReport",
    "LossScaleOptimizer",
    "MARGIN",
    "PolicyChoice",
    "Report",
    "FusedNormalization",
    "by_rule",
    "check_compiled_with",
    "choose",
    "clone_with_policies",
    "compute_dtype",
    "current_loss_scale",
    "detect_hardware",
    "diagnose",
    "ensure_loss_scaling",
    "float32_layers",
    "format_report",
    "fuse_normalization",
    "layer_names",
    "loss_scale_mode",
    "matching_layers",
    "model_compute_dtypes",
    "parse_loss_scale",
    "resolve",
    "save_report",
    "wrap_optimizer",
]
