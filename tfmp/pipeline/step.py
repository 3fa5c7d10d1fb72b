"""The GPipe step of a `pipeline.Plan`: the engine's `gradients=` hook, and a staged forward pass.

    engine = Engine(strategy, model, optimizer, gradients=pipeline.gradients_fn(plan))

`gradients_fn(plan)(engine, x, y, sample_weight) -> (y_pred, loss, gradients)`, per replica:

1. the batch is cut into M equal micro-batches;
2. forward: micro-batch m runs through stage 1..K, each stage under `tf.device(stage.device)`
   in a tape of its own that watches the activation entering the stage; the last stage also
   computes the engine's compiled loss (`engine._loss`) of the micro-batch, weighted by
   micro-batch rows / batch rows (Keras' mean losses are per micro-batch), times the loss scale;
3. backward, stage K down to 1, under each stage's device: d(loss)/d(stage variables, incoming
   activation), then d(activation)/d(earlier stage) with `output_gradients` - so every gradient
   op runs on its stage's device (one tape over all stages would leave them unplaced);
4. gradients summed over micro-batches on the stage's device; the engine applies them once.

The runtime runs ops as soon as their inputs are ready, so stage 1's forward of micro-batch m+1
overlaps stage 2's work on micro-batch m: GPipe's fill/drain schedule follows from dataflow.

Regularisers: every micro-batch's compiled loss contains `model.losses` (the weight penalties);
the micro-batch weights sum to 1, so they count once per step, and their gradients w.r.t. an
earlier stage's variables are taken on that stage's device. BatchNormalization normalises
per micro-batch (as in GPipe) and updates its moving averages M times a step, so a model with
BatchNorm does not train exactly like the unsplit model; chains without it do.

XLA (`Engine(xla=True)`): each stage's forward is one `jit_compile` function on its device
(its gradient is compiled too). The loss, the micro-batch split/concatenation and the gradient
sums stay outside: XLA compiles for one device, and a whole-model cluster would span K.
"""

from __future__ import annotations

import tensorflow as tf

from tfmp.errors import UsageError


def _split(structure, micro_batches: int):
    """A list of M structures, each the next 1/M of every tensor's rows (None stays None)."""
    if structure is None:
        return [None] * micro_batches
    parts = [tf.split(tensor, micro_batches, axis=0) for tensor in tf.nest.flatten(structure)]
    return [tf.nest.pack_sequence_as(structure, [part[m] for part in parts]) for m in range(micro_batches)]


def _check_rows(x, plan) -> None:
    rows = tf.nest.flatten(x)[0].shape[0]
    if rows is not None:
        plan.check_batch(rows)


def _stage_calls(plan, xla: bool):
    """Each stage's forward function, jit-compiled per stage when the engine uses XLA."""

    def call(stage):
        function = lambda inputs: stage.model(inputs, training=True)  # noqa: E731
        return tf.function(function, jit_compile=True) if xla else function

    return [call(stage) for stage in plan.stages]


def forward_fn(plan):
    """`fn(engine, x, training) -> y_pred`: the model's forward pass stage by stage, each stage on
    its device (and XLA-compiled per stage with `engine.xla`), for evaluation and prediction."""
    cache = {}

    def forward(engine, x, training):
        key = (bool(engine.xla), bool(training))
        if key not in cache:
            cache[key] = [
                tf.function(lambda inputs, s=stage: s.model(inputs, training=training), jit_compile=True)
                if engine.xla
                else (lambda inputs, s=stage: s.model(inputs, training=training))
                for stage in plan.stages
            ]
        for stage, call in zip(plan.stages, cache[key]):
            with tf.device(stage.device):
                x = call(x)
        return x

    return forward


def _stage_variables(plan, model):
    """Per stage, the indices (into model.trainable_variables) of its trainable variables."""
    owner = {}
    for stage in plan.stages:
        for variable in stage.model.trainable_variables:
            owner[id(variable)] = stage.index
    indices = [[] for _ in plan.stages]
    for position, variable in enumerate(model.trainable_variables):
        if id(variable) not in owner:
            raise UsageError(
                f"trainable variable {variable.path} belongs to no pipeline stage; "
                "a pipeline trains the variables of the model's layers only"
            )
        indices[owner[id(variable)]].append(position)
    return indices


