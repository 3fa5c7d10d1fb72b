"""`--mixed` and `--precision=auto` by measurement: the decision from a timing table, the probe's
cache, the fallback when the probe fails, and one real probe on this host.

The decision tests feed timing tables in and check the policy and the run card's line; they never
depend on this host's speed (conftest turns the probe off for every other test). The real probe
only checks that it returns a finite table and a valid choice: which precision is faster changes
from host to host and day to day."""

import json
import math
import subprocess

import pytest
import tensorflow as tf
from conftest import run_python

from tfmp import precision
from tfmp.errors import UsageError
from tfmp.precision import probe

CPU_PLAIN = precision.Hardware((), False, cpu_fast_bfloat16=False)
CPU_BF16 = precision.Hardware((), False, cpu_fast_bfloat16=True)
AMPERE = precision.Hardware(((8, 0),), False, False)
TPU = precision.Hardware((), True, False)


def _table(bfloat16_speed, float16_speed):
    """Timings where the half precisions run at these multiples of float32's speed."""
    float32 = {"matmul": 0.004, "conv": 0.012}
    return {
        "float32": float32,
        "bfloat16": {name: seconds / bfloat16_speed for name, seconds in float32.items()},
        "float16": {name: seconds / float16_speed for name, seconds in float32.items()},
    }


def _never():
    raise AssertionError("the probe ran")


@pytest.mark.parametrize("requested", ["auto", "mixed"])
def test_measured_choice_on_cpu(requested):
    asked = "auto" if requested == "auto" else "--mixed"
    # bfloat16 1.6x faster: chosen, even where the CPU flags would say it is emulated.
    faster = precision.choose(_table(1.6, 0.3), CPU_PLAIN, requested, "measured now")
    assert faster == precision.PolicyChoice(
        "mixed_bfloat16", f"{asked}: mixed_bfloat16 1.60x float32's speed on this CPU (probe measured now)"
    )
    # bfloat16 at half float32's speed, float16 slower still: float32, and the line says why.
    slower = precision.choose(_table(0.52, 0.4), CPU_BF16, requested)
    assert slower.policy == "float32" and slower.warning is None
    assert slower.reason == (
        f"{asked}: mixed_bfloat16 0.52x float32's speed on this CPU, under the 1.1x needed (probe): "
        "using float32; --precision=mixed_bfloat16 forces it"
    )
    # On a CPU float16 never wins (its training costs more than the probe shows); the table keeps it.
    assert precision.choose(_table(1.2, 2.0), CPU_PLAIN, requested).policy == "mixed_bfloat16"
    fp16_only = precision.choose(_table(0.5, 2.0), CPU_PLAIN, requested)
    assert fp16_only.policy == "float32" and "mixed_bfloat16 0.50x" in fp16_only.reason


def test_margin_edges():
    exactly = {"float32": {"matmul": 1.1, "conv": 1.1}, "bfloat16": {"matmul": 1.0, "conv": 1.0}}
    exactly["float16"] = {"matmul": 5.0, "conv": 5.0}
    assert precision.MARGIN == 1.1
    assert precision.choose(exactly, CPU_PLAIN, "auto").policy == "mixed_bfloat16"
    just_under = dict(exactly, float32={"matmul": 1.09, "conv": 1.09})
    assert precision.choose(just_under, CPU_PLAIN, "auto").policy == "float32"


def test_gpu_keeps_compute_capability_rule_unless_probe_disagrees():
    # float16 fastest, as on a Tensor Core GPU: the rule's mixed_float16 stands.
    kept = precision.choose(_table(2.5, 3.0), AMPERE, "mixed", "cached 2026-12-04")
    assert kept.policy == "mixed_float16"
    assert kept.reason == "--mixed on GPU; mixed_float16 3.00x float32's speed (probe cached 2026-12-04)"
    # On a GPU the fastest half precision replaces a rule's choice the probe finds slower.
    assert precision.choose(_table(1.5, 0.9), AMPERE, "mixed").policy == "mixed_bfloat16"
    # Even below the margin (but not slower), the rule's choice stands on a GPU.
    assert precision.choose(_table(1.0, 1.05), AMPERE, "auto").policy == "mixed_float16"
    # The probe finds float16 slower than float32 on this GPU: it overrides, and says so.
    overridden = precision.choose(_table(0.9, 0.8), AMPERE, "auto")
    assert overridden.policy == "float32"
    assert "overrides the compute-capability rule's mixed_float16, 0.80x" in overridden.reason


