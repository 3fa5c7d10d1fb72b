"""Where a training step's time goes, layer by layer, in float32 and in mixed_bfloat16.

    python -m apps.bench --layer_profile=retinanet_tiny,faster_rcnn_tiny --image_size=128 --global_batch_size=16
    result = layer_profile.profile({"float32": model, "mixed_bfloat16": mixed_model}, inputs, repeats=20)

`profile` takes the same functional Keras model built in each policy (so float32-by-design
layers stay float32) and one real input batch. It records every layer call with
`keras.models.clone_model(..., clone_function=lambda layer: layer, call_function=...)` (a shared
layer, e.g. a RetinaNet head conv applied to P3, P4 and P5, gives one call per level), replays
the calls eagerly on the batch to get each call's real inputs, then times each call's forward
and backward alone: `layer(inputs)` under a `tf.GradientTape` in a `tf.function`, gradients of
the layer's trainable variables and of the inputs that carry a gradient in training (float
inputs that depend on a trainable variable, as the replay finds out), upstream gradients
random. Warm-up calls are untimed; every function is then called once per round for `repeats`
rounds, interleaved, and its median taken, so load drift hits both policies alike. Each time
includes one `tf.function` call's fixed cost (`call_overhead_ms`, an identity function's).

Next to the layers: the whole model's forward and backward in one `tf.function` (one graph: no
per-call cost, independent ops may run side by side, the graph optimiser may fuse across
layers, so it is below the sum of the layers), and the Cast ops of that graph (`get_operations()`):
how many each policy has, and the to/from-bfloat16 ones timed as `tf.cast`s of their shapes in
one graph (they are inside the layer rows already: a layer casts its inputs and reads its
float32 weights in its compute dtype). `measure` (the `layer_profile` cell of `tfmp.bench.cell`) adds
the Engine's whole training step (the policies' repeats interleaved too): what lies outside
the model's forward and backward (loss, anchor matching, optimizer) is step - model fwd+bwd,
and each layer class's share of the step is the model's fwd+bwd split in proportion to the
classes' isolated times.
Calls on CPU return when their kernels have run: no device sync is needed.
"""

from __future__ import annotations

import collections
import inspect
import statistics
import time
import warnings

import keras
import tensorflow as tf

WARMUP_CALLS = 2  # the first traces and optimises the graph, the second runs it once more


def record_calls(model: keras.Model):
    """(input KerasTensors, [(layer, args, kwargs, outputs)]): every layer call of functional
    `model` on symbolic tensors of a clone that shares the model's layers, inputs before use."""
    calls = []

    def call_function(layer, *args, **kwargs):
        outputs = layer(*args, **kwargs)
        calls.append((layer, args, kwargs, outputs))
        return outputs

    inputs = tf.nest.map_structure(lambda x: keras.Input(batch_shape=x.shape, dtype=x.dtype), model.input)
    with warnings.catch_warnings():
        # The clone is thrown away: its compile and input-naming warnings concern no one.
        warnings.simplefilter("ignore")
        keras.models.clone_model(
            model, input_tensors=inputs, clone_function=lambda layer: layer, call_function=call_function
        )
    return inputs, calls


def _training(layer) -> dict:
    return {"training": True} if "training" in inspect.signature(layer.call).parameters else {}


def _floating(structure) -> list:
    return [x for x in tf.nest.flatten(structure) if x.dtype.is_floating]