def _forward(engine, plan, calls, x_m, y_m, sw_m, weight):
    """One micro-batch through every stage: (tapes, stage inputs, y_pred, weighted loss, scaled)."""
    tapes, entering, activation = [], [], x_m
    for stage, call in zip(plan.stages, calls):
        last = stage.index == len(plan.stages) - 1
        # The last tape is asked twice per earlier stage (regulariser gradients): persistent.
        with tf.device(stage.device), tf.GradientTape(persistent=last) as tape:
            if stage.index:
                tape.watch(activation)
            entering.append(activation)
            activation = call(activation)
            if last:
                loss = engine._loss(x_m, y_m, activation, sw_m, training=True)
                loss = tf.cast(loss, tf.float32) * weight
                scaled = engine.optimizer.scale_loss(loss)
        tapes.append(tape)
    return tapes, entering, activation, loss, scaled


def _backward(plan, variables, tapes, entering, outputs, scaled, regularised):
    """Gradients of one micro-batch per stage (lists aligned with `variables`), each computed
    under its stage's device: last stage from the loss, earlier ones from the activation."""
    gradients, upstream = [None] * len(plan.stages), None
    for stage in reversed(plan.stages):
        k, own = stage.index, variables[stage.index]
        sources = own + ([entering[k]] if k else [])
        with tf.device(stage.device):
            if k == len(plan.stages) - 1:
                result = tapes[k].gradient(scaled, sources)
            else:
                result = tapes[k].gradient(outputs[k], sources, output_gradients=upstream)
                if regularised:  # the penalties on this stage's weights were taken in the last tape
                    penalty = tapes[-1].gradient(scaled, own)
                    result = [
                        g if p is None else (p if g is None else g + p)
                        for g, p in zip(result, list(penalty) + [None])
                    ]
        gradients[k], upstream = result[: len(own)], (result[len(own)] if k else None)
    return gradients


def gradients_fn(plan):
    """The engine's `gradients=` hook running `plan` as a GPipe pipeline; see the module docstring.

    Returns `fn(engine, x, y, sample_weight) -> (y_pred, loss, gradients)`: y_pred the
    concatenated micro-batch outputs (for metrics), loss the unscaled batch loss, gradients
    those of `engine.optimizer.scale_loss(loss)` in `model.trainable_variables` order.
    """
    state = {}

    def compute(engine, x, y, sample_weight):
        if engine.model is not plan.model:
            raise UsageError(
                f"the pipeline plan was made for model {plan.model.name!r}, not {engine.model.name!r}"
            )
        _check_rows(x, plan)
        if engine.xla not in state:
            state[engine.xla] = _stage_calls(plan, engine.xla)
        calls = state[engine.xla]
        trainable = engine.model.trainable_variables
        indices = _stage_variables(plan, engine.model)
        variables = [[trainable[i] for i in stage] for stage in indices]
        regularised = bool(engine.model.losses)
        micro = plan.micro_batches
        weight = 1.0 / micro  # equal micro-batches: rows_m / rows
        predictions, losses, per_variable = [], [], [[] for _ in trainable]
        forwards = [
            _forward(engine, plan, calls, x_m, y_m, sw_m, weight)
            for x_m, y_m, sw_m in zip(_split(x, micro), _split(y, micro), _split(sample_weight, micro))
        ]
        for tapes, entering, y_pred, loss, scaled in forwards:
            outputs = entering[1:] + [y_pred]
            gradients = _backward(plan, variables, tapes, entering, outputs, scaled, regularised)
            for stage_indices, stage_gradients in zip(indices, gradients):
                for position, gradient in zip(stage_indices, stage_gradients):
                    if gradient is not None:
                        per_variable[position].append(gradient)
            predictions.append(y_pred)
            losses.append(loss)
        summed = [None] * len(trainable)
        for stage in plan.stages:
            with tf.device(stage.device):  # accumulate where the gradients were made
                for position in indices[stage.index]:
                    if per_variable[position]:
                        summed[position] = tf.add_n(per_variable[position])
        y_pred = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *predictions)
        return y_pred, tf.add_n(losses), summed

    return compute