def test_explicit_policies_tpu_and_several_workers_never_measure():
    for policy in precision.POLICIES:
        choice = precision.resolve(policy, CPU_PLAIN, timings=_never)
        assert choice.policy == policy and choice.reason == "requested"
    assert precision.resolve("auto", TPU, timings=_never).policy == "mixed_bfloat16"
    # Every worker must run the same policy: the hardware rule decides, and the card says so.
    several = precision.resolve("mixed", CPU_BF16, timings=_never, workers=2)
    assert several.policy == "mixed_bfloat16"
    assert several.reason == "--mixed on CPU; 2 workers: by rule, not measured"


def test_switch(monkeypatch):
    monkeypatch.setenv(probe.ENVIRONMENT_VARIABLE, "off")
    off = precision.resolve("mixed", CPU_PLAIN)
    assert off.policy == "mixed_bfloat16" and off.reason == "--mixed on CPU; TFMP_PRECISION_PROBE=off"
    monkeypatch.setenv(probe.ENVIRONMENT_VARIABLE, "sometimes")
    with pytest.raises(UsageError, match="^TFMP_PRECISION_PROBE='sometimes': use on .* or off$"):
        precision.resolve("auto", CPU_PLAIN)


def _mismatched_matmul(dtype):
    """A workload whose op really fails: a matmul of shapes that do not fit."""
    left, right = tf.ones((4, 3), dtype), tf.ones((5, 2), dtype)
    return tf.function(lambda: tf.reduce_sum(tf.cast(tf.matmul(left, right), tf.float32)))


@pytest.mark.parametrize("requested, rule_policy", [("mixed", "mixed_bfloat16"), ("auto", "float32")])
def test_failed_probe_falls_back_to_rule_with_one_warning_line(tmp_path, requested, rule_policy):
    cache = tmp_path / "precision_probe.json"

    def failing():
        return probe.cached_timings(str(cache), lambda: probe.measure({"matmul": _mismatched_matmul}))

    choice = precision.resolve(requested, CPU_PLAIN, timings=failing)
    assert choice.policy == rule_policy
    assert choice.warning.startswith("precision probe failed (ValueError: Dimensions must be equal")
    assert "\n" not in choice.warning
    assert f"chose {rule_policy} by rule" in choice.warning
    assert not cache.exists()
    # A table that lacks a dtype is a failed probe too.
    partial = precision.resolve(requested, CPU_PLAIN, timings=lambda: ({"float32": {"conv": 1.0}}, ""))
    assert partial.policy == rule_policy and "KeyError" in partial.warning


class _Counting:
    def __init__(self, table):
        self.table, self.calls = table, 0

    def __call__(self):
        self.calls += 1
        return self.table


def test_cache_written_reused_and_keyed_by_host(tmp_path, monkeypatch):
    cache = tmp_path / "cache" / "tfmp" / "precision_probe.json"
    measure = _Counting(_table(0.5, 0.25))
    assert probe.cached_timings(str(cache), measure) == (measure.table, "measured now")
    table, note = probe.cached_timings(str(cache), measure)
    assert table == measure.table and note.startswith("cached 20") and measure.calls == 1
    stored = json.loads(cache.read_text())
    (entry,) = stored["entries"].values()
    assert entry["host"]["tensorflow"] == tf.__version__ and "cpu_flags" in entry["host"]
    # Another oneDNN setting is another host key: measured again, both tables kept.
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0" if entry["host"]["TF_ENABLE_ONEDNN_OPTS"] == "1" else "1")
    assert probe.cached_timings(str(cache), measure)[1] == "measured now" and measure.calls == 2
    assert len(json.loads(cache.read_text())["entries"]) == 2
    # Its place: $XDG_CACHE_HOME, else ~/.cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert probe.cache_path() == str(tmp_path / "xdg" / "tfmp" / "precision_probe.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert probe.cache_path() == str(tmp_path / "home" / ".cache" / "tfmp" / "precision_probe.json")


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"version": 1, "entries": []}', "[]", "NaN-TABLE", "\x00\xff"],
)
def test_corrupt_cache_is_measured_again_and_rewritten(tmp_path, content):
    cache = tmp_path / "precision_probe.json"
    measure = _Counting(_table(1.5, 0.5))
    if content == "NaN-TABLE":  # the right shape, but a time that is not a number
        probe.cached_timings(str(cache), _Counting(_table(1.5, 0.5)))
        content = cache.read_text().replace("0.004", "NaN")
    cache.write_text(content, encoding="utf-8", errors="surrogateescape")
    assert probe.cached_timings(str(cache), measure) == (measure.table, "measured now")
    assert probe.cached_timings(str(cache), measure)[1].startswith("cached") and measure.calls == 1


