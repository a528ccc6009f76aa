"""Tools for code that XLA (and so a TPU) can compile.

* ``masked_sparse_crossentropy``: a loss that ignores labels marked negative without
  boolean indexing, whose output shape would depend on the data;
* ``tracing_count``: how many times a ``tf.function`` (such as Keras' train function)
  was traced;
* ``xla_target``: where this process can compile with XLA: the host CPU (the CPU build
  of TensorFlow), a connected TPU, or, in the ``tensorflow-tpu`` build off a TPU, the
  TPU compiler without a device (programs are built and inspected, not run);
* ``preflight``: a model and dataset checked against the TPU's rules on any machine,
  including one training step compiled with XLA.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from tpu_helpers.core.checks import FAIL, PASS, SKIP, WARN, Check, first_line
from tpu_helpers.core.errors import (
    EngineError,
    InputError,
    InputTypeError,
    NotFoundError,
    TpuHelpersError,
)
from tpu_helpers.core.messages import say
from tpu_helpers.core.metrics import logits_of
from tpu_helpers.core.validate import check_positive
from tpu_helpers.data.shapes import shape_report

__all__ = [
    "masked_sparse_crossentropy",
    "XlaTarget",
    "xla_target",
    "compiled_hlo",
    "compile_and_run",
    "explain_error",
    "try_compile",
    "tracing_count",
    "PreflightError",
    "PreflightReport",
    "translate_xla_error",
    "helpful_line",
    "dynamic_shape_ops",
    "STRATEGY_DEPENDENT",
    "preflight",
]


def masked_sparse_crossentropy(labels, logits):
    """Mean cross-entropy over the positions whose label is >= 0 (e.g. -100 is ignored).

    Shapes never depend on the data: the mask multiplies the per-position loss, and the
    sum is divided by the mask's sum (at least 1, so an all-masked batch gives 0, not NaN).
    """
    import tensorflow as tf

    logits = tf.cast(logits, tf.float32)  # bfloat16 counts exactly only up to 256
    mask = tf.cast(labels >= 0, tf.float32)
    safe_labels = tf.maximum(labels, 0)  # a valid class index; its loss is masked out anyway
    loss = tf.keras.losses.sparse_categorical_crossentropy(safe_labels, logits, from_logits=True)
    return tf.reduce_sum(loss * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)


@dataclass(frozen=True)
class XlaTarget:
    """Where ``compiled_hlo`` and ``preflight`` compile (and notebook tf/05's counting pass).

    Attributes:
        device: the TensorFlow device that runs compiled steps (``"/CPU:0"``,
            ``"/TPU:0"``), or ``None`` when compiled programs cannot run here.
        platform: the platform XLA builds programs for when no such device is here
            (``"TPU"``), else ``None``: the programs are those of ``device``.
        note: what this means, in one line (printed by the notebooks).
    """

    device: str | None
    platform: str | None
    note: str

    @property
    def runs(self) -> bool:
        """True when compiled steps can be run, not only built."""
        return self.device is not None

    @property
    def can_compile(self) -> bool:
        return self.device is not None or self.platform is not None


_TARGET: list[XlaTarget] = []


def xla_target(refresh: bool = False) -> XlaTarget:
    """Find where XLA compiles in this process, once (``refresh=True`` looks again).

    * A TPU that ``connect`` initialised: compile and run on ``/TPU:0``.
    * The CPU build of TensorFlow: compile and run on the host CPU.
    * The ``tensorflow-tpu`` build without a TPU (a TPU build rehearsed on a CPU, or a TPU
      VM before ``connect``): that build has no XLA backend for the host CPU
      ("could not find registered transfer manager for platform Host"), but it builds
      programs for the TPU platform without a device, so the compile checks still run;
      nothing compiled can be run.
    """
    if _TARGET and not refresh:
        return _TARGET[0]
    import tensorflow as tf

    def probe(x):
        return tf.reduce_sum(x * 2.0)

    x = tf.ones([2])
    if tf.config.list_logical_devices("TPU"):
        target = XlaTarget("/TPU:0", None, "XLA compiles and runs on the TPU")
    else:
        try:
            with tf.device("/CPU:0"):
                tf.function(probe, jit_compile=True)(x).numpy()
            target = XlaTarget("/CPU:0", None, "XLA compiles and runs on the host CPU")
        except Exception as host_error:  # noqa: BLE001  (the reason is kept in the note)
            reason = _last_line(str(host_error))
            try:
                tf.function(probe, jit_compile=True).experimental_get_compiler_ir(x)(
                    stage="hlo", platform_name="TPU"
                )
                target = XlaTarget(
                    None,
                    "TPU",
                    "this TensorFlow build cannot run XLA on the host CPU"
                    f" ({reason}); programs are built for the TPU compiler and inspected,"
                    " not run (connect to a TPU to run them)",
                )
            except Exception:  # noqa: BLE001
                target = XlaTarget(None, None, f"XLA cannot compile in this process: {reason}")
    _TARGET[:] = [target]
    return target


def compiled_hlo(function, *args) -> str:
    """The HLO text XLA compiles ``function`` (a Python function or a ``tf.function``
    with ``jit_compile=True``) to for these arguments, for ``xla_target()``: the current
    device where XLA runs, else the TPU compiler without a device."""
    import tensorflow as tf

    if not hasattr(function, "experimental_get_compiler_ir"):
        function = tf.function(function, jit_compile=True)
    target = xla_target()
    if target.platform and not target.runs:
        return _hlo_without_device(function, args, target.platform)
    with tf.device(target.device or "/CPU:0"):
        return function.experimental_get_compiler_ir(*args)(stage="hlo")


def _hlo_without_device(function, args, platform: str) -> str:
    """HLO for ``platform`` without one of its devices. TensorFlow builds such programs only
    for functions without resource arguments, so a function that reads variables (a model's
    training step) is first frozen: its variables become constants of the same shapes, and
    the program is otherwise the one the device would compile."""
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    concrete = function.get_concrete_function(*args)
    if not concrete.captured_inputs:
        return function.experimental_get_compiler_ir(*args)(stage="hlo", platform_name=platform)
    # one frozen wrapper per traced program, so that two batches of one shape are compared
    # as programs of the same function (a new wrapper would bring new names into the HLO)
    wrapper = _FROZEN.get(concrete)
    if wrapper is None:
        frozen = convert_variables_to_constants_v2(concrete)
        wrapper = tf.function(lambda *inputs: frozen(*inputs), jit_compile=True)
        _FROZEN[concrete] = wrapper
    flat = [t for t in tf.nest.flatten(args) if t is not None]
    return wrapper.experimental_get_compiler_ir(*flat)(stage="hlo", platform_name=platform)


_FROZEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_and_run(function, *args):
    """Compile ``function`` with XLA for ``xla_target()`` and, where programs run there,
    run it: returns its result, or ``None`` when the program could only be built.
    Compile errors propagate (translate them with ``translate_xla_error``)."""
    import tensorflow as tf

    target = xla_target()
    step = tf.function(function, jit_compile=True)
    if not target.runs:
        compiled_hlo(step, *args)
        return None
    with tf.device(target.device):
        return step(*args)


def explain_error(error: BaseException) -> str:
    """An error raised while compiling, as three lines: its first line, the rule it
    breaks (with the offending op when named) and the fix."""
    rule, op, fix = translate_xla_error(error)
    return (
        f"{type(error).__name__}: {first_line(error, 200)}\n  -> {rule}"
        + (f" (op {op})" if op else "")
        + f"\n  -> fix: {fix}"
    )


def try_compile(function, *args) -> bool:
    """``compile_and_run`` that prints what happened instead of raising: the result (its
    value, or its shape), "compiled" where programs are only built here, or the compile
    error explained (``explain_error``). Returns whether it compiled."""
    try:
        out = compile_and_run(function, *args)
    except Exception as err:  # noqa: BLE001  (showing the error is the point)
        say(explain_error(err))
        return False
    if out is None:
        say("compiled (for the TPU compiler; not run here)")
    else:
        say(f"compiled: {out.numpy() if out.shape.rank == 0 else out.shape}")
    return True


def tracing_count(function) -> int:
    """Times a ``tf.function`` was traced.

    Accepts the function or a Keras model (its ``train_function`` after ``fit``). With
    fully static input shapes every new shape is a new trace, so this counts compilations.
    With ``None`` dimensions in the dataset's spec one trace serves every width, while XLA
    (``jit_compile=True``, or a TPU) still compiles once per concrete shape: count those
    with ``shape_report``.
    """
    fn = getattr(function, "train_function", function)
    if fn is None:
        raise InputError("The model has no train_function yet: call fit first.")
    inner = getattr(fn, "experimental_get_tracing_count", None)
    if inner is None:  # Keras wraps the tf.function when steps_per_execution > 1
        inner = getattr(
            getattr(fn, "python_function", None), "experimental_get_tracing_count", None
        )
    if inner is None:
        raise InputTypeError(f"{fn!r} is not a tf.function.")
    return int(inner())


# --- preflight -------------------------------------------------------------------------
class PreflightError(TpuHelpersError, RuntimeError):
    """A preflight check failed; the message is the whole report, and ``report`` the
    ``PreflightReport`` (``report.failures``: the checks that failed)."""

    def __init__(self, report: PreflightReport):
        super().__init__(str(report))
        self.report = report


@dataclass(frozen=True)
class PreflightReport:
    checks: tuple

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def failures(self) -> list:
        return [c for c in self.checks if c.status == FAIL]

    def __getitem__(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise NotFoundError(f"no check named {name!r}: {[c.name for c in self.checks]}")

    def __str__(self) -> str:
        head = "preflight: " + (
            "ready for a TPU" if self.ok else f"{len(self.failures)} check(s) failed"
        )
        return "\n".join([head, *(str(c) for c in self.checks)])


# Error text from TensorFlow / XLA -> (rule, fix)
_TRANSLATIONS = (
    (
        "as a Python `bool`",
        "rule 1, no Python `if`/`while` on a tensor's value",
        "compute both results and pick with tf.where(cond, a, b), or use tf.cond with"
        " branches of the same shape",
    ),
    (
        "must be a compile-time constant",
        "rule 2, no shapes that depend on values",
        "keep shapes fixed: pad to a fixed width and multiply by a 0/1 mask instead of"
        " slicing or boolean indexing",
    ),
    (
        "Detected unsupported operations",
        "an op XLA cannot compile (it runs only on the host CPU)",
        "move it into the tf.data pipeline (strings, tokenization, py_function,"
        " numpy_function) so the training step sees numbers only",
    ),
)


def translate_xla_error(error: BaseException) -> tuple[str, str, str]:
    """``(rule broken, offending op or "", fix)`` for an error raised while compiling."""
    import re

    text = str(error)
    op = (
        re.search(r"on XLA_\w+: (\w+)", text)
        or re.search(r"op (\w+) must be", text)
        or re.search(r"\{\{node ([^}]+)\}\}", text)
    )
    op_name = op.group(1) if op else ""
    for needle, rule, fix in _TRANSLATIONS:
        if needle in text:
            return rule, op_name, fix
    return (
        f"XLA could not compile the step ({type(error).__name__})",
        op_name,
        helpful_line(text) or "see the error above",
    )


_NOISE = ("Traceback", 'File "', "in user code", "Stack trace", "Call stack", "===", "[[")
_CAUSE = ("rror", "support", "must ", "annot", "nable", "nvalid", "not ", "ailed")


def helpful_line(text: str) -> str:
    """The line of a compiler error that names the cause: the first one that says what
    went wrong (not the traceback, not the generic last line TensorFlow appends)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(_NOISE)]
    for line in lines:
        if any(word in line for word in _CAUSE):
            return line[:300]
    return lines[0][:300] if lines else ""


