"""The Keras 3 engine's resumable training: ``RunSaves`` (saves of model and optimizer, with
the fall-back to the save before), ``JaxTrainer`` (the ``core.engine.Trainer`` of this
engine, compiled steps from ``keras3.steps``), ``fit_resumable``, ``predict_classes``,
``evaluate`` and ``input_bound_check``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.engine import (
    check_same_run,
    fit_options,
    fit_with,
    predict_with,
    require_engine_model,
)
from tpu_helpers.core.errors import (
    CheckpointMismatchError,
    EngineError,
    InputTypeError,
)
from tpu_helpers.core.messages import say
from tpu_helpers.core.pipeline import require_batches
from tpu_helpers.core.storage import gfile
from tpu_helpers.core.validate import check_positive
from tpu_helpers.keras3.distribution import (
    _keras,
    all_processes_reach,
    first_process_says,
    is_writer,
    same_on_every_process,
    summed_over_processes,
)
from tpu_helpers.keras3.models import HubSource

__all__ = [
    "ResumePoint",
    "RunSaves",
    "fit_resumable",
    "evaluate",
    "predict_classes",
    "compilations",
    "input_bound_check",
]


@dataclass(frozen=True)
class ResumePoint:
    """Where a run stands: ``epoch`` (0-based) and the ``step`` of it to train next."""

    epoch: int
    step: int


def _state(model) -> list:
    """Every variable a resumed run needs, in a fixed order: the model's (trainable, then
    the rest, the dropout layers' seed states among them) and the optimizer's."""
    return [*model.trainable_variables, *model.non_trainable_variables, *model.optimizer.variables]


class RunSaves:
    """A run's saves in ``directory`` (local or ``gs://``): ``state-<epoch>-<step>.npz``
    and ``latest.json`` naming the newest, written
    after it, so a save that stops half-way is never the one resumed. The two newest
    states are kept. Of several JAX processes (a pod slice's hosts), the first writes and
    every one waits for it (``save``), and every one reads (``restore``): the folder must
    be one they share (``gs://``). ``fit_resumable`` saves through it; so can a loop of one's own
    (``save(model, ResumePoint(epoch, step), values)`` with the values of the model's
    trainable, non-trainable and optimizer variables, in that order; ``restore(model)``).

    A non-trainable variable of ``FROZEN_ELEMENTS`` or more that the run has not changed
    (a frozen weight: LoRA freezes all of a model's but its factors) can be left out of a
    save (``unchanged``: ``{index: fingerprint}``, see ``as_built``), which then holds its
    fingerprint: a LoRA run's saves hold the factors and their optimizer, not the model.
    ``restore`` checks that the model built again holds the same values there, and refuses
    one that does not (another checkpoint, or weights drawn without a seed)."""

    FROZEN_ELEMENTS = 1024

    def __init__(self, directory: str, run: dict, log=say):
        self.directory, self.run, self.gfile = directory.rstrip("/"), run, gfile()
        self.log, self.writer = log, is_writer()
        if self.writer:
            self.gfile.makedirs(self.directory)
        all_processes_reach(f"folder {self.directory}")  # it exists for every host

    def _write(self, name: str, data: bytes) -> None:
        partial = f"{self.directory}/{name}.partial"
        with self.gfile.GFile(partial, "wb") as f:
            f.write(data)
        self.gfile.rename(partial, f"{self.directory}/{name}", True)

    def latest(self) -> dict | None:
        path = f"{self.directory}/latest.json"
        if not self.gfile.exists(path):
            return None
        with self.gfile.GFile(path) as f:
            return json.load(f)

    def as_built(self, model) -> dict:
        """``{index in the saves' order: fingerprint}`` of the model's non-trainable
        variables of ``FROZEN_ELEMENTS`` or more, as they are now (every process calls it)."""
        from tpu_helpers.keras3.steps import fingerprints

        trainable = len(model.trainable_variables)
        large = [
            (trainable + i, v)
            for i, v in enumerate(model.non_trainable_variables)
            if int(np.prod(v.shape)) >= self.FROZEN_ELEMENTS
        ]
        found = fingerprints([v.value for _, v in large])
        return {i: f for (i, _), f in zip(large, found, strict=True)}

    def save(self, model, point: ResumePoint, values=None, unchanged=None) -> None:
        """Save ``values`` (in the order of ``_state(model)``; the variables' own values
        when ``None``) as the state at ``point``, but those of ``unchanged`` (their
        fingerprints instead)."""
        failed = None
        if self.writer:  # one host of a pod slice writes; the others wait for it
            try:
                self._save(model, point, values, unchanged or {})
            except Exception as error:  # told to every host, then raised on each
                failed = error
        if not first_process_says(failed is None):
            raise failed or EngineError(
                f"the first host could not write the save at {point} in {self.directory}"
                " (its log says why). Fix: a folder every host can write to (gs://)."
            )

    def _save(self, model, point: ResumePoint, values, unchanged: dict) -> None:
        variables = _state(model)
        if values is None:
            values = [
                None if i in unchanged else np.asarray(v.value) for i, v in enumerate(variables)
            ]
        arrays = {f"arr_{i}": value for i, value in enumerate(values) if i not in unchanged}
        marks = [[i, *unchanged[i]] for i in sorted(unchanged)]  # index, fingerprint
        buffer = io.BytesIO()
        np.savez(buffer, **arrays, unchanged=np.array(marks, np.int64).reshape(-1, 3))
        name = f"state-{point.epoch}-{point.step}.npz"
        self._write(name, buffer.getvalue())
        before = self.latest()
        latest = {
            "file": name,
            "epoch": point.epoch,
            "step": point.step,
            "run": self.run,
            "variables": [[v.path, list(v.shape)] for v in variables],
            # a save of the same name (after a fall-back) keeps the one before it
            "previous": (before or {}).get(
                "previous" if before and before["file"] == name else "file"
            ),
        }
        self._write("latest.json", json.dumps(latest).encode())
        old = before and before.get("previous")
        keep = (name, latest["previous"])
        if old and old not in keep and self.gfile.exists(f"{self.directory}/{old}"):
            self.gfile.remove(f"{self.directory}/{old}")

    def restore(self, model) -> ResumePoint:
        """The point to resume from (``(0, 0)`` for a new run), with the saved state put
        into ``model`` and its optimizer."""
        latest = self.latest()
        if latest is None:
            return ResumePoint(0, 0)
        check_same_run(self.directory, latest["run"], self.run)
        variables = _state(model)
        have = [[v.path, list(v.shape)] for v in variables]
        saved = latest["variables"]
        # shapes in order: a model and optimizer made again have other layer numbers
        differ = next(
            (i for i, (h, w) in enumerate(zip(have, saved, strict=False)) if h[1] != w[1]),
            None if len(have) == len(saved) else min(len(have), len(saved)),
        )
        if differ is not None:
            raise CheckpointMismatchError(
                f"{self.directory}: the saved state does not fit this model: {len(have)}"
                f" variables here, {len(saved)} saved, the first difference at"
                f" #{differ} ({have[differ] if differ < len(have) else '-'} here,"
                f" {saved[differ] if differ < len(saved) else '-'}"
                " saved): another checkpoint, head or optimizer. Fix: a new directory."
            )
        for name in (latest["file"], latest.get("previous")):  # the newest whole one
            arrays = self._read(name, len(variables)) if name else None
            if arrays is not None:
                self._check_as_built(variables, arrays, name)
                for variable, array in zip(variables, arrays, strict=True):
                    if not isinstance(array, tuple):  # a fingerprint: left as built
                        variable.assign(array)
                epoch, step = (int(n) for n in name[len("state-") : -len(".npz")].split("-"))
                return ResumePoint(epoch, step)
        raise CheckpointMismatchError(
            f"{self.directory}: no save of this run can be read ({latest['file']} and"
            f" {latest.get('previous') or 'no earlier one'}; see above). Fix: copy the"
            " folder again if it was copied, or pass a new folder to start afresh."
        )

    def _check_as_built(self, variables, arrays, name: str) -> None:
        """Refuse a model whose variables left out of save ``name`` (their fingerprints in
        ``arrays``) hold other values than the run's did."""
        from tpu_helpers.keras3.steps import fingerprints

        left = [i for i, a in enumerate(arrays) if isinstance(a, tuple)]
        now = fingerprints([variables[i].value for i in left])
        differ = [variables[i].path for i, f in zip(left, now, strict=True) if f != arrays[i]]
        if differ:
            raise CheckpointMismatchError(
                f"{self.directory}/{name} leaves out {len(left)} frozen variable(s) the run"
                f" had not changed, and this model holds other values in {len(differ)} of"
                f" them ({', '.join(differ[:3])}): it was built from another checkpoint, or"
                " drew them at random. Fix: build the model as the run did (the same"
                " checkpoint; keras.utils.set_random_seed before building), or a new folder."
            )

    def _read(self, name: str, count: int) -> list | None:
        """The ``count`` arrays of state file ``name`` (a fingerprint, ``(a, b)``, for each
        variable the save left out), or ``None`` (said) when it is missing or cannot be
        read whole."""
        path = f"{self.directory}/{name}"
        try:
            with self.gfile.GFile(path, "rb") as f:
                saved = np.load(io.BytesIO(f.read()))
                left = {int(i): (int(a), int(b)) for i, a, b in saved.get("unchanged", [])}
                return [left[i] if i in left else saved[f"arr_{i}"] for i in range(count)]
        except Exception as err:  # noqa: BLE001 - missing, truncated, not a zip, short
            self.log(
                f"[keras3] {path} cannot be read ({type(err).__name__}: {first_line(err)});"
                " trying the save before it"
            )
            return None


class JaxTrainer:
    """The Keras 3 engine's side of ``engine.fit_with`` (the one training loop of both
    engines): each epoch through the model's ``steps.Steps`` (each width compiled once,
    ``steps_per_execution`` steps fused, batches put on the devices ahead), the state in
    ``RunSaves``. Keras callbacks are called at the train's and the epochs' beginnings and
    ends, and around each compiled call (``on_train_batch_begin`` with the call's first
    step, ``on_train_batch_end`` with its last; batch logs are empty, so that no call
    waits for the devices; the epoch's logs are whole).
    The state is read from the model's variables at each epoch's start, after the
    callbacks (a learning rate they set counts), and written back at its end."""

    def __init__(self, model, *, log=say, verbose=2):
        self.model, self.log, self.verbose = model, log, verbose
        self.hooks = None
        self.writer = is_writer()

    agree = staticmethod(first_process_says)  # each host's clock may differ

    def steps_per_epoch(self, batches) -> int:
        from tpu_helpers.keras3.steps import hosts

        return batches.steps_on_hosts(hosts()[0], self.steps.devices)

    def model_config(self):
        """The checkpoint's config, with ``num_labels`` the head's outputs."""
        source = getattr(self.model, "hub_source", None)
        if not isinstance(source, HubSource):
            return None
        classes = int(self.model.network.outputs[0].shape[-1])
        return SimpleNamespace(**{**source.config, "num_labels": classes})

    def source_fingerprint(self) -> str | None:
        """The fingerprint of the checkpoint the model was loaded from (``hub``)."""
        from tpu_helpers.data.hub import checkpoint_fingerprint

        source = getattr(self.model, "hub_source", None)
        return checkpoint_fingerprint(source.folder) if isinstance(source, HubSource) else None

    def check(self, train, validation) -> None:
        if getattr(self.model, "optimizer", None) is None:
            raise EngineError(
                "the model is not compiled. Fix: keras3.compile_classifier(model,"
                " learning_rate) or model.compile(...) before fit_resumable."
            )
        self.steps = _steps_for(self.model, train, validation, where="fit_resumable")

    def open(self, directory: str, run: dict, epochs: int) -> tuple[int, int]:
        self.saves, self.epochs = RunSaves(directory, run, self.log), epochs
        new = self.saves.latest() is None
        self.as_built = self.saves.as_built(self.model)  # what saves may leave out, unchanged
        point = self.saves.restore(self.model)
        same_on_every_process([new, point.epoch, point.step], "the save to resume from")
        if new:  # the start: what a re-run after an interrupt reads
            self.saves.save(self.model, ResumePoint(0, 0), unchanged=self.as_built)
        self.first_epoch, self.compiled = point.epoch, sum(self.steps.compiles.values())
        return point.epoch, point.step

    def train_epoch(self, train, validation, epoch, first, after_call, callbacks) -> tuple:
        import keras

        steps, per_epoch = self.steps, self.steps_per_epoch(train)
        if self.hooks is None:
            self.hooks = keras.callbacks.CallbackList(
                list(callbacks), model=self.model, epochs=self.epochs, steps=per_epoch, verbose=0
            )
            self.hooks.on_train_begin()
        if first and self.verbose:
            self.log(f"[keras3] resuming epoch {epoch + 1} at step {first} of {per_epoch}")
        self.hooks.on_epoch_begin(epoch)
        self.state = steps.state()  # after the callbacks: a learning rate they set counts
        if epoch == self.first_epoch:  # in the first epoch's time, as a first epoch pays it
            _precompile(steps, self.state, (train, epoch, first), (validation, 0, 0))

        def calling(done):
            self.hooks.on_train_batch_begin(first + done, {})

        def called(state, done):
            self.state = state
            self.hooks.on_train_batch_end(first + done - 1, {})
            after_call(first + done)

        batches = _epoch(train, steps, epoch, first)
        self.state, report = steps.train(self.state, *batches, called, calling)
        logs = steps.results(self.state[3])
        if validation is not None:
            result = steps.evaluate(self.state[:2], *_epoch(validation, steps))
            logs.update({f"val_{k}": v for k, v in result.items()})
        self.state = steps.write_back(self.state)
        self.hooks.on_epoch_end(epoch, logs)
        total = sum(steps.compiles.values())
        report.new_compiles, self.compiled = total - self.compiled, total
        # each host counted its own rows: the epoch's are every host's
        report.examples, report.real_tokens = summed_over_processes(
            [report.examples, report.real_tokens]
        )
        if self.verbose:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in logs.items())
            self.log(
                f"[keras3] epoch {epoch + 1}: {report.steps} steps in {report.calls} calls,"
                f" {report.examples:,} examples, {report.seconds:.1f} s, {report.rate()};"
                f" {shown}; compiled"
                f" {report.new_compiles} new step(s), {total} in all"
            )
        return logs, report.steps

    def loss(self) -> float | None:
        """The epoch's mean loss so far (from the state's metrics: read from the devices)."""
        return self.steps.results(self.state[3]).get("loss")

    def save(self, epoch: int, step: int) -> None:
        unchanged = self.steps.unchanged(self.state, self.as_built)  # on every process
        values = self.steps.saved_values(self.state, unchanged) if self.writer else None
        self.saves.save(self.model, ResumePoint(epoch, step), values, unchanged)

    def finish(self) -> None:
        if self.hooks is not None:
            self.hooks.on_train_end()

    def predict(self, batches, strategy=None):
        if strategy is not None:
            raise EngineError(
                "a strategy is TensorFlow's; this model runs on the Keras 3 engine, whose"
                " devices keras3.connect set. Fix: predict_classes(model, batches)."
            )
        steps = _steps_for(self.model, batches, where="predict_classes")
        dataset, count = _epoch(batches, steps)
        logits, labels, weights, read = steps.predict(steps.weights(), dataset, count)
        if read < count:  # the data ended before its steps
            raise batches.ran_out(read, "predict_classes")
        return labels, np.argmax(logits, axis=-1), weights


def _steps_for(model, *batches, where: str):
    """The model's ``steps.Steps``, built for ``batches`` (``pipeline.Batches``, or
    ``None``), each refused with the fix unless its global batch splits over the devices."""
    from tpu_helpers.keras3.steps import Steps

    given = [require_batches(b, where) for b in batches if b is not None]
    steps = Steps.of(model)
    for plan in given:
        plan.per_replica_batch(steps.devices)  # refused with the fix unless it splits
    steps.build(given[0].first_batch(where))
    return steps


def _epoch(batches, steps, epoch: int = 0, first: int = 0) -> tuple:
    """``(dataset, steps)``: what this process feeds of ``batches``' epoch ``epoch`` from
    step ``first`` on (its rows of each global batch: ``Batches.host_dataset``), and how
    many steps that is."""
    from tpu_helpers.keras3.steps import hosts

    processes, process = hosts()
    dataset = batches.host_dataset(
        epoch, skip_steps=first, hosts=processes, host=process, devices=steps.devices
    )
    return dataset, batches.steps_on_hosts(processes, steps.devices) - first


def _precompile(steps, state, train, validation) -> None:
    """Compile the train step (and the evaluation's) for every width of the pipelines before
    the first step; each is ``(batches, epoch, first step)``, whose first batch's width
    compiles first (the steps start on it while the other widths compile)."""
    for kind, (batches, epoch, first) in (("train", train), ("evaluate", validation)):
        if batches is not None and batches.widths:
            # a batch of the width the run starts on: a resume point past one host's steps
            # (the filler steps of several hosts reading their own shards) takes the last
            first = min(first, batches.steps_per_epoch - 1)
            dataset = batches.dataset(epoch, skip_steps=first).take(1)
            steps.precompile(kind, state, next(dataset.as_numpy_iterator()), batches.widths)


def compilations(model) -> dict:
    """How many times each step of ``model`` was compiled in this session, by kind and
    batch shape: ``{("train", "[0]['input_ids'][32, 64] ..."): 1, ...}``. Each is 1 when
    every width compiled once, whatever the epochs, calls and resumes."""
    steps = getattr(model, "_tpu_helpers_steps", None)
    return dict(steps.compiles) if steps is not None else {}


def fit_resumable(model, train, epochs: int, directory: str, *, verbose=2, log=say, **options):
    """Train a compiled Keras 3 ``model`` (``classifier``, ``masked_lm``, a KerasHub task) on
    ``train`` (a ``pipeline.Batches``) to ``epochs`` epochs, resuming from the newest save
    in ``directory``: ``engine.fit_with`` with ``JaxTrainer`` (what it saves, checks and
    refuses is said there). ``options``: ``validation``, ``every_steps``,
    ``every_minutes``, ``run``, ``callbacks``. Returns every epoch's history."""
    _keras()  # Keras 3 on another backend is refused, with the fix
    require_engine_model(model, "keras3", "fit_resumable")
    ours, others = fit_options(options)
    if others:
        raise InputTypeError(
            f"{sorted(others)}: not options of fit_resumable on the Keras 3 engine (tf-keras'"
            " fit takes them on the TF engine). Fix: leave them out; validation=,"
            " callbacks=, verbose= and the save cadence are fit_resumable's own."
        )
    return fit_with(JaxTrainer(model, log=log, verbose=verbose), train, epochs, directory, **ours)


def predict_classes(model, batches, strategy=None):
    """``(labels, predictions, weights)`` of one epoch of ``batches`` through a Keras 3
    ``model``, split over the devices as in ``fit_resumable``: ``engine.predict_with``
    (a TF ``strategy`` is refused, naming the fix: the devices are ``connect``'s)."""
    _keras()  # Keras 3 on another backend is refused, with the fix
    require_engine_model(model, "keras3", "predict_classes")
    return predict_with(JaxTrainer(model), batches, strategy)


def evaluate(model, batches) -> dict:
    """The compiled metrics of ``model`` (loss included) over one epoch of ``batches``,
    split over the devices as in ``fit_resumable``."""
    steps = _steps_for(model, batches, where="keras3.evaluate")
    return steps.evaluate(steps.weights(), *_epoch(batches, steps))


def input_bound_check(model, batches, *, steps: int = 30, cached_batches: int = 8):
    """Where a compiled model's training time goes on the Keras 3 engine, as
    ``observe.input_bound_check`` says it for the TF engine (an ``InputBoundReport``: its
    verdict and advice): batches per second of ``batches``' first epoch read and put on the
    devices alone, of the compiled training call alone on ``cached_batches`` batches kept on
    the devices, and of the two together as ``fit_resumable`` runs them. Every width is
    compiled first; the check trains ``steps`` steps three times over on copies of the
    state, and leaves the model's variables as they were."""
    from tpu_helpers.core.pipeline import InputBoundReport

    check_positive(steps=steps, cached_batches=cached_batches)
    if getattr(model, "optimizer", None) is None:
        raise EngineError(
            "the model is not compiled: the check runs its training step. Fix:"
            " model.compile(...) (or keras3.compile_classifier) first."
        )
    steps_ = _steps_for(model, batches, where="keras3.input_bound_check")
    _precompile(steps_, steps_.state(), (batches, 0, 0), (None, 0, 0))
    dataset, _ = _epoch(batches, steps_)
    alone, step, together = steps_.rates(dataset.repeat(), steps, cached_batches)
    return InputBoundReport(alone, step, together, steps)