def replay(model: keras.Model, inputs) -> list[dict]:
    """Runs the recorded calls of `model` eagerly on `inputs`; per call: the layer, its index
    among the layer's calls, the flat real arguments, which of them carry a gradient in
    training, the argument structure and the call's float outputs."""
    symbolic_inputs, recorded = record_calls(model)
    values = {id(x): value for x, value in zip(tf.nest.flatten(symbolic_inputs), tf.nest.flatten(inputs))}
    varying = set()  # ids of symbolic tensors that depend on a trainable variable
    seen = collections.Counter()
    calls = []
    for layer, args, kwargs, outputs in recorded:
        symbolic = tf.nest.flatten((args, kwargs))
        flat = [values[id(x)] if isinstance(x, keras.KerasTensor) else x for x in symbolic]
        differentiable = [isinstance(x, keras.KerasTensor) and id(x) in varying for x in symbolic]
        with tf.GradientTape(persistent=True) as tape:
            for value, watch in zip(flat, differentiable):
                if watch:
                    tape.watch(value)
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), flat)
            result = layer(*call_args, **call_kwargs, **_training(layer))
        sources = [*layer.trainable_variables, *(v for v, watch in zip(flat, differentiable) if watch)]
        for output, value in zip(tf.nest.flatten(outputs), tf.nest.flatten(result)):
            values[id(output)] = value
            # stop_gradient inside a layer (e.g. proposals) cuts the path: the tape knows.
            if value.dtype.is_floating and sources:
                if any(gradient is not None for gradient in tape.gradient(value, sources)):
                    varying.add(id(output))
        del tape
        calls.append(
            {
                "layer": layer,
                "call": seen[layer.name],
                "flat": flat,
                "differentiable": differentiable,
                "structure": (args, kwargs),
                "outputs": _floating(result),
            }
        )
        seen[layer.name] += 1
    return calls


def _upstream(outputs: list) -> list:
    """Random upstream gradients, one per float output, in its dtype."""
    return [tf.cast(tf.random.normal(tf.shape(x)), x.dtype) for x in outputs]


def layer_function(call: dict):
    """(tf.function, its arguments): the call's forward and backward on its real inputs."""
    layer, flat, differentiable = call["layer"], call["flat"], call["differentiable"]
    positions = [index for index, value in enumerate(flat) if tf.is_tensor(value)]

    def forward_backward(tensors, upstream):
        filled = list(flat)
        with tf.GradientTape() as tape:
            for index, tensor in zip(positions, tensors):
                filled[index] = tensor
                if differentiable[index]:
                    tape.watch(tensor)
            args, kwargs = tf.nest.pack_sequence_as(call["structure"], filled)
            outputs = _floating(layer(*args, **kwargs, **_training(layer)))
        watched = [filled[index] for index in positions if differentiable[index]]
        sources = [*layer.trainable_variables, *watched]
        if not sources:
            return outputs
        gradients = tape.gradient(outputs, sources, output_gradients=upstream)
        return [gradient for gradient in gradients if gradient is not None]

    arguments = ([flat[index] for index in positions], _upstream(call["outputs"]))
    return tf.function(forward_backward), arguments


def model_function(model: keras.Model, inputs):
    """(tf.function, its arguments): the whole model's forward and backward, as one graph."""

    def forward_backward(inputs, upstream):
        with tf.GradientTape() as tape:
            outputs = _floating(model(inputs, training=True))
        gradients = tape.gradient(outputs, model.trainable_variables, output_gradients=upstream)
        return [gradient for gradient in gradients if gradient is not None]

    return tf.function(forward_backward), (inputs, _upstream(_floating(model(inputs, training=True))))


def count_casts(function, arguments) -> collections.Counter:
    """(source dtype, target dtype, shape or None when not static) -> number of Cast ops in the
    graph `function` traces for `arguments`."""
    graph = function.get_concrete_function(*arguments).graph
    found = collections.Counter()
    for operation in graph.get_operations():
        if operation.type == "Cast":
            shape = operation.inputs[0].shape
            key_shape = tuple(shape.as_list()) if shape.is_fully_defined() else None
            found[(operation.inputs[0].dtype.name, operation.outputs[0].dtype.name, key_shape)] += 1
    return found


def casts_function(casts: collections.Counter):
    """(tf.function, its arguments) or None: every to/from-bfloat16 Cast op of `casts` (those of
    static shape) as a `tf.cast` of a random tensor of its shape and dtype, all in one graph."""
    keys = [
        key
        for key, count in casts.items()
        if "bfloat16" in key[:2] and key[2] is not None
        for _ in range(count)
    ]
    if not keys:
        return None
    tensors = [tf.cast(tf.random.normal(shape), source) for source, _, shape in keys]

    def cast_all(tensors):
        return [tf.cast(tensor, target) for tensor, (_, target, _) in zip(tensors, keys)]

    return tf.function(cast_all), (tensors,)