def _last_line(text: str) -> str:
    """The most specific line of a TF error ("in user code: ... TypeError: ...")."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def dynamic_shape_ops(hlo: str) -> list[str]:
    """Op types of HLO instructions whose shape is only bounded (``f32[<=12]``)."""
    import re

    ops = []
    for line in hlo.splitlines():
        shape = re.match(r"\s*(?:ROOT\s+)?%\S+\s+=\s+(\S+)", line)  # "%x = f32[<=12] op(..."
        if shape and "<=" in shape.group(1):
            found = re.search(r'op_type="([^"]+)"', line)
            if found and found.group(1) not in ops:
                ops.append(found.group(1))
    return ops


def _single_device_copy(model, features, device: str):
    """A fresh copy of ``model`` with variables on one device (XLA on CPU cannot compile
    across the logical devices of a simulated multi-replica strategy)."""
    import tensorflow as tf

    with tf.device(device):
        config = getattr(model, "config", None)
        if config is not None and hasattr(type(model), "from_pretrained"):
            copy = type(model)(config)
        else:
            copy = tf.keras.models.clone_model(model)
        copy(features, training=False)
    return copy


def _loss_fn(model, copy):
    import tensorflow as tf

    loss = getattr(model, "loss", None)
    if isinstance(loss, str):  # compile(loss="sparse_categorical_crossentropy"): a function
        fn = tf.keras.losses.get(loss)  # of (y, logits) alone, weighted as Keras does it

        def weighted(y, logits, w):
            per_example = fn(y, logits)
            return tf.reduce_mean(per_example if w is None else per_example * w)

        return weighted
    if loss is not None and callable(loss):
        return lambda y, logits, w: loss(y, logits, sample_weight=w)
    if hasattr(copy, "hf_compute_loss"):
        return lambda y, logits, w: tf.reduce_mean(copy.hf_compute_loss(y, logits))
    sce = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return lambda y, logits, w: sce(y, logits, sample_weight=w)


def _split(element):
    if isinstance(element, tuple):
        return (
            element[0],
            (element[1] if len(element) > 1 else None),
            (element[2] if len(element) > 2 else None),
        )
    return element, None, None


def _compile_checks(model, batches, train_step) -> list[Check]:
    """Compile one training step with XLA for two batches of one shape (and run it where
    XLA runs): does it compile, are its shapes static, is its program independent of the
    values?"""
    target = xla_target()
    if not target.can_compile:
        return [
            Check(
                "compiles with XLA",
                SKIP,
                f"not checked: {target.note}",
                "run preflight where TensorFlow can compile with XLA: the CPU build"
                " (requirements.txt) or the TPU build (tensorflow-tpu)",
            )
        ]
    first, second = _two_batches_of_one_shape(batches)
    try:
        if train_step is None:
            train_step = _default_train_step(model, first, target.device or "/CPU:0")
        hlo_a, hlo_b, loss = _compile_twice(train_step, first, second, target)
    except Exception as err:  # noqa: BLE001  (every compile error is translated and reported)
        rule, op, fix = translate_xla_error(err)
        detail = rule + (f" (op {op})" if op else "")
        return [Check("compiles with XLA", FAIL, detail, fix)]
    return [
        _compiled_check(target, loss),
        _static_shapes_check(hlo_a),
        _same_program_check(hlo_a, hlo_b),
    ]


def _two_batches_of_one_shape(batches):
    """The first batch and another of its shapes (or its rows reversed: other values)."""
    import tensorflow as tf

    first = batches[0]
    same = [b for b in batches[1:] if _shapes_of(b) == _shapes_of(first)]
    return first, same[0] if same else tf.nest.map_structure(lambda t: t[::-1], first)


def _default_train_step(model, batch, device: str):
    """A training step of a one-device copy of ``model``: its loss on ``(x, y, w)`` (the
    mean logit without labels) and the gradients."""
    import tensorflow as tf

    copy = _single_device_copy(model, _split(batch)[0], device)
    loss_fn = _loss_fn(model, copy)

    def train_step(x, *rest):
        y, w = (list(rest) + [None, None])[:2]
        with tf.GradientTape() as tape:
            logits = logits_of(copy(x, training=True))
            loss = loss_fn(y, logits, w) if y is not None else tf.reduce_mean(logits)
        grads = tape.gradient(loss, copy.trainable_variables)
        return loss, [tf.convert_to_tensor(g) for g in grads if g is not None]

    return train_step


def _compile_twice(train_step, first, second, target):
    """(HLO for ``first``, HLO for ``second``, the loss of one run on ``first`` where XLA
    runs, else None)."""
    import tensorflow as tf

    step = tf.function(train_step, jit_compile=True)
    hlo_a, hlo_b = compiled_hlo(step, *first), compiled_hlo(step, *second)
    if not target.runs:
        return hlo_a, hlo_b, None
    with tf.device(target.device):
        result = step(*first)
    return hlo_a, hlo_b, result[0] if isinstance(result, (tuple, list)) else result


def _compiled_check(target, loss) -> Check:
    import numpy as np

    if loss is None:
        return Check(
            "compiles with XLA",
            PASS,
            f"one training step compiled (jit_compile=True, built for {target.platform}, not"
            f" run); {target.note}",
        )
    return Check(
        "compiles with XLA",
        PASS if np.all(np.isfinite(np.asarray(loss, np.float32))) else FAIL,
        f"one training step compiled and ran (jit_compile=True, one device, {target.device})",
        "the loss is not finite: check the labels and the learning setup",
    )


def _static_shapes_check(hlo: str) -> Check:
    dynamic = dynamic_shape_ops(hlo)
    return Check(
        "static shapes inside the step",
        FAIL if dynamic else PASS,
        f"shapes that depend on values, from ops {dynamic} (rule 2)"
        if dynamic
        else "every intermediate shape is fixed",
        "replace boolean indexing / tf.where(cond) / data-dependent slicing with a 0/1"
        " mask that keeps the shape (see masked_sparse_crossentropy)",
    )


def _same_program_check(hlo_a: str, hlo_b: str) -> Check:
    same = hlo_a == hlo_b
    return Check(
        "program independent of the data",
        PASS if same else FAIL,
        "two batches of one shape compile to the same program"
        if same
        else "two batches of one shape compiled to different programs: a tensor value was"
        " used where XLA needs a constant (a shape, a range, a Python int or if)"
        " (rules 1 and 2); a TPU would refuse it or recompile for every batch",
        "derive shapes from static sizes (x.shape), not from values (tf.reduce_sum, ...);"
        " use tf.where / masks instead of Python control flow on values",
    )


#: Model types whose TensorFlow code takes another path under ``TPUStrategy`` than on the
#: one device ``preflight`` compiles for (found by reading transformers 4.57's TF models).
STRATEGY_DEPENDENT = {
    "deberta-v2": "DeBERTa-v2 gathers its relative positions with a one-hot einsum under"
    " TPUStrategy and with tf.gather elsewhere",
}


def _position_checks(model, batches) -> list[Check]:
    """Widths beyond the model's positions: out-of-range lookups fail on CPU but are
    clamped under XLA, which gives wrong results without an error on a TPU."""
    from tpu_helpers.core.families import position_limit

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return []
    limit = position_limit(config)
    widths = [
        int(f["input_ids"].shape[1])
        for f in (_split(b)[0] for b in batches)
        if isinstance(f, dict) and "input_ids" in f and f["input_ids"].shape.rank == 2
    ]
    if limit is None or not widths:
        return []
    widest = max(widths)
    return [
        Check(
            "positions",
            FAIL if widest > limit else PASS,
            f"widest batch {widest} tokens, the {config.model_type} model embeds {limit}",
            f"max_length <= {limit} when tokenizing (text.check_max_length), and widths"
            f" <= {limit} (text.choose_boundaries(..., max_length={limit}))",
        )
    ]


def _shapes_of(element) -> tuple:
    import tensorflow as tf

    return tuple(tuple(t.shape) for t in tf.nest.flatten(element))


def _not_batched_check(specs) -> Check | None:
    """FAIL when elements are single examples (a label is a scalar): every other check
    would read the sequence length as the batch size."""
    scalars = [s for s in specs if s.shape.rank == 0]
    if not scalars:
        return None
    return Check(
        "batched",
        FAIL,
        f"elements are single examples ({len(scalars)} scalar component(s), such as the"
        " label): the dataset is not batched",
        "dataset.batch(global_batch, drop_remainder=True) before preflight and training"
        " (or a pipeline.Batches: text.text_batches, records.read_records ...)",
    )


def _dense_check(element_spec) -> Check | None:
    """FAIL when a component is ragged or sparse (rows of different lengths): a TPU takes
    dense tensors of one shape, and every later check would blame another rule."""
    import tensorflow as tf

    def named(spec, where):
        if isinstance(spec, dict):
            return [n for k, v in spec.items() for n in named(v, f"{where}[{k!r}]")]
        if isinstance(spec, tuple | list):
            parts = ("features", "labels", "weights") if not where else ()
            return [
                n
                for i, v in enumerate(spec)
                for n in named(v, parts[i] if i < len(parts) else f"{where}[{i}]")
            ]
        kinds = (tf.RaggedTensorSpec, tf.SparseTensorSpec)
        return [(where or "the element", spec)] if isinstance(spec, kinds) else []

    found = named(element_spec, "")
    if not found:
        return None
    listed = ", ".join(
        f"{where} ({'ragged' if isinstance(spec, tf.RaggedTensorSpec) else 'sparse'})"
        for where, spec in found
    )
    return Check(
        "dense features",
        FAIL,
        f"{listed}: rows of different lengths; a TPU takes only dense tensors, each batch"
        " of one fixed shape",
        "pad every row to a fixed width: text.text_batches(..., boundaries=...) or"
        " dataset.padded_batch(global_batch, padded_shapes=..., drop_remainder=True); a"
        " ragged column: .to_tensor(shape=[None, width]) in a map",
    )


def _static_batch_check(specs) -> Check:
    unknown = [s for s in specs if s.shape.rank and s.shape[0] is None]
    return Check(
        "static batch size",
        FAIL if unknown else PASS,
        "the batch dimension is unknown (a last, smaller batch is possible)"
        if unknown
        else "every batch has the same number of rows",
        "batch with drop_remainder=True (or fill the last batch, as text.batch_plan does)",
    )


def _replicas_check(taken, replicas: int) -> Check:
    import tensorflow as tf

    sizes = sorted({int(tf.nest.flatten(b)[0].shape[0]) for b in taken})
    bad = [n for n in sizes if n % replicas]
    return Check(
        "batch divides across replicas",
        FAIL if bad else PASS,
        f"global batch {sizes if len(sizes) > 1 else sizes[0]} over {replicas} replicas"
        + (f": {bad[0]} % {replicas} = {bad[0] % replicas}" if bad else ""),
        f"a global batch that is a multiple of {replicas}: per-replica batch x {replicas}"
        " (text.global_batch_size)",
    )


def _dtypes_check(specs) -> Check:
    import tensorflow as tf

    bad = sorted({s.dtype.name for s in specs if s.dtype in (tf.string, tf.float64)})
    return Check(
        "dtypes",
        FAIL if bad else PASS,
        f"{bad} reach the model" if bad else f"{sorted({s.dtype.name for s in specs})}",
        "strings: tokenize/decode in the pipeline; float64: cast to float32 (or bfloat16)",
    )


def _shape_checks(taken, max_shapes: int, max_padding: float) -> list[Check]:
    report = shape_report(taken, n=len(taken))
    checks = [
        Check(
            "few input shapes",
            FAIL if report.distinct > max_shapes else PASS,
            f"{report.distinct} distinct shape(s) in the first {report.batches} batches;"
            " each one is a separate XLA compilation",
            f"pad to at most {max_shapes} fixed widths (text.padding_boundaries(lengths,"
            " 'buckets')) instead of padding each batch to its longest row",
        )
    ]
    if report.padding_fraction is not None:
        checks.append(
            Check(
                "padding",
                WARN if report.padding_fraction > max_padding else PASS,
                f"{report.padding_fraction:.0%} of the input tokens are padding",
                "choose the widths from the length histogram (text.choose_boundaries)",
            )
        )
    return checks


def _strategy_note(model) -> list[Check]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in STRATEGY_DEPENDENT:
        return []
    return [
        Check(
            "same program under TPUStrategy",
            WARN,
            f"not certified: {STRATEGY_DEPENDENT[model_type]}; the step above was compiled"
            " without a strategy",
            "the first steps on the TPU decide: run a few with a small batch first",
        )
    ]


def _check_preflight_call(dataset, batches: int) -> None:
    import tensorflow as tf

    check_positive(batches=batches)
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
        raise EngineError(
            "preflight builds a one-device copy of the model: call it outside strategy.scope()."
        )


def preflight(
    model,
    dataset,
    strategy=None,
    batches: int = 20,
    max_shapes: int = 8,
    max_padding: float = 0.5,
    compile_step: bool = True,
    train_step=None,
    raise_on_failure: bool = True,
    replicas: int | None = None,
) -> PreflightReport:
    """Check a model and its data (a ``pipeline.Batches``, whose first epoch is read, or a
    ``tf.data.Dataset`` of global batches) against what a TPU needs, on any machine.

    Reads the first ``batches`` batches and checks: the batch dimension is static
    (``drop_remainder=True``); the global batch divides across the replicas (of
    ``strategy``, or ``replicas`` to check for a TPU from elsewhere); dtypes a TPU takes
    (no strings, no float64); how many distinct input shapes there are (each is one XLA
    compilation; more than ``max_shapes`` fails) and the padding share; and, with
    ``compile_step``, that one training step (``model``'s loss, or your own
    ``train_step(features, labels, weights)``) compiles with ``jit_compile=True`` where
    ``xla_target()`` says (one CPU device with the CPU build, the TPU once connected, the
    TPU compiler without a device in the ``tensorflow-tpu`` build off a TPU, where the step
    is built but not run), with no value-dependent shapes and the same program for two
    batches of one shape. A compile error is translated into the rule it breaks; where
    nothing can compile, the check says SKIP and why.

    Prints nothing; returns the report (``str(report)`` is the PASS/FAIL listing) and,
    with ``raise_on_failure``, raises ``PreflightError`` carrying it (``error.report``)
    when a check fails. Call it outside ``strategy.scope()``; pass the dataset before
    ``strategy`` distributes it.
    """
    import tensorflow as tf

    from tpu_helpers.core.pipeline import as_dataset

    dataset = as_dataset(dataset, "preflight's data")
    _check_preflight_call(dataset, batches)
    specs = tf.nest.flatten(dataset.element_spec)
    found = [_not_batched_check(specs), _dense_check(dataset.element_spec)]
    checks = [c for c in found if c is not None]
    if not checks:
        taken = list(dataset.take(batches))
        if not taken:
            raise InputError("The dataset is empty. Fix: check its source.")
        replicas = strategy.num_replicas_in_sync if strategy is not None else replicas
        checks.append(_static_batch_check(specs))
        if replicas:
            checks.append(_replicas_check(taken, replicas))
        checks.append(_dtypes_check(specs))
        checks.extend(_shape_checks(taken, max_shapes, max_padding))
        checks.extend(_position_checks(model, taken))
        if compile_step:
            checks.extend(_compile_checks(model, taken, train_step))
            checks.extend(_strategy_note(model))
    result = PreflightReport(tuple(checks))
    if raise_on_failure and not result.ok:
        raise PreflightError(result)
    return result
