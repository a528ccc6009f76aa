"""Bad inputs across the public entry points, as a hurried user passes them: each one is
refused with an error that names the value and says the fix (or, where the input is
usable, handled), never a stack trace from deep inside NumPy or TensorFlow."""

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tpu_helpers.core import metrics, pipeline, storage, validate
from tpu_helpers.data import images, mlm, packing, records, shapes, text
from tpu_helpers.data.records import RecordsError
from tpu_helpers.teaching import report
from tpu_helpers.tf_engine import observe, strategy, tf_classes, trainer

SPEC = images.ImageSpec(32, 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def _image_bytes(fmt):
    out = io.BytesIO()
    Image.fromarray(np.full((40, 40, 3), 90, np.uint8)).save(out, format=fmt)
    return out.getvalue()


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    """A working folder with two JPEGs, a PNG named .jpg and a subfolder."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.jpg", "b.jpg"):
        (tmp_path / name).write_bytes(_image_bytes("JPEG"))
    (tmp_path / "png.jpg").write_bytes(_image_bytes("PNG"))
    (tmp_path / ".ipynb_checkpoints").mkdir()
    return tmp_path


def _rows(n=6):
    return [{"input_ids": [1, 2, 3][: 1 + i % 3], "label": i % 2} for i in range(n)]


def _gzip_records(tmp_path):
    """GZIP shards with their metadata removed: a folder of files only."""
    out = tmp_path / "gz"
    records.write_records(_rows(), str(out), compression="GZIP", progress=False)
    (out / "train.metadata.json").unlink()
    return str(out / "*.tfrecord.gz")


def _tiny_loop():
    from tpu_helpers.tf_engine.custom_loop import CustomLoop

    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    return CustomLoop(tf.distribute.get_strategy(), model, tf.keras.optimizers.SGD(), 8)


def _compiled():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile("adam", "mse")
    return model


def _plan(steps_per_epoch=4, global_batch=8):
    """A ``pipeline.Batches`` that is never read: the calls refuse before any step."""
    return pipeline.from_dataset_fn(
        lambda epoch, skip: None, steps_per_epoch=steps_per_epoch, global_batch=global_batch
    )


# (id, call, error type, what the message must say)
CASES = [
    (
        "image names without a folder, one missing",
        lambda tmp: images.image_batches(["a.jpg", "nope.jpg"], [0, 1], SPEC, global_batch=1),
        FileNotFoundError,
        r"1 of 2 image files do not exist, e.g. \['nope.jpg'\].*Fix",
    ),
    (
        "image batch of True",
        lambda tmp: images.image_batches(["a.jpg"], [0], SPEC, global_batch=True),
        ValueError,
        r"global_batch=True must be a positive integer. Fix",
    ),
    (
        "image batch as the 4th positional argument",
        lambda tmp: images.image_batches(["a.jpg"], [0], SPEC, 1),
        TypeError,
        r"takes 3 positional arguments",
    ),
    (
        "image labels fewer than paths",
        lambda tmp: images.image_batches(["a.jpg", "b.jpg"], [0], SPEC, global_batch=1),
        ValueError,
        r"2 paths but 1 labels",
    ),
    (
        "image label None",
        lambda tmp: images.image_batches(["a.jpg", "b.jpg"], [0, None], SPEC, global_batch=1),
        ValueError,
        r"'labels' has a missing value \(None\) at row 1.*Fix",
    ),
    (
        "records rows, one with an extra column",
        lambda tmp: records.write_records(
            _rows(3) + [{"input_ids": [1], "label": 0, "extra": 5}], str(tmp / "r")
        ),
        ValueError,
        r"Example 3 has columns \['extra'\] that example 0 has not.*Fix",
    ),
    (
        "records rows, one without the label",
        lambda tmp: records.write_records(_rows(3) + [{"input_ids": [1]}], str(tmp / "r")),
        ValueError,
        r"Example 3 has no column 'label'.*Fix",
    ),
    (
        "GZIP shards read as plain records",
        lambda tmp: records.open_records(
            _gzip_records(tmp), spec={"label": {"dtype": "int64", "shape": []}}
        ),
        RecordsError,
        r"GZIP-compressed and was read as plain records. Fix: compression='GZIP'",
    ),
    (
        "records batch of 0",
        lambda tmp: records.read_records([str(tmp / "x")], global_batch=0),
        ValueError,
        r"global_batch=0 must be a positive integer",
    ),
    (
        "custom loop with 0 steps an epoch",
        lambda tmp: _tiny_loop().fit(_plan(steps_per_epoch=0), 1),
        ValueError,
        r"steps_per_epoch=0 must be a positive integer. Fix",
    ),
    (
        "custom loop on a dataset function",
        lambda tmp: _tiny_loop().fit(lambda e, s: None, 1),
        TypeError,
        r"CustomLoop.fit takes a pipeline.Batches, not function.*pipeline.from_dataset_fn",
    ),
    (
        "custom loop on batches of another global batch",
        lambda tmp: _tiny_loop().fit(_plan(global_batch=16), 1),
        ValueError,
        r"16 rows per step, the loop divides the loss by global_batch=8.*Fix",
    ),
    (
        "custom loop checkpointing every 0 steps",
        lambda tmp: _tiny_loop().fit(_plan(), 1, checkpoint_every=0),
        ValueError,
        r"checkpoint_every=0 must be a positive integer",
    ),
    (
        "resumable fit for 2.5 epochs",
        lambda tmp: trainer.fit_resumable(_compiled(), _plan(), 2.5, str(tmp)),
        ValueError,
        r"epochs=2.5 must be a positive integer",
    ),
    (
        "resumable fit on a dataset function",
        lambda tmp: trainer.fit_resumable(_compiled(), lambda e, s: None, 2, str(tmp)),
        TypeError,
        r"fit_resumable takes a pipeline.Batches, not function.*pipeline.from_dataset_fn",
    ),
    (
        "resumable fit on a dataset",
        lambda tmp: trainer.fit_resumable(_compiled(), tf.data.Dataset.range(3), 2, str(tmp)),
        TypeError,
        r"fit_resumable takes a pipeline.Batches.*pipeline.from_dataset_fn",
    ),
    (
        "max_length of 0",
        lambda tmp: text.check_max_length(0, None),
        ValueError,
        r"max_length=0 must be a positive integer",
    ),
    (
        "a short run of 0 blocks",
        lambda tmp: mlm.leading_text([], "text", 0, 128),
        ValueError,
        r"blocks=0 must be a positive integer",
    ),
    (
        "padding widths out of order",
        lambda tmp: validate.check_boundaries([64, 32]),
        ValueError,
        r"Fix: boundaries=\[32, 64\]",
    ),
    (
        "a label of 2 for a 2-label model",
        lambda tmp: validate.check_labels([0, 1, 2], num_labels=2),
        ValueError,
        r"label 2 at row 2, outside \[0, 2\). Fix: num_labels=3",
    ),
    (
        "packing: a width of 0",
        lambda tmp: packing.pack_rows([3, 4], 0),
        ValueError,
        r"width=0 must be a positive integer",
    ),
    (
        "packing: fractional lengths",
        lambda tmp: packing.pack_rows([3.5, 2], 64),
        ValueError,
        r"lengths holds float64 values.*Fix: lengths=\[len\(ids\)",
    ),
    (
        "packing: an empty example",
        lambda tmp: packing.pack_rows([3, 0], 64),
        ValueError,
        r"lengths has 0 at row 1.*Fix: drop empty examples",
    ),
    (
        "packing: no examples for the row width",
        lambda tmp: packing.row_width([], 64),
        ValueError,
        r"no examples to pack.*Fix",
    ),
    (
        "packing: a per-replica batch of 0",
        lambda tmp: packing.rows_per_replica([3, 4], 0, 64),
        ValueError,
        r"per_replica_batch=0 must be a positive integer",
    ),
    (
        "packing: fewer labels than examples",
        lambda tmp: packing.packed_batches([[1, 2], [3]], [0], width=16, global_batch=2, epochs=1),
        ValueError,
        r"input_ids has 2 rows but labels has 1. Fix",
    ),
    (
        "packing: a test split's -1 label",
        lambda tmp: packing.packed_batches(
            [[1, 2], [3]], [0, -1], width=16, global_batch=2, epochs=1
        ),
        ValueError,
        r"label -1 at row 1.*labelled split",
    ),
    (
        "packing: a label of 2 for a 2-label model",
        lambda tmp: packing.packed_batches(
            [[1, 2], [3]], [0, 2], width=16, global_batch=2, epochs=1, num_labels=2
        ),
        ValueError,
        r"label 2 at row 1, outside \[0, 2\). Fix: num_labels=3",
    ),
    (
        "packing: a batch of 0 rows",
        lambda tmp: packing.packed_batches(
            [[1, 2], [3]], [0, 1], width=16, global_batch=0, epochs=1
        ),
        ValueError,
        r"global_batch=0 must be a positive integer",
    ),
    (
        "packing: token types of another tokenization",
        lambda tmp: packing.packed_batches(
            [[1, 2], [3]], [0, 1], width=16, global_batch=2, epochs=1, token_type_ids=[[0], [0]]
        ),
        ValueError,
        r"Example \d has \d input_ids but \d token_type_ids. Fix",
    ),
    (
        "packing: rows packed for a wider width",
        lambda tmp: packing.packed_arrays([[1, 2], [3]], [0, 1], [[0, 1]], 2, 2),
        ValueError,
        r"Row 0 holds 3 tokens, more than width=2. Fix",
    ),
    (
        "metrics: predictions of another split",
        lambda tmp: metrics.matthews_correlation([0, 1, 1], [0, 1]),
        ValueError,
        r"labels has 3 rows but predictions has 2",
    ),
    (
        "metrics: weights of another split",
        lambda tmp: metrics.accuracy([0, 1], [0, 1], weights=[1]),
        ValueError,
        r"labels has 2 rows but weights has 1",
    ),
    (
        "metrics: a -1 label scored",
        lambda tmp: metrics.matthews_correlation([0, -1], [0, 1]),
        ValueError,
        r"label -1 at row 1",
    ),
    (
        "metrics: only filler rows",
        lambda tmp: metrics.accuracy([0, 1], [0, 1], weights=[0, 0]),
        ValueError,
        r"nothing to score: 2 rows with a total weight of 0.0. Fix",
    ),
    (
        "metrics: no labels for the majority",
        lambda tmp: metrics.majority_rate([]),
        ValueError,
        r"labels is empty.*Fix",
    ),
    (
        "metrics: a list counted as a dataset",
        lambda tmp: metrics.count_examples([1, 2]),
        TypeError,
        r"takes a tf.data.Dataset, not a list. Fix",
    ),
    (
        "observe: no log folder",
        lambda tmp: observe.TrainingLog(None),
        TypeError,
        r"log_dir=None must be a folder path.*Fix",
    ),
    (
        "observe: scalars of a run never written",
        lambda tmp: observe.read_scalars(str(tmp / "logs" / "nope")),
        FileNotFoundError,
        r"no run folder .*nope. Fix",
    ),
    (
        "observe: an input check of 0 steps",
        lambda tmp: observe.input_bound_check(_compiled(), _plan(), steps=0),
        ValueError,
        r"steps=0 must be a positive integer",
    ),
    (
        "observe: an input check of a dataset",
        lambda tmp: observe.input_bound_check(_compiled(), tf.data.Dataset.range(3)),
        TypeError,
        r"input_bound_check takes a pipeline.Batches, not .*Dataset.*from_dataset_fn",
    ),
    (
        "observe: a profile of 0 steps",
        lambda tmp: observe.capture_profile(str(tmp / "p"), lambda: None, steps=0),
        ValueError,
        r"steps=0 must be a positive integer",
    ),
    (
        "report: a list as a metric",
        lambda tmp: report.publish_metrics(accuracy=[0.5, 0.7]),
        TypeError,
        r"Metric accuracy=\[0.5, 0.7\] is a list.*Fix: publish one figure",
    ),
    (
        "text: 0 replicas",
        lambda tmp: text.global_batch_size(8, 0),
        ValueError,
        r"replicas=0 must be a positive integer",
    ),
    (
        "text: a padding report of nothing",
        lambda tmp: text.padding_report([], [32]),
        ValueError,
        r"needs at least one length. Fix",
    ),
    (
        "text: a global batch of 0",
        lambda tmp: text.batch_plan([3, 4], [8], 0),
        ValueError,
        r"global_batch=0 must be a positive integer",
    ),
    (
        "xla: shapes of 0 batches",
        lambda tmp: shapes.shape_report(tf.data.Dataset.range(3).batch(1), n=0),
        ValueError,
        r"n=0 must be a positive integer",
    ),
    (
        "xla: shapes of a number",
        lambda tmp: shapes.shape_report(5),
        TypeError,
        r"not a int. Fix: pass the dataset",
    ),
    (
        "strategy: a TPU named by a number",
        lambda tmp: strategy.connect(tpu=5),
        TypeError,
        r"tpu=5 \(int\) must name a TPU. Fix",
    ),
    (
        "strategy: a fractional replica count",
        lambda tmp: strategy.connect(simulated_replicas=2.5, verbose=False),
        ValueError,
        r"simulated_replicas=2.5 is not a replica count. Fix",
    ),
    (
        "mlm: a masking share of 15",
        lambda tmp: mlm.mask_tokens([[5, 6, 7]], [0, 1], 1, 10, [0], probability=15),
        ValueError,
        r"probability=15 must be between 0 and 1.*Fix: 0.15",
    ),
    (
        "mlm: a tokenizer without a mask token",
        lambda tmp: mlm.mask_tokens([[5, 6, 7]], [0, 1], None, 10, [0]),
        ValueError,
        r"mask_token_id is None.*Fix",
    ),
    (
        "mlm: perplexity of a metric not logged",
        lambda tmp: mlm.perplexity({"loss": [1.0]}),
        KeyError,
        r"'mlm_loss' is not among the logged metrics \['loss'\].*Fix",
    ),
    (
        "storage: a folder that is not there",
        lambda tmp: storage.copy_tree(str(tmp / "nope"), str(tmp / "copy")),
        FileNotFoundError,
        r"no folder .*nope to copy. Fix",
    ),
    (
        "tf_classes: nothing to save",
        lambda tmp: tf_classes.save_pretrained(str(tmp / "out")),
        TypeError,
        r"got nothing. Fix: save_pretrained\(output_dir, model, tokenizer\)",
    ),
    (
        "checkpoints: saves every -1 minutes",
        lambda tmp: trainer.fit_resumable(_compiled(), _plan(), 2, str(tmp), every_minutes=-1),
        ValueError,
        r"every_minutes=-1 must be a number of minutes. Fix",
    ),
    (
        "checkpoints: no checkpoint folder",
        lambda tmp: trainer.fit_resumable(_compiled(), _plan(), 2, None),
        TypeError,
        r"directory=None must be a folder path.*Fix",
    ),
    (
        "a save folder written as a malformed URL",
        lambda tmp: trainer.fit_resumable(_compiled(), _plan(), 2, "gs:/bucket/run"),
        ValueError,
        r"'gs:/bucket/run' is neither a local folder nor a well-formed URL.*Fix: gs://bucket/run",
    ),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_refused_naming_the_value_and_the_fix(folder, call, error, message):
    with pytest.raises(error, match=message):
        call(folder)


def test_folders_are_skipped_and_counted_and_misnamed_files_kept(folder, capsys):
    """A glob that caught .ipynb_checkpoints, and a PNG named .jpg, with on_error='skip':
    the folder is skipped; the PNG is an image (read by its content, as on_error='raise'
    reads it)."""
    paths = ["a.jpg", ".ipynb_checkpoints", "png.jpg", "b.jpg"]
    batches = images.image_batches(paths, [0, 1, 0, 1], SPEC, global_batch=2, on_error="skip")
    assert sum(float(w.numpy().sum()) for _, _, w in batches.dataset()) == 3
    said = capsys.readouterr().out
    assert "skipped 1 of 4 files" in said and "cannot be read" in said
    assert "png.jpg" not in said


def test_a_single_remote_file_is_copied_to_the_local_disk():
    from tpu_helpers.core.storage import local_copy

    with tf.io.gfile.GFile("ram://bad-inputs/vocab.txt", "w") as f:
        f.write("[PAD]\n[UNK]\n")
    local = local_copy("ram://bad-inputs/vocab.txt")
    with open(local) as f:
        assert f.read() == "[PAD]\n[UNK]\n"


def test_a_png_named_jpg_among_jpegs_is_decoded(folder):
    """Once refused (``Not a complete JPEG image ... rename``): now decoded as the PNG it
    is, while the JPEGs keep their reduced decode."""
    batches = images.image_batches(["a.jpg", "png.jpg"], [0, 1], SPEC, global_batch=2)
    (features, labels, weights), *more = list(batches.dataset())
    pixels = images.pixels_of(features["pixel_values"].numpy(), SPEC)
    assert not more and labels.numpy().tolist() == [0, 1] and weights.numpy().tolist() == [1, 1]
    assert np.abs(pixels[1] - 90).max() < 1  # the PNG's flat gray, decoded