def test_unwritable_cache_is_used_uncached(tmp_path):
    measure = _Counting(_table(1.5, 0.5))
    (tmp_path / "a_file").write_text("")
    beneath_a_file = tmp_path / "a_file" / "tfmp" / "precision_probe.json"
    table, note = probe.cached_timings(str(beneath_a_file), measure)
    assert table == measure.table and note == "measured now, not cached (Not a directory)"
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(read_only)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"needs a read-only tmpfs mount: {mounted.stderr.decode().strip()}")
    try:
        table, note = probe.cached_timings(str(read_only / "precision_probe.json"), measure)
        assert table == measure.table and note == "measured now, not cached (Read-only file system)"
        choice = precision.resolve(
            "mixed",
            CPU_PLAIN,
            timings=lambda: probe.cached_timings(str(read_only / "tfmp" / "p.json"), measure),
        )
        assert choice.policy == "mixed_bfloat16" and choice.warning is None and "not cached" in choice.reason
    finally:
        subprocess.run(["umount", "-l", str(read_only)], capture_output=True)


def test_real_probe_on_this_host(tmp_path):
    cache = str(tmp_path / "precision_probe.json")
    table, note = probe.cached_timings(cache)
    assert note == "measured now" and set(table) == set(probe.DTYPES)
    assert all(math.isfinite(seconds) and seconds > 0 for row in table.values() for seconds in row.values())
    again, note = probe.cached_timings(cache)
    assert again == table and note.startswith("cached")
    for requested in ("auto", "mixed"):
        choice = precision.resolve(requested, CPU_PLAIN, timings=lambda: probe.cached_timings(cache))
        assert (
            choice.policy in precision.POLICIES
            and choice.warning is None
            and "(probe cached" in choice.reason
        )
    printed = probe.format_table(table)
    assert printed.splitlines()[1].split() == list(probe.DTYPES) and "vs float32" in printed


@pytest.mark.slow
def test_app_with_mixed_runs_float32_and_its_run_card_says_why(tmp_path):
    """apps.classify --mixed with the probe on, reading a cached table (written here for this
    host's key) where bfloat16 runs at half float32's speed: the run is float32, the card says why."""
    cache = tmp_path / "cache"
    probe.cached_timings(str(cache / "tfmp" / probe.CACHE_FILE), lambda: _table(0.5, 0.25))
    result = run_python(
        ["-m", "apps.classify", "--mixed", "--model=lenet", "--dataset=digits", "--image_size=16"]
        + ["--global_batch_size=8", "--steps=2", f"--model_dir={tmp_path / 'run'}"],
        env={probe.ENVIRONMENT_VARIABLE: "on", "XDG_CACHE_HOME": str(cache)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.load(open(tmp_path / "run" / "run_card.json"))
    assert card["precision"].startswith(
        "float32 (--mixed: mixed_bfloat16 0.50x float32's speed on this CPU, under the 1.1x needed "
        "(probe cached 20"
    )
    assert card["precision"].endswith("): using float32; --precision=mixed_bfloat16 forces it)")
    assert "precision float32" in result.stdout


@pytest.mark.slow
def test_app_with_an_unwritable_cache_measures_and_runs(tmp_path):
    """The cache directory cannot be made (its parent is a file): the app measures, runs on, and
    the card says the table was not cached; a bad TFMP_PRECISION_PROBE is one error line."""
    (tmp_path / "a_file").write_text("")
    app = ["-m", "apps.classify", "--mixed", "--model=lenet", "--dataset=digits", "--image_size=16"]
    app += ["--global_batch_size=8", "--steps=2"]
    result = run_python(
        app + [f"--model_dir={tmp_path / 'run'}"],
        env={probe.ENVIRONMENT_VARIABLE: "on", "XDG_CACHE_HOME": str(tmp_path / "a_file")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.load(open(tmp_path / "run" / "run_card.json"))
    assert "(probe measured now, not cached (Not a directory))" in card["precision"]
    assert (
        "Traceback" not in result.stdout + result.stderr and "WARNING: precision probe" not in result.stdout
    )
    refused = run_python(app + [f"--model_dir={tmp_path / 'refused'}"], env={probe.ENVIRONMENT_VARIABLE: "1"})
    assert refused.returncode == 2 and not (tmp_path / "refused").exists()
    assert "error: TFMP_PRECISION_PROBE='1': use on (measure, the default) or off" in refused.stderr
