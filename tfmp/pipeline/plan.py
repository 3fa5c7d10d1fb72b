"""Model parallelism: split a Keras model over devices and train it as a GPipe pipeline.

    from tfmp.pipeline import plan as pipeline
    devices = pipeline.stage_devices(2)                    # ["/CPU:0", "/CPU:1"], or 2 GPUs
    with tf.distribute.get_strategy().scope():             # the default strategy: one worker
        model = tfmp.models.build("seed_cnn", (32, 32, 3), 10)
        plan = pipeline.plan(model, devices, micro_batches=4)   # or boundaries=["seed_cnn_conv3"]
        pipeline.place(model, plan)                        # before compile: variables -> stages
    model.compile(optimizer, loss, metrics)
    plan.check_batch(per_replica_batch=64)
    engine = Engine(strategy, model, optimizer, gradients=pipeline.gradients_fn(plan))
    plan.describe()                                        # for the run card

A functional (or Sequential) model is cut at layer boundaries into K stages, stage k living on
device k. A layer can start a stage only where exactly one tensor crosses the cut (a chain:
ResNet blocks with skips can be cut between blocks only). Boundaries are named by the user or
balanced by counted FLOPs (`models.count_flops`) or parameters. `place` re-creates each stage's
variables on its device (same `keras.Variable` objects, so checkpoints and the optimizer see the
unsplit model). `gradients_fn` (in `pipeline_step`) is the engine's `gradients=` hook: the GPipe
schedule, per-stage backward on each stage's device, one optimizer step per global batch.

Why not `keras.distribution.ModelParallel`: it does nothing on the TensorFlow backend.
Strategies: the default strategy on one worker (the pipeline is the device plan; Mirrored and
OneDevice strategies pin every variable and op to their replica devices, so they are refused).
On several workers, MultiWorkerMirroredStrategy with one replica per worker
(`distribute.get_strategy("multi_worker", one_replica_per_worker=True)`): each worker builds and
places its model outside the strategy's scope, so its variables are its own on its stage
devices, and the engine all-reduces the stage gradients across workers (docs/pipeline.md):

    strategy = distribute.get_strategy("multi_worker", one_replica_per_worker=True)
    model = build()                                        # no scope: this worker's variables
    plan = pipeline.plan(model, pipeline.stage_devices(2)); pipeline.place(model, plan)
    optimizer = keras.optimizers.SGD(0.1)                  # no scope either: built next to them
    with strategy.scope():
        model.compile(optimizer, loss, metrics)           # metrics summed over workers
    engine = Engine(strategy, model, gradients=pipeline.gradients_fn(plan),
                    forward=pipeline.forward_fn(plan))
"""

from __future__ import annotations

import dataclasses
import math
import types

import keras
import tensorflow as tf

from tfmp import compat, models
from tfmp.errors import UsageError, unknown
from tfmp.pipeline.step import forward_fn, gradients_fn  # noqa: F401  (re-exported API)

BALANCES = ("flops", "params")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: a sub-model of consecutive layers and the device it runs on."""

    index: int
    device: str
    layers: tuple[str, ...]
    model: keras.Model  # shares its layers (and variables) with the whole model
    parameters: int
    flops: int  # forward FLOPs of one example
    activation_elements: int  # elements of every layer output of one example (for memory)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The split of one model into stages, and the micro-batching of each replica's batch."""

    model: keras.Model
    stages: tuple[Stage, ...]
    micro_batches: int
    balance: str  # "flops", "params" or "boundaries" (named by the user)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(stage.device for stage in self.stages)

    @property
    def bubble(self) -> float:
        """GPipe's idle fraction (K-1)/(M+K-1) with K stages and M micro-batches."""
        stages = len(self.stages)
        return (stages - 1) / (self.micro_batches + stages - 1)

    def check_batch(self, per_replica_batch: int, workers: int = 1) -> int:
        """Rows per micro-batch; refuses a per-replica batch that M does not divide."""
        return check_batch(self.micro_batches, per_replica_batch, workers)

    def describe(self) -> dict:
        """For the run card: each stage's device, layers, parameters and FLOPs, and the bubble."""
        return {
            "stages": len(self.stages),
            "micro_batches": self.micro_batches,
            "balance": self.balance,
            "bubble": round(self.bubble, 4),
            "per_stage": [
                {
                    "device": s.device,
                    "layers": f"{s.layers[0]}..{s.layers[-1]}",
                    "num_layers": len(s.layers),
                    "parameters": s.parameters,
                    "flops_per_example": s.flops,
                }
                for s in self.stages
            ],
        }


def _check_micro_batches(micro_batches) -> None:
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise UsageError(f"--micro_batches={micro_batches} must be a positive integer, e.g. 4")