def time_interleaved(functions: list, repeats: int) -> list[float]:
    """Median seconds of each (function, arguments): warm-up calls first, then `repeats`
    rounds that call every function once, in turn."""
    for function, arguments in functions:
        for _ in range(WARMUP_CALLS):
            function(*arguments)
    samples = [[] for _ in functions]
    for _ in range(repeats):
        for times, (function, arguments) in zip(samples, functions):
            started = time.perf_counter()
            function(*arguments)
            times.append(time.perf_counter() - started)
    return [statistics.median(times) for times in samples]


def _plan(models: dict, inputs) -> tuple[list, list, dict]:
    """Every function to time with its owner key, and each policy's recorded calls and casts."""
    functions = [(tf.function(lambda tensor: tensor), (tf.zeros([1]),))]  # a call's fixed cost
    owners = [("overhead",)]
    plans = {}
    for policy, model in models.items():
        calls = replay(model, inputs)
        for call in calls:
            functions.append(layer_function(call))
            owners.append((policy, "layer", call["layer"].name, call["call"]))
        step, arguments = model_function(model, inputs)
        functions.append((step, arguments))
        owners.append((policy, "model"))
        casts = count_casts(step, arguments)
        timed_casts = casts_function(casts)
        if timed_casts:
            functions.append(timed_casts)
            owners.append((policy, "casts"))
        plans[policy] = {"calls": calls, "casts": casts}
    return functions, owners, plans


def _layer_rows(policies: list, plans: dict, milliseconds: dict) -> list[dict]:
    rows = []
    for call in plans[policies[0]]["calls"]:
        layer, key = call["layer"], (call["layer"].name, call["call"])
        rows.append(
            {
                "name": layer.name,
                "class": type(layer).__name__,
                "call": call["call"],
                "input_shapes": [list(value.shape) for value in call["flat"] if tf.is_tensor(value)],
                "parameters": layer.count_params(),
                "ms": {policy: milliseconds[(policy, "layer", *key)] for policy in policies},
            }
        )
    return rows


def _class_rows(policies: list, layers: list[dict]) -> list[dict]:
    """Layer rows summed by layer class, the most expensive (in the first policy) first."""
    classes = {}
    for row in layers:
        entry = classes.setdefault(
            row["class"],
            {"class": row["class"], "layers": set(), "calls": 0, "ms": dict.fromkeys(policies, 0.0)},
        )
        entry["layers"].add(row["name"])
        entry["calls"] += 1
        for policy in policies:
            entry["ms"][policy] += row["ms"][policy]
    result = sorted(classes.values(), key=lambda entry: -entry["ms"][policies[0]])
    for entry in result:
        entry["layers"] = len(entry["layers"])
    return result


def _cast_summary(policy: str, casts: collections.Counter, milliseconds: dict) -> dict:
    bfloat16 = {key: count for key, count in casts.items() if "bfloat16" in key[:2]}
    return {
        "casts": sum(casts.values()),
        "bfloat16_casts": sum(bfloat16.values()),
        "bfloat16_casts_unknown_shape": sum(count for key, count in bfloat16.items() if key[2] is None),
        "bfloat16_cast_ms": milliseconds.get((policy, "casts"), 0.0),
    }


