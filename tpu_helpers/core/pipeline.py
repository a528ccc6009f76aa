"""One contract for every input pipeline: ``Batches``.

Every builder in ``tpu_helpers`` returns a ``Batches``: ``text.text_batches`` (tokenized
splits, data-chosen widths), ``records.read_records`` (TFRecord shards),
``images.image_batches`` and ``images.image_record_batches`` (image files, image records),
``packing.packed_batches`` (packed rows) and ``mlm.masked_batches`` (masked-LM blocks).
Every trainer and check takes one: each engine's ``fit_resumable`` and ``predict_classes``
(``keras3``, ``tf_engine.trainer``), ``custom_loop.CustomLoop``, each engine's ``input_bound_check``
(whose answer, ``InputBoundReport``, is here), ``xla.preflight``.

A ``Batches`` is a plan, not a dataset. It knows:

* ``dataset(epoch, skip_steps=...)``: one epoch's global batches, from any step on (the
  same batches in every process: what lets a run resume in the middle of an epoch);
* ``distribute(strategy, epoch, skip_steps=...)``: the same epoch placed on the replicas
  and hosts of ``strategy`` (each host makes the per-replica batches of its own replicas;
  all replicas of a step share one shape);
* ``steps_per_epoch`` (``steps_on(strategy)`` on a pod slice, where hosts may need filler
  steps), ``global_batch`` (rows per step over all replicas; ``per_replica_batch(n)``),
  ``examples`` (rows of weight 1 per epoch), ``padding`` (what it costs in padding:
  ``real_tokens``, ``real_token_share``; ``None`` without tokens), ``max_width`` (the
  widest token row, checked against a model's positions before the first step) and
  ``widths`` (every width its token rows are padded to, where known: an engine compiles
  one step per width, and may do so before the first step) and ``order`` (what decides the
  order of an epoch's batches, where it can change: recorded with a run's saves, since a
  resumed epoch skips the batches it had reached).

Every element is ``(features, labels, weights)``: ``features`` a dict, weight 0 marks the
rows that complete a batch (a TPU needs full batches) and count for nothing.

Every random choice of a pipeline comes from one rule, ``seed_pair(seed, epoch, step,
stream)``: the user's seed and a stream number (order, augmentation, masks ...) give the
first half, the epoch and step the second. The same epoch gives the same batches whatever
ran before, and no TensorFlow global seed plays a part.

>>> import numpy as np
>>> batches = from_arrays({"x": np.arange(10.0)[:, None]}, np.arange(10) % 2, global_batch=4)
>>> batches.steps_per_epoch, batches.examples
(3, 10)
>>> [float(w.numpy().sum()) for _, _, w in batches.dataset(0)]
[4.0, 4.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from tpu_helpers.core.errors import InputError, InputTypeError
from tpu_helpers.core.validate import check_positive

__all__ = [
    "InputBoundReport",
    "Batches",
    "STREAMS",
    "as_dataset",
    "from_arrays",
    "from_dataset_fn",
    "input_pipelines",
    "replica_batches",
    "rng",
    "seed_pair",
    "seeded_shuffle",
]

#: The stream numbers of ``seed_pair``: one per kind of random choice, so that two
#: choices of one step never read the same draw.
STREAMS = {"order": 0, "augment": 1, "mask": 2, "fill": 3, "records": 1000}

_PRIME = 1_000_003


def seed_pair(seed: int, epoch=0, step=0, stream: int = 0):
    """The stateless seed of ``(seed, stream)`` in ``epoch`` at ``step``:
    ``[(seed * 1000003 + stream) mod 2**62, epoch * 2**32 + step]``.

    Python ints give a tuple of two ints (for ``rng``); a tensor ``epoch`` or ``step``
    gives an int64 tensor ``[2]`` (for ``tf.random.stateless_*`` inside a pipeline).

    >>> seed_pair(0, 1, 5)
    (0, 4294967301)
    """
    first = (int(seed) * _PRIME + int(stream)) % 2**62
    if isinstance(epoch, int | np.integer) and isinstance(step, int | np.integer):
        return first, int(epoch) * 2**32 + int(step)
    import tensorflow as tf

    second = tf.cast(epoch, tf.int64) * 2**32 + tf.cast(step, tf.int64)
    return tf.stack([tf.constant(first, tf.int64), second])


def rng(seed: int, epoch: int = 0, stream: int = 0) -> np.random.Generator:
    """numpy's generator for ``seed_pair(seed, epoch, 0, stream)``: an epoch's order,
    packing or fillers, drawn on the host."""
    return np.random.default_rng(seed_pair(seed, epoch, 0, stream))


def seeded_shuffle(ds, buffer: int, seed):
    """``ds`` through a shuffle buffer of ``buffer`` elements whose order depends on
    ``seed`` (a ``seed_pair`` tensor) alone: ``Dataset.shuffle`` would mix in TensorFlow's
    global seed, which a resumed run may not share."""
    import tensorflow as tf

    flat = tf.nest.flatten(ds.element_spec)
    variant = tf.raw_ops.ShuffleDatasetV3(
        input_dataset=tf.data.experimental.to_variant(ds),
        buffer_size=tf.constant(buffer, tf.int64),
        seed=seed[0],
        seed2=seed[1],
        seed_generator=tf.raw_ops.DummySeedGenerator(),
        output_types=[s.dtype for s in flat],
        output_shapes=[s.shape for s in flat],
        reshuffle_each_iteration=False,
    )
    return tf.data.experimental.from_variant(variant, ds.element_spec)


def replica_batches(ds, input_context, global_batch: int):
    """Global batches cut into the per-replica batches of ``input_context``'s replicas, in
    replica order (a strategy takes them so from ``distribute_datasets_from_function``).
    For builders that make whole global batches; those that read per host do better."""
    import tensorflow as tf

    replicas = input_context.num_replicas_in_sync
    per = global_batch // replicas
    local = max(1, replicas // input_context.num_input_pipelines)
    first = input_context.input_pipeline_id * local * per

    def cut(*element):
        def rows(t):
            part = t[first : first + local * per]
            shape = tf.concat([[local, per], tf.shape(t)[1:]], 0)
            return tf.ensure_shape(tf.reshape(part, shape), [local, per, *t.shape[1:]])

        return tf.nest.map_structure(rows, element)

    return ds.map(cut).unbatch()


@dataclass(frozen=True, eq=False)
class Batches:
    """An input pipeline: the batches of any epoch, from any step, on any strategy (see
    the module doc).

    ``build(epoch, skip_steps, input_context)`` makes the ``tf.data.Dataset``: global
    batches with ``input_context=None``; with a ``tf.distribute.InputContext`` the
    per-replica batches of that host's replicas when ``reads_per_host`` (else they are cut
    from the global batches here). ``steps_for(pipelines, replicas)`` gives the steps of
    an epoch over that many hosts when it differs from one host's (records on a pod slice).
    """

    build: Callable = field(repr=False)
    steps_per_epoch: int
    global_batch: int
    examples: int | None = None
    padding: object | None = None
    max_width: int | None = None
    widths: tuple | None = None
    order: dict | None = field(default=None, compare=False)
    max_label: int | None = None
    max_token_id: int | None = None
    name: str = "batches"
    reads_per_host: bool = False
    steps_for: Callable[[int, int], int] | None = field(default=None, repr=False)

    def __post_init__(self):
        for name in ("steps_per_epoch", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise InputError(
                    f"{self.name}: {name}={value!r} must be a positive integer. Fix: the"
                    " data must make at least one full batch (a smaller batch or more data)."
                )

    # --- one epoch ----------------------------------------------------------------------
    def _check_epoch(self, epoch, skip_steps, steps: int | None = None) -> None:
        steps = self.steps_per_epoch if steps is None else steps
        ok = isinstance(epoch, int | np.integer) and not isinstance(epoch, bool) and epoch >= 0
        if not ok:
            raise InputError(f"epoch={epoch!r} must be a whole number from 0. Fix: epoch=0.")
        ok = isinstance(skip_steps, int | np.integer) and not isinstance(skip_steps, bool)
        if ok and skip_steps == steps:
            raise InputError(
                f"skip_steps={skip_steps!r} is the end of epoch {epoch} of {self.name}, which"
                f" has {steps} steps: nothing of it is left. Fix: go on at epoch {epoch + 1},"
                " step 0 (a save at an epoch's last step names the next epoch's start)."
            )
        if not ok or not 0 <= skip_steps < steps:
            raise InputError(
                f"skip_steps={skip_steps!r}: an epoch of {self.name} has"
                f" {steps} steps of {self.global_batch} rows, so skip 0 to"
                f" {steps - 1}. Fix: resume with the global batch of the run"
                " that saved the checkpoint."
            )

    def dataset(self, epoch: int = 0, *, skip_steps: int = 0):
        """Epoch ``epoch``'s global batches from step ``skip_steps`` on."""
        self._check_epoch(epoch, skip_steps)
        return self.build(int(epoch), int(skip_steps), None)

    def per_replica_batch(self, replicas: int) -> int:
        """The rows of one replica per step, refusing a global batch that does not divide."""
        if replicas < 1 or self.global_batch % replicas:
            raise InputError(
                f"{self.name}: global batch {self.global_batch} does not divide across"
                f" {replicas} replicas. Fix: a global batch that is a multiple of {replicas}"
                f" (per-replica batch x replicas, e.g. {max(1, self.global_batch // max(replicas, 1)) * replicas})."
            )
        return self.global_batch // replicas

    def distribute(self, strategy, epoch: int = 0, *, skip_steps: int = 0):
        """Epoch ``epoch`` from step ``skip_steps`` on, on ``strategy``'s replicas and hosts
        (``strategy.distribute_datasets_from_function``)."""
        self._check_epoch(epoch, skip_steps)
        self.per_replica_batch(strategy.num_replicas_in_sync)

        def dataset_fn(input_context):
            ds = self.build(int(epoch), int(skip_steps), input_context)
            return (
                ds if self.reads_per_host else replica_batches(ds, input_context, self.global_batch)
            )

        return strategy.distribute_datasets_from_function(dataset_fn)

    def steps_on_hosts(self, hosts: int, devices: int) -> int:
        """Steps of an epoch fed by ``hosts`` hosts to ``devices`` devices in all (JAX's
        processes and devices): ``steps_per_epoch``, or what ``steps_for`` says where each
        host reads its own part (records on a pod slice)."""
        if hosts == 1 or self.steps_for is None:
            return self.steps_per_epoch
        return self.steps_for(hosts, devices)

    def host_dataset(
        self, epoch: int = 0, *, skip_steps: int = 0, hosts: int = 1, host: int = 0, devices=1
    ):
        """Epoch ``epoch`` from step ``skip_steps`` on, as host ``host`` of ``hosts`` feeds
        its ``devices // hosts`` of ``devices`` devices: this host's rows of each global
        batch (``global_batch // hosts`` of them, its devices' in their order), for JAX's
        ``make_array_from_process_local_data``. With one host, ``dataset``. A pipeline that
        reads per host (``reads_per_host``: records) reads only this host's files, and
        ``steps_on_hosts`` gives the steps; the others make the global batch and keep this
        host's rows of it."""
        if hosts == 1:
            return self.dataset(epoch, skip_steps=skip_steps)
        import tensorflow as tf

        if devices % hosts or not 0 <= host < hosts:
            raise InputError(
                f"host {host} of {hosts} hosts with {devices} devices: each host feeds as"
                " many devices as the others. Fix: the devices of every process (jax.devices())."
            )
        self._check_epoch(epoch, skip_steps, self.steps_on_hosts(hosts, devices))
        self.per_replica_batch(devices)
        context = tf.distribute.InputContext(hosts, host, devices)
        ds = self.build(int(epoch), int(skip_steps), context)
        rows = self.global_batch // hosts
        if not self.reads_per_host:  # global batches: keep this host's rows
            first = host * rows
            return ds.map(lambda *e: tf.nest.map_structure(lambda t: t[first : first + rows], e))

        def joined(*element):  # the per-replica batches of one step, end to end
            def rows_of(t):
                shape = tf.concat([[rows], tf.shape(t)[2:]], 0)
                return tf.ensure_shape(tf.reshape(t, shape), [rows, *t.shape[2:]])

            return tf.nest.map_structure(rows_of, element)

        return ds.batch(devices // hosts, drop_remainder=True).map(joined)

    def steps_on(self, strategy=None) -> int:
        """Steps of an epoch on ``strategy``: ``steps_per_epoch``, or over a pod slice's
        hosts what ``steps_for`` says."""
        if strategy is None or self.steps_for is None:
            return self.steps_per_epoch
        pipelines = input_pipelines(strategy)
        if pipelines == 1:
            return self.steps_per_epoch
        return self.steps_for(pipelines, strategy.num_replicas_in_sync)

    # --- derived plans ------------------------------------------------------------------
    def with_transform(self, transform: Callable) -> Batches:
        """The same batches passed through ``transform`` (a function of a dataset, such
        as ``observe.CompileWatch.watch``) on every host."""
        build = self.build
        return replace(self, build=lambda e, s, c: transform(build(e, s, c)))

    def check_positions(self, model_config) -> None:
        """Refuse rows wider than the model's positions (``families.position_limit``) before
        any step: inside the run it is an error of the embeddings layer, or silent."""
        if self.max_width is None or model_config is None:
            return
        from tpu_helpers.core.families import position_limit

        limit = position_limit(model_config) if hasattr(model_config, "model_type") else None
        if limit is not None and self.max_width > limit:
            raise InputError(
                f"{self.name} has rows of up to {self.max_width} tokens, but the"
                f" {model_config.model_type} model embeds {limit} positions. Fix: widths"
                f" (boundaries, the packed width) of at most {limit}, e.g. max_length={limit}."
            )

    def check_model(self, model_config) -> None:
        """Refuse, before any step, batches the model cannot take: rows wider than its
        positions, a class label it has no output for (``max_label`` against the config's
        ``num_labels``), a token id its embedding table has no row for (``max_token_id``
        against ``vocab_size``). Inside a compiled step the last two are silent: a label
        out of range counts nothing, an id out of range gathers garbage (a ``nan`` loss on
        JAX)."""
        self.check_positions(model_config)
        if model_config is None:
            return
        classes = getattr(model_config, "num_labels", None)
        # one output is a regression (transformers' num_labels=1): its targets are no ids
        if self.max_label is not None and classes and classes > 1 and self.max_label >= classes:
            raise InputError(
                f"{self.name} hold class label {self.max_label}, but the model has {classes}"
                f" outputs (labels 0 to {classes - 1}). Fix: build the model with"
                f" num_labels={self.max_label + 1} (the data set's number of classes), or"
                f" map the labels into 0..{classes - 1}."
            )
        vocabulary = getattr(model_config, "vocab_size", None)
        if self.max_token_id is not None and vocabulary and self.max_token_id >= vocabulary:
            raise InputError(
                f"{self.name} hold token id {self.max_token_id}, but the"
                f" {getattr(model_config, 'model_type', '')} model embeds {vocabulary} tokens"
                " (vocab_size). Fix: tokenize with the checkpoint's own tokenizer"
                " (hub.load_tokenizer(checkpoint)); another tokenizer's ids have no row in"
                " this embedding table."
            )

    def ran_out(self, got: int, where: str) -> ValueError:
        """The error for an epoch that ended after ``got`` of its ``steps_per_epoch``
        batches (an empty data set, or steps declared beyond the data)."""
        return ValueError(
            f"{self.name} gave {got} batch(es) in {where}, but an epoch of them has"
            f" {self.steps_per_epoch} step(s) of {self.global_batch} rows. Fix: check the data"
            " they read (an empty split, a filter that dropped every row, a folder without"
            " records), or declare the steps the data holds (pipeline.from_dataset_fn)."
        )

    def first_batch(self, where: str):
        """The first global batch of epoch 0, as NumPy; refused by ``ran_out`` if none."""
        for batch in self.dataset(0).take(1).as_numpy_iterator():
            return batch
        raise self.ran_out(0, where)

    def check_inputs(self, expected: Mapping[str, tuple] | None) -> None:
        """Refuse, before any step, features the model cannot take, naming each with its
        shape: ``expected`` is the model's inputs as transformers' TF classes say them
        (``model_input_shapes``: name -> shape, ``None`` where any size goes); nothing is
        checked without it. Refused: a feature of another rank (a 1-D ``input_ids``: an
        unbatched or flattened column), an image of other channels (channels last for a
        model that takes them first), per-token columns of one text of different widths,
        and features that hold none of the model's inputs. Sizes a signature fixes
        elsewhere are not held (transformers writes 224 for models that take any size)."""
        if not expected:
            return
        features = self.dataset(0).element_spec
        features = features[0] if isinstance(features, tuple) else features
        if not isinstance(features, Mapping):
            return  # a model called on one tensor: its rank is its own business
        shapes = {
            name: tuple(spec.shape)
            for name, spec in features.items()
            if getattr(spec.shape, "rank", None) is not None  # unknown: not judged
        }

        def shown(named):
            return ", ".join(f"{k} {_shape_text(v)}" for k, v in named.items())

        wants = f"the model takes {shown(expected)} (None: any size)"
        if not set(features) & set(expected):
            raise InputError(
                f"{self.name} give {shown(shapes)}, none of the model's inputs: {wants}. Fix:"
                " name the features as the model's inputs (the tokenizer's or image"
                " processor's own output names)."
            )
        for name, shape in shapes.items():
            want = expected.get(name)
            if want is None:
                continue
            other_rank = len(shape) != len(want)
            other_channels = (  # an image: rows x channels x height x width
                not other_rank and len(want) == 4 and None not in (want[1], shape[1])
            ) and shape[1] != want[1]
            if other_rank or other_channels:
                raise InputError(
                    f"{self.name} give {name} of shape {_shape_text(shape)} (rows first),"
                    f" but {wants}. Fix: batch the data (rows x width for text, rows x"
                    " channels x height x width for images, as the checkpoint's processor"
                    " gives them); a 1-D column is one row's tokens, not a batch."
                )
        widths = {k: shapes[k] for k in TOKEN_COLUMNS if k in shapes and len(shapes[k]) == 2}
        if len({shape[1] for shape in widths.values() if shape[1] is not None}) > 1:
            raise InputError(
                f"{self.name} give per-token columns of different widths in one batch"
                f" ({shown(widths)}). Fix: pad every per-token column of a row to the same"
                " width (one tokenizer call with padding)."
            )


def _shape_text(shape) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


#: The per-token columns of one text, which a batch pads to one width.
TOKEN_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def model_input_shapes(model) -> dict[str, tuple] | None:
    """The inputs of a transformers TF model as ``{name: shape}`` (``None`` where any size
    goes), from its ``input_signature``; ``None`` for any other model (a Keras model maps a
    dict of features onto its inputs in ways names alone do not say)."""
    try:
        signature = getattr(model, "input_signature", None)
    except Exception:  # a class whose signature cannot be made
        return None
    if not isinstance(signature, Mapping):
        return None
    return {name: tuple(spec.shape) for name, spec in signature.items()}


_PIPELINES: dict[int, int] = {}


def input_pipelines(strategy) -> int:
    """The input pipelines (hosts) ``strategy`` feeds: what every
    ``distribute_datasets_from_function`` call sees in its ``InputContext``."""
    key = id(strategy)
    if key not in _PIPELINES:
        import tensorflow as tf

        seen = []

        def probe(context):
            seen.append(context.num_input_pipelines)
            return tf.data.Dataset.range(1)

        strategy.distribute_datasets_from_function(probe)
        _PIPELINES[key] = max(seen or [1])
    return _PIPELINES[key]


def as_dataset(data, name: str = "data"):
    """A ``tf.data.Dataset`` of global batches: ``data`` itself, or epoch 0 of a
    ``Batches``. Anything else is refused, naming the fix."""
    import tensorflow as tf

    if isinstance(data, Batches):
        return data.dataset(0)
    if isinstance(data, tf.data.Dataset):
        return data
    raise InputTypeError(
        f"{name} must be a pipeline.Batches (what every tpu_helpers builder returns) or a"
        f" tf.data.Dataset of global batches, not {type(data).__name__}. Fix: build it with"
        " text.text_batches, records.read_records, images.image_batches ..., or wrap your own"
        " with pipeline.from_dataset_fn."
    )


def require_batches(data, where: str) -> Batches:
    """``data`` if it is a ``Batches``; else a ``TypeError`` naming the builders."""
    if isinstance(data, Batches):
        return data
    raise InputTypeError(
        f"{where} takes a pipeline.Batches, not {type(data).__name__}: it needs each epoch"
        " from any step (to resume) and its number of steps. Fix: build the data with"
        " text.text_batches, records.read_records, images.image_batches,"
        " packing.packed_batches or mlm.masked_batches, or wrap your own tf.data pipeline:"
        " pipeline.from_dataset_fn(lambda epoch, skip_steps: ..., steps_per_epoch=...,"
        " global_batch=...)."
    )


def from_dataset_fn(
    dataset_fn: Callable[[int, int], object],
    *,
    steps_per_epoch: int,
    global_batch: int,
    examples: int | None = None,
    name: str = "dataset_fn",
) -> Batches:
    """A ``Batches`` of your own ``tf.data`` pipeline: ``dataset_fn(epoch, skip_steps)``
    returns epoch ``epoch``'s global batches of ``(features, labels, weights)`` from step
    ``skip_steps`` on, the same in every process (seed it with ``seed_pair`` or ``rng``)."""

    def build(epoch, skip_steps, input_context):
        return dataset_fn(epoch, skip_steps)

    return Batches(build, steps_per_epoch, global_batch, examples, name=name)


def from_arrays(
    features: Mapping[str, np.ndarray],
    labels,
    *,
    global_batch: int,
    shuffle: bool = True,
    seed: int = 0,
    name: str = "arrays",
) -> Batches:
    """``Batches`` of in-memory arrays (one row per example): each epoch shuffled by
    ``rng(seed, epoch)``, the last batch completed with weight-0 copies, nothing dropped.
    Labels of whole numbers, one per row, are class ids: a negative one is refused here,
    one the model has no output for by ``check_model`` (before any step of an engine)."""
    import tensorflow as tf

    from tpu_helpers.core.validate import check_labels

    features = {k: np.asarray(v) for k, v in features.items()}
    labels = np.asarray(labels)
    n = len(labels)
    if n == 0 or any(len(v) != n for v in features.values()):
        raise InputError(
            f"{name}: {n} labels and features of {[len(v) for v in features.values()]} rows."
            " Fix: one label per row, and at least one row."
        )
    steps = -(-n // global_batch)
    classes = labels.ndim == 1 and labels.dtype.kind in "iu"  # not one-hot, not regression
    max_label = int(check_labels(labels, column=f"{name} labels").max()) if classes else None

    def build(epoch, skip_steps, input_context):
        order = rng(seed, epoch).permutation(n) if shuffle else np.arange(n)
        fill = np.arange(steps * global_batch - n) % n
        rows = np.concatenate([order, fill])[skip_steps * global_batch :]
        weights = (np.arange(steps * global_batch) < n).astype(np.float32)
        weights = weights[skip_steps * global_batch :]
        ds = tf.data.Dataset.from_tensor_slices(
            ({k: v[rows] for k, v in features.items()}, labels[rows], weights)
        )
        return ds.batch(global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    return Batches(build, steps, global_batch, n, name=name, max_label=max_label)


@dataclass(frozen=True)
class InputBoundReport:
    """Batches per second of the input pipeline alone, of the training step alone (on
    cached batches) and of the two together, and what they mean."""

    input_per_second: float
    step_per_second: float
    together_per_second: float
    steps: int

    @property
    def verdict(self) -> str:
        if self.input_per_second < self.step_per_second:
            return "input-bound"
        if self.input_per_second < 1.5 * self.step_per_second:
            return "balanced"
        return "compute-bound"

    @property
    def advice(self) -> str:
        step = (
            "the step is what takes the time: fewer padding tokens (text.choose_boundaries,"
            " records' bucketed widths), bf16 (mixed_bfloat16), or a larger per-replica"
            " batch to fill the chip"
        )
        feed = (
            "feed it faster: tokenize or decode once and stream TFRecord shards"
            " (records.write_records, read_records), .cache() a data set that fits in host"
            " memory, parallel_reads=8 for files on a bucket, decode JPEGs at a reduced size"
            " (images.ImageSpec with decode_size), and more steps_per_execution so the host"
            " starts fewer calls"
        )
        if self.verdict == "compute-bound":
            return f"{step}; the input has headroom"
        if self.verdict == "balanced":
            return f"the input only just keeps up: {step}; and then {feed}"
        return feed

    def time_for(self, steps: int) -> str:
        """How long ``steps`` training steps take at the rate of the two together, as
        ``"40 s"``, ``"25 min"`` or ``"3.2 h"`` (compilations and evaluation not counted)."""
        check_positive(steps=steps)
        seconds = steps / self.together_per_second
        if seconds < 90:
            return f"{seconds:.0f} s"
        if seconds < 90 * 60:
            return f"{seconds / 60:.0f} min"
        return f"{seconds / 3600:.1f} h"

    def __str__(self) -> str:
        return (
            f"{self.verdict}: the pipeline delivers {self.input_per_second:,.0f} batches/s, the"
            f" step needs {self.step_per_second:,.0f} (on cached batches); together"
            f" {self.together_per_second:,.0f} batches/s over {self.steps} steps. Try: {self.advice}."
        )