def check_batch(micro_batches: int, per_replica_batch: int, workers: int = 1) -> int:
    """Rows per micro-batch; refuses a per-replica batch that `micro_batches` does not divide.
    With a pipeline on each of `workers` workers the replica is the worker: its share of the
    global batch is cut into the micro-batches."""
    _check_micro_batches(micro_batches)
    if per_replica_batch % micro_batches:
        lower = per_replica_batch // micro_batches * micro_batches
        batch = (
            f"the per-worker batch {per_replica_batch} (global batch {per_replica_batch * workers} "
            f"over {workers} workers)"
            if workers > 1
            else f"the per-replica batch {per_replica_batch}"
        )
        raise UsageError(
            f"--micro_batches={micro_batches} does not divide {batch}; use a "
            f"{'global ' if workers > 1 else ''}batch that is a multiple of {micro_batches * workers} "
            f"(e.g. {(lower or micro_batches) * workers}) or other micro-batches"
        )
    return per_replica_batch // micro_batches


def stage_devices(stages: int) -> list[str]:
    """The first `stages` local devices: GPUs, else the logical CPUs of `distribute.split_cpu`."""
    if stages < 2:
        raise UsageError(
            f"--pipeline_stages={stages}: a pipeline needs at least 2 stages; "
            "leave the flag out to train the model on one device"
        )
    gpus = tf.config.list_logical_devices("GPU")
    devices = [device.name for device in (gpus or tf.config.list_logical_devices("CPU"))]
    if len(devices) < stages:
        raise UsageError(
            f"--pipeline_stages={stages} needs {stages} devices, this host has {len(devices)}; "
            f"use at most {len(devices)} stages (or --cpu_replicas={stages} logical CPUs)"
        )
    return devices[:stages]


def _graph(model: keras.Model):
    """(functional model, its layers in topological order, each layer's input tensor ids and
    output tensor ids, model input ids, model output ids); a Sequential's inner functional."""
    functional = compat.functional_graph(model)
    if functional is None:
        raise UsageError(
            f"model {model.name!r} is not a functional or built Sequential model; a pipeline "
            "splits a layer graph (build the Sequential with keras.Input first)"
        )
    layers, inputs, outputs = [], [], []
    for layer in functional.operations:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        nodes = compat.calls_in(functional, layer)
        if len(nodes) != 1:
            raise UsageError(
                f"layer {layer.name!r} is called {len(nodes)} times in model {model.name!r}; "
                "a pipeline needs every layer called once (shared layers cannot be split)"
            )
        layers.append(layer)
        inputs.append([id(t) for t in nodes[0].input_tensors])
        outputs.append([id(t) for t in nodes[0].output_tensors])
    return (
        functional,
        layers,
        inputs,
        outputs,
        [id(t) for t in functional.inputs],
        [id(t) for t in functional.outputs],
    )


def _crossing(position, inputs, outputs, model_inputs, model_outputs) -> set:
    """Ids of the tensors made before layer `position` and used from it on (or returned)."""
    made = set(model_inputs).union(*outputs[:position])
    used = set(model_outputs).union(*inputs[position:])
    return made & used


def _layer_cost(layer, balance: str) -> int:
    if balance == "params":
        return sum(math.prod(weight.shape) for weight in layer.weights)
    # count_flops only walks `.layers`: count one layer by handing it a one-layer "model".
    return models.count_flops(types.SimpleNamespace(layers=[layer]), batch_size=1)


def _balanced_cuts(costs: list[int], valid: list[int], stages: int) -> list[int]:
    """The K-1 cut positions among `valid` minimising the costliest stage, ties broken by the
    sum of squared stage costs (the more even split); exact dynamic programming."""
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    positions = [0] + valid + [len(costs)]
    # best[(j, s)]: ((max stage cost, sum of squares), cuts) for layers [0, positions[j]) in s stages.
    best = {(0, 0): ((0, 0), [])}
    for s in range(1, stages + 1):
        for j in range(1, len(positions)):
            if s == stages and j != len(positions) - 1:
                continue
            options = []
            for i in range(j):
                if (i, s - 1) in best:
                    (worst, squares), cuts = best[(i, s - 1)]
                    cost = prefix[positions[j]] - prefix[positions[i]]
                    options.append(
                        (
                            (max(worst, cost), squares + cost * cost),
                            cuts + ([positions[j]] if j < len(positions) - 1 else []),
                        )
                    )
            if options:
                best[(j, s)] = min(options, key=lambda option: option[0])
    return best[(len(positions) - 1, stages)][1]


def _named_cuts(boundaries, layers, valid, stages, model_name) -> list[int]:
    names = [layer.name for layer in layers]
    if len(boundaries) != stages - 1:
        raise UsageError(
            f"{len(boundaries)} pipeline boundaries give {len(boundaries) + 1} stages, but "
            f"there are {stages} devices; name {stages - 1} layer(s) that start a new stage"
        )
    cuts = []
    for name in boundaries:
        if name not in names:
            raise unknown(f"layer of model {model_name!r}", name, names)
        if names.index(name) not in valid:
            raise UsageError(
                f"cannot start a pipeline stage at layer {name!r}: more than one tensor (a skip "
                "connection or a second input) crosses there; cut at a layer of a plain chain"
            )
        cuts.append(names.index(name))
    if cuts != sorted(set(cuts)):
        raise UsageError(f"pipeline boundaries {list(boundaries)} must be distinct and in layer order")
    return cuts