def profile(models: dict, inputs, repeats: int) -> dict:
    """Per-layer-call and per-class forward + backward milliseconds of `models` (policy ->
    the same functional model built in that policy; the first is the reference of every
    speedup) on the real batch `inputs`, the whole model's, and each graph's casts."""
    functions, owners, plans = _plan(models, inputs)
    seconds = time_interleaved(functions, repeats)
    milliseconds = {owner: 1000 * value for owner, value in zip(owners, seconds)}
    policies = list(models)
    layers = _layer_rows(policies, plans, milliseconds)
    classes = _class_rows(policies, layers)
    totals = {}
    for policy in policies:
        layers_ms = sum(row["ms"][policy] for row in layers)
        totals[policy] = {
            "layers_ms": layers_ms,
            "model_ms": milliseconds[(policy, "model")],
            **_cast_summary(policy, plans[policy]["casts"], milliseconds),
        }
    for row in [*layers, *classes]:
        row["speedup"] = _speedup(row["ms"], policies)
    return {
        "policies": policies,
        "repeats": repeats,
        "call_overhead_ms": milliseconds[("overhead",)],
        "calls": len(layers),
        "classes": classes,
        "totals": totals,
        "layers": layers,
    }


def _speedup(milliseconds: dict, policies: list) -> float | None:
    """Reference ms / the other policy's ms (> 1: the other policy is faster)."""
    reference, other = milliseconds[policies[0]], milliseconds[policies[-1]]
    return reference / other if other > 0 else None


def add_step(result: dict, step_repeats: dict) -> dict:
    """Adds the training step's milliseconds per policy (the median of `step_repeats`, each
    repeat's, kept as `step_ms_repeats`), what lies outside the model's forward and backward
    (loss, anchor matching, optimizer, the step's own ops), and each class's share of the step:
    the model's fwd+bwd in one graph split over the classes in proportion to their isolated
    times (alone, layers pay a call each and run no op beside another: their sum is larger)."""
    policies = result["policies"]
    step_ms = {policy: statistics.median(step_repeats[policy]) for policy in policies}
    for policy in policies:
        totals = result["totals"][policy]
        totals["step_ms"] = step_ms[policy]
        totals["step_ms_repeats"] = step_repeats[policy]
        totals["outside_model_ms"] = step_ms[policy] - totals["model_ms"]
        totals["model_share"] = totals["model_ms"] / step_ms[policy]
    for entry in result["classes"]:
        entry["share"] = {
            policy: entry["ms"][policy]
            / result["totals"][policy]["layers_ms"]
            * result["totals"][policy]["model_share"]
            for policy in policies
        }
    result["step_speedup"] = _speedup(step_ms, policies)
    return result


def time_steps(cell: dict, runs: dict, executions_per_repeat) -> dict:
    """Milliseconds of an Engine step per policy, each repeat's median. `runs[policy](n)` makes
    n host calls of `steps_per_execution` steps and returns their seconds; after the warm-up
    calls, `repeats` rounds call every policy in turn, so load drift hits them alike."""
    counts = {}
    for policy, executions in runs.items():
        counts[policy] = executions_per_repeat(cell, executions(cell["warmup_executions"])[-1])
    repeats = {policy: [] for policy in runs}
    for _ in range(cell["repeats"]):
        for policy, executions in runs.items():
            seconds = statistics.median(executions(counts[policy]))
            repeats[policy].append(1000 * seconds / cell["steps_per_execution"])
    return repeats


def measure(cell: dict, setup, time_engine, executions_per_repeat) -> dict:
    """The `layer_profile` cell. `tfmp.bench.cell` (which imports this module) passes its own
    `setup` of the cell's model, `_time_engine` and `_executions_per_repeat`. Builds the model
    in each of `cell["policies"]` as an engine cell does, profiles its layers on one batch of
    the cell's data (`layer_repeats` rounds), then times the Engine's training step of each."""
    strategy = tf.distribute.get_strategy()
    built = {policy: setup(cell, strategy, policy) for policy in cell["policies"]}
    element = next(iter(built[cell["policies"][0]][2](None)))
    inputs = element[0] if isinstance(element, tuple) else element  # (x, y) or (x,)
    result = profile({policy: parts[0] for policy, parts in built.items()}, inputs, cell["layer_repeats"])
    runs = {
        # The identity timer hands back the engine's `executions(n)`: the rounds are timed here.
        policy: time_engine(cell, strategy, model, optimizer, dataset_fn, lambda executions: executions)
        for policy, (model, optimizer, dataset_fn, _) in built.items()
    }
    return add_step(result, time_steps(cell, runs, executions_per_repeat))
