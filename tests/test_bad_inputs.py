"""Bad inputs across the public entry points, as a hurried user passes them: each one is
refused with an error that names the value and says the fix (or, where the input is
usable, handled), never a stack trace from deep inside NumPy or TensorFlow."""

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tpu_helpers import checkpoints, images, mlm, records, text, validate
from tpu_helpers.records import RecordsError

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
    from tpu_helpers.training import CustomLoop

    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    return CustomLoop(tf.distribute.get_strategy(), model, tf.keras.optimizers.SGD(), 8)


def _compiled():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile("adam", "mse")
    return model


# (id, call, error type, what the message must say)
CASES = [
    (
        "image names without a folder, one missing",
        lambda tmp: images.image_dataset(["a.jpg", "nope.jpg"], [0, 1], SPEC, 1),
        FileNotFoundError,
        r"1 of 2 image files do not exist, e.g. \['nope.jpg'\].*Fix",
    ),
    (
        "a PNG named .jpg among JPEGs",
        lambda tmp: list(images.image_dataset(["a.jpg", "png.jpg"], [0, 1], SPEC, 2)),
        tf.errors.InvalidArgumentError,
        r"(?s)Not a complete JPEG image.*png.jpg.*rename",
    ),
    (
        "image batch of True",
        lambda tmp: images.image_dataset(["a.jpg"], [0], SPEC, True),
        ValueError,
        r"batch_size=True must be a positive integer. Fix",
    ),
    (
        "image labels fewer than paths",
        lambda tmp: images.image_dataset(["a.jpg", "b.jpg"], [0], SPEC, 1),
        ValueError,
        r"2 paths but 1 labels",
    ),
    (
        "image label None",
        lambda tmp: images.image_dataset(["a.jpg", "b.jpg"], [0, None], SPEC, 1),
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
        lambda tmp: records.read_records([str(tmp / "x")], 0),
        ValueError,
        r"batch_size=0 must be a positive integer",
    ),
    (
        "custom loop with 0 steps an epoch",
        lambda tmp: _tiny_loop().fit(lambda e, s: None, 0, 1),
        ValueError,
        r"steps_per_epoch=0 must be a positive integer. Fix",
    ),
    (
        "custom loop checkpointing every 0 steps",
        lambda tmp: _tiny_loop().fit(lambda e, s: None, 4, 1, checkpoint_every=0),
        ValueError,
        r"checkpoint_every=0 must be a positive integer",
    ),
    (
        "resumable fit for 2.5 epochs",
        lambda tmp: checkpoints.fit_resumable(_compiled(), lambda e, s: None, 4, 2.5, str(tmp)),
        ValueError,
        r"epochs=2.5 must be a positive integer",
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
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_refused_naming_the_value_and_the_fix(folder, call, error, message):
    with pytest.raises(error, match=message):
        call(folder)


def test_folders_and_misnamed_files_are_skipped_and_counted(folder, capsys):
    """A glob that caught .ipynb_checkpoints, and a PNG named .jpg, with on_error='skip'."""
    paths = ["a.jpg", ".ipynb_checkpoints", "png.jpg", "b.jpg"]
    ds = images.image_dataset(paths, [0, 1, 0, 1], SPEC, 2, on_error="skip")
    assert sum(float(w.numpy().sum()) for _, _, w in ds) == 2
    said = capsys.readouterr().out
    assert "skipped 2 of 4 files" in said and "cannot be read" in said
    assert "png.jpg: not a JPEG, although named as one" in said


def test_a_single_remote_file_is_copied_to_the_local_disk():
    from tpu_helpers.storage import local_copy

    with tf.io.gfile.GFile("ram://bad-inputs/vocab.txt", "w") as f:
        f.write("[PAD]\n[UNK]\n")
    local = local_copy("ram://bad-inputs/vocab.txt")
    with open(local) as f:
        assert f.read() == "[PAD]\n[UNK]\n"