def plan(
    model: keras.Model, devices, micro_batches: int = 4, boundaries=None, balance: str = "flops"
) -> Plan:
    """Splits `model` into len(devices) stages; see the module docstring.

    `boundaries`: names of the layers that start stages 2..K (None: balance automatically by
    `balance`, "flops" or "params"). Refuses, in one line, fewer than 2 devices, repeated
    devices, more stages than places to cut, invalid boundaries and micro_batches < 1.
    """
    devices = list(devices)
    if len(devices) < 2:
        raise UsageError(f"a pipeline needs at least 2 devices, got {devices}; train on one device instead")
    if len(set(devices)) != len(devices):
        raise UsageError(f"pipeline devices {devices} repeat a device; give each stage its own device")
    _check_micro_batches(micro_batches)
    if balance not in BALANCES:
        raise unknown("pipeline balance", balance, BALANCES)
    functional, layers, inputs, outputs, model_inputs, model_outputs = _graph(model)
    for layer in layers:
        if getattr(layer, "activity_regularizer", None) is not None:
            raise UsageError(
                f"layer {layer.name!r} has an activity regularizer, which a pipeline cannot "
                "count per micro-batch; use a weight regularizer or no pipeline"
            )
    valid = [
        p
        for p in range(1, len(layers))
        if len(_crossing(p, inputs, outputs, model_inputs, model_outputs)) == 1
        and not _crossing(p, inputs, outputs, model_inputs, model_outputs) & set(model_inputs)
    ]
    if len(devices) > len(valid) + 1:
        raise UsageError(
            f"model {model.name!r} can be cut in only {len(valid) + 1} stages ({len(layers)} "
            f"layers, {len(valid)} places where one tensor crosses); use at most "
            f"{len(valid) + 1} devices"
        )
    if boundaries:
        cuts, balance = _named_cuts(list(boundaries), layers, valid, len(devices), model.name), "boundaries"
    else:
        cuts = _balanced_cuts([_layer_cost(layer, balance) for layer in layers], valid, len(devices))
    return Plan(model, _stages(functional, layers, cuts, devices), micro_batches, balance)


def _stages(functional, layers, cuts, devices) -> tuple[Stage, ...]:
    edges = [0] + list(cuts) + [len(layers)]
    # The tensor entering each later stage is the input of the layer that starts it.
    boundary = [functional.input] + [layers[cut].input for cut in cuts] + [functional.output]
    stages = []
    for index, device in enumerate(devices):
        members = layers[edges[index] : edges[index + 1]]
        sub_model = keras.Model(boundary[index], boundary[index + 1], name=f"pipeline_stage_{index}")
        activations = sum(
            math.prod(tensor.shape[1:]) for layer in members for tensor in tf.nest.flatten(layer.output)
        )
        stages.append(
            Stage(
                index,
                device,
                tuple(layer.name for layer in members),
                sub_model,
                sum(math.prod(w.shape) for layer in members for w in layer.weights),
                sum(_layer_cost(layer, "flops") for layer in members),
                int(activations),
            )
        )
    return tuple(stages)


def _check_strategy(strategy: tf.distribute.Strategy) -> None:
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise UsageError(
            "place the pipeline outside MultiWorkerMirroredStrategy's scope: in it every variable "
            "becomes a MirroredVariable on the replica's device; build the model, place it and "
            "build the optimizer outside strategy.scope() (each worker's variables are its own) "
            "and compile in it"
        )
    if strategy.num_replicas_in_sync > 1 or isinstance(strategy, tf.distribute.OneDeviceStrategy):
        raise UsageError(
            f"a pipeline cannot run under {type(strategy).__name__}: it places every variable "
            "on its own replica devices, which are the pipeline's stages; use the default "
            "strategy (--strategy=default) with --pipeline_stages, or several workers"
        )


def place(model: keras.Model, plan: Plan) -> keras.Model:
    """Moves each stage's variables to its device, in place; returns `model`.

    Call it after `plan` and before `model.compile` builds the optimizer (its slots are then
    made next to each variable). The `keras.Variable` objects stay the same and get a new
    `tf.Variable` on the stage's device with the same value.
    """
    if plan.model is not model:
        raise UsageError(f"the pipeline plan was made for model {plan.model.name!r}, not {model.name!r}")
    _check_strategy(tf.distribute.get_strategy())
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        raise UsageError(
            f"model {model.name!r}'s optimizer is already built next to the unplaced variables; "
            "call pipeline.place before model.compile"
        )
    for stage in plan.stages:
        for name in stage.layers:
            for variable in model.get_layer(name).variables:
                if not compat.is_created(variable):
                    raise UsageError(f"variable {variable.path} is not built yet; build the model first")
                with tf.init_scope(), tf.device(stage.device):
                    compat.recreate_on_current_device(variable)
    return model
