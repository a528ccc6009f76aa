import io
import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tpu_helpers.data import images
from tpu_helpers.teaching.fixtures import leaf_image

SPEC = images.ImageSpec(32, 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def _bytes(array, fmt="JPEG"):
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


@pytest.fixture(scope="module")
def bucket():
    """Six leaves (two per class) as JPEGs and one PNG on a ram:// 'bucket'."""
    rng = np.random.default_rng(0)
    paths, labels, arrays = [], [], []
    for i in range(6):
        array = leaf_image(rng, i % 3, 200)
        path = f"ram://images-test/train/class{i % 3}/leaf{i}.jpg"
        tf.io.gfile.makedirs(path.rsplit("/", 1)[0])
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(_bytes(array))
        paths.append(path)
        labels.append(i % 3)
        arrays.append(array)
    png = "ram://images-test/train/class0/leaf.png"
    with tf.io.gfile.GFile(png, "wb") as f:
        f.write(_bytes(arrays[0], "PNG"))
    return paths, labels, png


def _processor_pixels(path, size=32):
    from transformers import ViTImageProcessor

    processor = ViTImageProcessor(
        size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    with tf.io.gfile.GFile(path, "rb") as f:
        image = Image.open(io.BytesIO(f.read())).convert("RGB")
    return processor(images=image, return_tensors="np")["pixel_values"][0]


def test_spec_is_read_from_the_processor(fixtures_dir):
    from transformers import AutoImageProcessor, CLIPImageProcessor, ConvNextImageProcessor

    spec = images.ImageSpec.from_processor(
        AutoImageProcessor.from_pretrained(str(fixtures_dir / "tiny-vit"))
    )
    assert (spec.height, spec.width, spec.mean, spec.std) == (32, 32, (0.5,) * 3, (0.5,) * 3)
    assert spec.rescale_factor == pytest.approx(1 / 255)
    convnext = images.ImageSpec.from_processor(ConvNextImageProcessor(size={"shortest_edge": 64}))
    assert (convnext.height, convnext.width) == (64, 64)
    clip = images.ImageSpec.from_processor(
        CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 56, "width": 56})
    )
    assert (clip.height, clip.width) == (56, 56) and clip.mean[0] == pytest.approx(0.4815, 1e-3)


def _saved_processor(folder, settings: dict):
    folder.mkdir()
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    return str(folder)


@pytest.mark.parametrize(
    "settings",
    [
        # as save_pretrained writes them: every setting, and some not the class's defaults
        {
            "image_processor_type": "ViTImageProcessor",
            "size": {"height": 48, "width": 40},
            "resample": 3,
            "image_mean": [0.1, 0.2, 0.3],
            "do_rescale": True,
        },
        {"image_processor_type": "DeiTImageProcessor"},
        {"image_processor_type": "BeitImageProcessor", "crop_size": {"height": 200, "width": 200}},
        {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 64}},
        {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 384}},
        {"image_processor_type": "CLIPImageProcessor", "crop_size": 56, "size": 64},
        {
            "image_processor_type": "MobileViTImageProcessor",
            "crop_size": {"height": 200, "width": 200},
        },
        {"image_processor_type": "SegformerImageProcessor", "do_normalize": False},
        {"image_processor_type": "EfficientFormerImageProcessor"},
        # as older checkpoints on the hub have them: a feature extractor, sizes as numbers,
        # steps left out (google/vit-base-patch16-224's file has no do_rescale)
        {
            "feature_extractor_type": "ViTFeatureExtractor",
            "size": 224,
            "resample": 2,
            "do_normalize": True,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
        },
        {"feature_extractor_type": "DeiTFeatureExtractor", "size": 256, "crop_size": 224},
        {"feature_extractor_type": "ConvNextFeatureExtractor", "size": 224, "crop_pct": 0.9},
        {"image_processor_type": "ViTImageProcessorFast", "do_rescale": False},
    ],
)
def test_spec_from_the_files_equals_transformers_own_processor(tmp_path, settings):
    """What the Keras 3 engine reads without PyTorch (transformers 5 builds no image
    processor without it) is what transformers' processor does with the same file."""
    from transformers import AutoImageProcessor

    folder = _saved_processor(tmp_path / "checkpoint", settings)
    theirs = images.ImageSpec.from_processor(AutoImageProcessor.from_pretrained(folder))
    assert images.ImageSpec.from_pretrained(folder) == theirs


def test_rebase_paths_keeps_class_folder_and_file():
    paths = ["/data/beans/train/bean_rust/a.jpg", "C:\\beans\\healthy\\b.jpg"]
    assert images.rebase_paths(paths, "gs://bucket/beans/") == [
        "gs://bucket/beans/bean_rust/a.jpg",
        "gs://bucket/beans/healthy/b.jpg",
    ]


def test_pixels_match_the_hugging_face_processor(bucket):
    paths, labels, png = bucket
    batches = images.image_batches(paths + [png], labels + [0], SPEC, global_batch=7)
    features, got_labels, weights = next(iter(batches.dataset()))
    pixels = features["pixel_values"].numpy()
    assert pixels.shape == (7, 3, 32, 32) and pixels.dtype == np.float32
    assert got_labels.numpy().tolist() == labels + [0]
    assert weights.numpy().tolist() == [1.0] * 7
    for i, path in enumerate(paths + [png]):
        expected = _processor_pixels(path)
        assert np.abs(pixels[i] - expected).mean() < 0.03, path
    # a different image is far away: the comparison can fail
    assert np.abs(pixels[1] - _processor_pixels(paths[0])).mean() > 0.05


def test_each_jpeg_is_decoded_as_far_down_as_leaves_twice_the_target():
    for size, scale in [((1024, 1024), 8), ((512, 600), 4), ((256, 256), 2), ((255, 999), 1)]:
        assert int(images.decode_scale(size, 64, 64)) == scale, size
    assert int(images.decode_scale((4000, 3000), 224, 224)) == 4  # 750 x 1000 left


def test_evaluation_batches_score_every_image_once(bucket):
    paths, labels, _ = bucket
    plan = images.image_batches(paths, labels, SPEC, global_batch=4)
    batches = list(plan.dataset())
    assert len(batches) == plan.steps_per_epoch == 2 and plan.examples == 6
    weights = np.concatenate([w.numpy() for _, _, w in batches])
    assert weights.tolist() == [1] * 6 + [0] * 2


def test_fewer_images_than_a_batch_evaluate_in_one_and_do_not_train(bucket):
    """Eight replicas of 8 make a global batch of 64, more than a small validation split."""
    paths, labels, _ = bucket
    plan = images.image_batches(paths, labels, SPEC, global_batch=16)
    (_, got, weights), *more = list(plan.dataset())
    assert plan.steps_per_epoch == 1 and not more and weights.shape == (16,)
    assert weights.numpy().tolist() == [1] * 6 + [0] * 10
    assert got.numpy()[:6].tolist() == labels
    with pytest.raises(ValueError, match="6 images make no full training batch of 16"):
        images.image_batches(paths, labels, SPEC, global_batch=16, training=True)


def test_training_augments_differently_each_epoch_and_repeats_per_seed(bucket):
    paths, labels, _ = bucket

    def epochs(seed):
        batches = images.image_batches(
            paths, labels, SPEC, global_batch=6, training=True, seed=seed
        )
        return [next(iter(batches.dataset(epoch))) for epoch in range(2)]

    (a1, la1, wa1), (a2, la2, _) = epochs(3)
    (b1, _, _), _ = epochs(3)
    first, second = a1["pixel_values"].numpy(), a2["pixel_values"].numpy()
    np.testing.assert_array_equal(first, b1["pixel_values"].numpy())
    assert not np.array_equal(first, second)
    assert sorted(la1.numpy().tolist()) == sorted(labels)
    assert first.shape == (6, 3, 32, 32) and wa1.numpy().tolist() == [1.0] * 6


@pytest.mark.parametrize("cache", [False, True], ids=["streamed", "cached"])
def test_an_epoch_resumed_mid_way_gets_the_batches_of_the_uninterrupted_one(bucket, cache):
    paths, labels, _ = bucket
    paths, labels = paths * 2, labels * 2  # 12 images: 6 batches of 2

    plan = images.image_batches(
        paths, labels, SPEC, global_batch=2, training=True, seed=1, cache=cache
    )
    assert plan.steps_per_epoch == 6

    def batches(epoch, skip=0):
        return [
            (f["pixel_values"].numpy(), y.numpy())
            for f, y, _ in plan.dataset(epoch, skip_steps=skip)
        ]

    whole, resumed = batches(1), batches(1, skip=4)
    assert len(whole) == 6 and len(resumed) == 2
    for (a, ya), (b, yb) in zip(whole[4:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)  # same images, same crops and flips
        assert ya.tolist() == yb.tolist()
    other = batches(2)
    assert not all(np.array_equal(a, b) for (a, _), (b, _) in zip(whole, other, strict=True))
    # each epoch has an order of its own, from the cache too (epochs are no longer passes
    # over one dataset: the same epoch read twice gives the same batches)
    one = images.image_batches(
        paths, labels, SPEC, global_batch=12, training=True, seed=1, cache=cache
    )
    first, second, again = ([y.numpy().tolist() for _, y, _ in one.dataset(e)] for e in (0, 1, 0))
    assert first != second and first == again
    with pytest.raises(ValueError, match="skip_steps=7: an epoch of .* has 6 steps of 2 rows"):
        plan.dataset(0, skip_steps=7)


def _broken_files():
    good = _bytes(leaf_image(np.random.default_rng(1), 0, 64))
    files = {
        "ram://images-bad/truncated.jpg": good[: len(good) // 2],
        "ram://images-bad/text.jpg": b"this is not an image at all",
    }
    tf.io.gfile.makedirs("ram://images-bad")
    for path, data in files.items():
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(data)
    with tf.io.gfile.GFile("ram://images-bad/good.jpg", "wb") as f:
        f.write(good)
    return list(files)


def test_the_images_a_data_set_carries_are_written_as_files_to_stream(tmp_path):
    import datasets

    pictures = [leaf_image(np.random.default_rng(i), i % 3, size=40) for i in range(4)]
    encoded = []
    for i, picture in enumerate(pictures):
        buffer = io.BytesIO()
        Image.fromarray(picture).save(buffer, format="PNG" if i == 1 else "JPEG")
        encoded.append(buffer.getvalue())
    split = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in encoded], "labels": [0, 1, 2, 0]},
        features=datasets.Features({"image": datasets.Image(), "labels": datasets.Value("int64")}),
    )
    paths = images.write_image_files(split, str(tmp_path / "beans"))
    assert [p.rsplit("/", 2)[-2] for p in paths] == ["0", "1", "2", "0"]
    assert paths[1].endswith(".png") and paths[0].endswith(".jpg")
    assert [open(p, "rb").read() for p in paths] == encoded  # the stored bytes, unchanged
    written = {p: tf.io.gfile.stat(p).mtime_nsec for p in paths}
    assert images.write_image_files(split, str(tmp_path / "beans")) == paths
    assert {p: tf.io.gfile.stat(p).mtime_nsec for p in paths} == written  # kept, not rewritten
    with pytest.raises(ValueError, match="image_column="):
        images.write_image_files(split, str(tmp_path / "x"), image_column="img")


def _carried_split(tmp_path, listed_exist: bool):
    """A split as the hub's beans is: listed paths, labels and the images themselves."""
    import datasets

    encoded, listed = [], []
    for i in range(3):
        buffer = io.BytesIO()
        Image.fromarray(leaf_image(np.random.default_rng(i), i, size=40)).save(buffer, "JPEG")
        encoded.append(buffer.getvalue())
        listed.append(str(tmp_path / "listed" / f"class{i}" / f"{i}.jpg"))
        if listed_exist:
            Path(listed[-1]).parent.mkdir(parents=True, exist_ok=True)
            Path(listed[-1]).write_bytes(encoded[-1])
    features = datasets.Features(
        {
            "image_file_path": datasets.Value("string"),
            "image": datasets.Image(),
            "labels": datasets.Value("int64"),
        }
    )
    rows = {
        "image_file_path": listed,
        "image": [{"bytes": b, "path": None} for b in encoded],
        "labels": [2, 0, 1],
    }
    return datasets.Dataset.from_dict(rows, features=features), encoded, listed


def test_the_file_list_comes_from_the_bucket_the_listed_paths_or_the_carried_images(tmp_path):
    """``files_of``: a base path moves the listed paths onto it; listed paths this machine
    has are read as they are; else the images the data set carries are written once to a
    folder; with neither, the error names the file and the fix."""
    split, encoded, listed = _carried_split(tmp_path, listed_exist=False)
    paths, labels = images.files_of(split, "gs://bucket/beans")
    assert paths == [f"gs://bucket/beans/class{i}/{i}.jpg" for i in range(3)]
    assert labels == [2, 0, 1]
    paths, labels = images.files_of(split, "", str(tmp_path / "written"))
    assert [p.rsplit("/", 2)[-2] for p in paths] == ["2", "0", "1"] and labels == [2, 0, 1]
    assert [open(p, "rb").read() for p in paths] == encoded
    with pytest.raises(ValueError, match="Fix: folder="):
        images.files_of(split)
    with pytest.raises(ValueError, match=r"class0/0\.jpg.*Fix: base_path="):
        images.files_of(split.remove_columns("image"), "", str(tmp_path / "w"))
    here, _, listed = _carried_split(tmp_path / "here", listed_exist=True)
    assert images.files_of(here, "", str(tmp_path / "unused"))[0] == listed
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("name", ["truncated.jpg", "text.jpg"])
def test_a_broken_file_is_named(name):
    _broken_files()
    path = f"ram://images-bad/{name}"
    batches = images.image_batches(
        ["ram://images-bad/good.jpg", path], [0, 1], SPEC, global_batch=2
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"{name}.*on_error="):
        list(batches.dataset())


def test_missing_files_are_named_before_reading():
    _broken_files()
    paths = ["ram://images-bad/good.jpg", "ram://images-bad/missing.jpg", "ram://nowhere/x.jpg"]
    with pytest.raises(FileNotFoundError, match="2 of 3 image files.*missing.jpg.*nowhere"):
        images.image_batches(paths, [0, 1, 2], SPEC, global_batch=1)


def test_bad_files_can_be_skipped_and_are_counted(capsys):
    bad = _broken_files()
    paths = ["ram://images-bad/good.jpg"] * 3 + bad + ["ram://images-bad/missing.jpg"]
    batches = images.image_batches(paths, [0] * len(paths), SPEC, global_batch=3, on_error="skip")
    out = capsys.readouterr().out
    assert "skipped 3 of 6 files" in out and "truncated JPEG" in out and "missing" in out
    assert sum(int(w.numpy().sum()) for _, _, w in batches.dataset()) == 3


def test_problems_found_in_bytes():
    good = _bytes(leaf_image(np.random.default_rng(2), 1, 40))
    assert images.image_problem(good) is None
    assert images.image_problem(good + b"\0" * 10) is None  # trailing padding is fine
    assert "truncated JPEG" in images.image_problem(good[:-100])
    png = _bytes(leaf_image(np.random.default_rng(2), 1, 40), "PNG")
    assert images.image_problem(png) is None and "PNG" in images.image_problem(png[:-20])
    assert "not a JPEG" in images.image_problem(b"GIF? no")
    for data in (good, good + b"\0" * 10, good[:-100], png, png[:-20], b"nope"):
        assert bool(images._valid(tf.constant(data))) == (images.image_problem(data) is None)


def test_labels_are_checked_against_the_classes_and_the_model():
    from types import SimpleNamespace

    images.check_classes([0, 1, 2], ["a", "b", "c"], SimpleNamespace(num_labels=3))
    with pytest.raises(ValueError, match=r"label 3 at row 1, outside \[0, 3\).*'a', 'b'"):
        images.check_classes([0, 3], ["a", "b", "c"])
    with pytest.raises(ValueError, match="10 output labels, the data 3 classes.*num_labels=3"):
        images.check_classes([0, 1], ["a", "b", "c"], SimpleNamespace(num_labels=10))


@pytest.mark.parametrize(
    "labels, num_labels, message",
    [
        ([0, 1, 2, 7, 0, 1], 3, r"label 7 at row 3, outside \[0, 3\).*num_labels=8"),
        ([0, 1, -1, 2, 0, 1], None, r"label -1 at row 2.*split without labels"),
        ([0, 1, 2.5, 2, 0, 1], None, r"label 2.5 at row 2: class labels are whole numbers"),
    ],
)
def test_the_image_pipeline_refuses_labels_the_model_cannot_train_on(
    bucket, labels, num_labels, message
):
    """A label beyond the model's outputs trains to a NaN loss under XLA, silently."""
    paths, _, _ = bucket
    with pytest.raises(ValueError, match=message):
        images.image_batches(
            paths, labels, SPEC, global_batch=2, training=True, num_labels=num_labels
        )


def test_images_round_trip_through_tfrecords(bucket):
    paths, labels, _ = bucket
    meta = images.write_image_records(paths, labels, "ram://images-records", shard_records=4)
    assert meta["num_records"] == 6 and len(meta["shards"]) == 2
    batches = images.image_record_batches("ram://images-records", SPEC, global_batch=3)
    got = [(f["pixel_values"].numpy(), y.numpy()) for f, y, _ in batches.dataset()]
    assert batches.steps_per_epoch == 2 and len(got) == 2
    pixels = np.concatenate([p for p, _ in got])
    order = np.concatenate([y for _, y in got]).tolist()
    assert order == labels
    for i, path in enumerate(paths):
        assert np.abs(pixels[i] - _processor_pixels(path)).mean() < 0.03
    training = images.image_record_batches(
        "ram://images-records", SPEC, global_batch=3, training=True
    )
    shuffled = [(f["pixel_values"].numpy(), y.numpy()) for f, y, _ in training.dataset()]
    assert [p.shape for p, _ in shuffled] == [(3, 3, 32, 32)] * 2
    assert sorted(np.concatenate([y for _, y in shuffled]).tolist()) == sorted(labels)
    assert not np.allclose(np.concatenate([p for p, _ in shuffled]), pixels)  # augmented


def test_a_corrupt_image_record_shard_is_named_to_whatever_reads_it(bucket, tmp_path):
    """The records' per-shard check covers image records too: a flipped byte stops a plain
    loop over the batches with the shard's name and the fix, not a DataLossError."""
    import tensorflow as tf

    paths, labels, _ = bucket
    meta = images.write_image_records(paths, labels, str(tmp_path), shard_records=4)
    shard = tmp_path / meta["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, broken CRC
    shard.write_bytes(bytes(data))
    batches = images.image_record_batches(str(tmp_path), SPEC, global_batch=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"{shard.name} ends after \d+ of"):
        for _ in batches.dataset(0):
            pass


def _plan(kind, paths, labels, global_batch, seed=4):
    """The training ``Batches`` of ``paths`` from files (streamed or cached) or records."""
    if kind == "records":
        folder = f"ram://images-resume-{len(paths)}"
        images.write_image_records(paths, labels, folder, shard_records=4)
        return images.image_record_batches(
            folder, SPEC, global_batch=global_batch, training=True, seed=seed
        )
    return images.image_batches(
        paths,
        labels,
        SPEC,
        global_batch=global_batch,
        training=True,
        seed=seed,
        cache=kind == "cached files",
    )


@pytest.mark.parametrize("kind", ["files", "cached files", "records"])
def test_a_resumed_training_epoch_is_the_tail_of_the_whole_one(bucket, kind):
    """11 images in batches of 3: 4 steps, the last completed with one weight-0 copy."""
    paths, labels, _ = bucket
    paths, labels = (paths * 2)[:11], (labels * 2)[:11]
    plan = _plan(kind, paths, labels, 3)
    assert plan.steps_per_epoch == 4 and plan.global_batch == 3 and plan.examples == 11

    def read(epoch, skip=0):
        return [
            (f["pixel_values"].numpy(), y.numpy(), w.numpy())
            for f, y, w in plan.dataset(epoch, skip_steps=skip)
        ]

    for epoch in (0, 1):
        whole = read(epoch)
        assert len(whole) == len(list(plan.dataset(epoch))) == plan.steps_per_epoch
        weights = np.concatenate([w for _, _, w in whole])
        assert weights.sum() == len(paths) and sorted(set(weights.tolist())) == [0.0, 1.0]
        real = np.concatenate([y for _, y, _ in whole])[weights > 0]
        assert sorted(real.tolist()) == sorted(labels)  # every image once with weight 1
        for skip in (1, 2, 3):
            resumed = read(epoch, skip)
            assert len(resumed) == plan.steps_per_epoch - skip
            for (a, ya, wa), (b, yb, wb) in zip(whole[skip:], resumed, strict=True):
                np.testing.assert_array_equal(a, b)  # same images, crops and flips
                assert ya.tolist() == yb.tolist() and wa.tolist() == wb.tolist()
    assert not np.array_equal(read(0)[0][0], read(1)[0][0])  # epochs differ


def test_a_png_named_jpg_and_a_one_pixel_image_train(bucket):
    """Among JPEGs (reduced decode), a PNG named .jpg is decoded (no longer refused) and a
    1x1 image is cropped to at least one pixel (no longer an empty crop)."""
    paths, labels, png = bucket
    tf.io.gfile.makedirs("ram://images-odd")
    misnamed, dot = "ram://images-odd/png-inside.jpg", "ram://images-odd/dot.jpg"
    with tf.io.gfile.GFile(png, "rb") as f, tf.io.gfile.GFile(misnamed, "wb") as out:
        out.write(f.read())
    with tf.io.gfile.GFile(dot, "wb") as f:
        f.write(_bytes(np.full((1, 1, 3), 200, np.uint8)))
    files, classes = [*paths, misnamed, dot], [*labels, 0, 1]
    plan = images.image_batches(files, classes, SPEC, global_batch=3, training=True, seed=2)
    for epoch in (0, 1):
        got = list(plan.dataset(epoch))
        assert len(got) == plan.steps_per_epoch == 3
        pixels = np.concatenate([f["pixel_values"].numpy() for f, _, _ in got])
        assert pixels.shape == (9, 3, 32, 32) and np.isfinite(pixels).all()
        assert sum(float(w.numpy().sum()) for _, _, w in got) == len(files)
    # in evaluation, the misnamed PNG is the processor's picture
    features, _, _ = next(
        iter(images.image_batches([misnamed], [0], SPEC, global_batch=1).dataset())
    )
    assert np.abs(features["pixel_values"].numpy()[0] - _processor_pixels(png)).mean() < 0.03


def test_fewer_image_records_than_a_training_batch_are_refused(bucket):
    paths, labels, _ = bucket
    images.write_image_records(paths, labels, "ram://images-few", shard_records=4)
    with pytest.raises(
        ValueError, match=r"holds 6 image record\(s\), which make no full training batch of 8.*Fix"
    ):
        images.image_record_batches("ram://images-few", SPEC, global_batch=8, training=True)
    # evaluation completes the one batch with weight-0 copies instead
    plan = images.image_record_batches("ram://images-few", SPEC, global_batch=8)
    (_, got, weights), *more = list(plan.dataset())
    assert plan.steps_per_epoch == 1 and not more
    assert weights.numpy().tolist() == [1] * 6 + [0] * 2 and got.numpy()[:6].tolist() == labels


# --- sizes, read from the header before decoding ------------------------------------------
def _forged_jpeg(height, width):
    """A small JPEG whose frame header claims ``height x width``."""
    data = bytearray(_bytes(leaf_image(np.random.default_rng(3), 0, 16)))
    at = 2
    while not (0xC0 <= data[at + 1] <= 0xC3):
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    data[at + 5 : at + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def _png_claiming(height, width):
    data = bytearray(_bytes(leaf_image(np.random.default_rng(3), 0, 16), "PNG"))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    return bytes(data)


def test_image_sizes_come_from_the_headers():
    rng = np.random.default_rng(4)
    array = leaf_image(rng, 1, 40)[:30]  # 30 x 40
    for fmt in ("JPEG", "PNG", "GIF", "BMP"):
        assert images.image_size(_bytes(array, fmt)) == (30, 40), fmt
    assert images.image_size(_forged_jpeg(20000, 20000)) == (20000, 20000)
    assert "over the limit" in images.image_problem(_forged_jpeg(20000, 20000))
    assert "over the limit" in images.image_problem(_png_claiming(50000, 50000))


@pytest.mark.parametrize(
    "name, data",
    [("forged.jpg", _forged_jpeg(20000, 20000)), ("bomb.png", _png_claiming(50000, 50000))],
)
def test_an_image_over_the_pixel_limit_is_refused_before_decoding(name, data):
    path = f"ram://images-big/{name}"
    tf.io.gfile.makedirs("ram://images-big")
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(data)
    batches = images.image_batches(
        [path], [0], SPEC, global_batch=1, reduced_decode=name.endswith(".jpg")
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"{name}.*over 89,478,485 pixels"):
        list(batches.dataset())
    _broken_files()
    good = "ram://images-bad/good.jpg"
    skipped = images.image_batches([good, path], [0, 0], SPEC, global_batch=1, on_error="skip")
    assert sum(float(w.numpy().sum()) for _, _, w in skipped.dataset()) == 1


def _texture(rng, size):
    """Detail at every scale from 2 to 16 pixels, and noise: what a reduced decode that
    lands on the target size gets wrong (smooth pictures hide it)."""
    x = np.zeros((size, size, 3))
    for k in (2, 4, 8, 16):
        cells = rng.uniform(0, 255, (size // k + 1, size // k + 1, 3))
        x += np.kron(cells, np.ones((k, k, 1)))[:size, :size] / 4
    return np.clip(x + rng.normal(0, 20, x.shape), 0, 255).astype(np.uint8)


def test_mixed_image_sizes_each_come_out_as_the_processor_makes_them():
    """Large and small detailed JPEGs into a 64 px model: one decode scale for the data
    set decoded the small ones straight to 64 px, 13 (of 255) per pixel from the
    processor; each decoded at its own scale, every image is within 1.5."""
    rng = np.random.default_rng(5)
    tf.io.gfile.makedirs("ram://images-mixed")
    paths = []
    for i, size in enumerate([512, 128, 512, 200, 128, 1024]):
        path = f"ram://images-mixed/{i}.jpg"
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(_bytes(_texture(rng, size)))
        paths.append(path)
    spec = images.ImageSpec(64, 64, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    batches = images.image_batches(paths, [0] * 6, spec, global_batch=6)
    ours = images.pixels_of(next(iter(batches.dataset()))[0]["pixel_values"].numpy(), spec)
    theirs = images.pixels_of(np.stack([_processor_pixels(p, 64) for p in paths]), spec)
    distance = np.abs(ours - theirs).mean(axis=(1, 2, 3))
    assert (distance < 1.5).all(), distance.round(2)


# --- every image processor of transformers' TF image classifiers --------------------------
def _processors():
    from transformers import (
        BeitImageProcessor,
        ConvNextImageProcessor,
        DeiTImageProcessor,
        MobileViTImageProcessor,
        SegformerImageProcessor,
        ViTImageProcessor,
    )
    from transformers.models.deprecated.efficientformer.image_processing_efficientformer import (
        EfficientFormerImageProcessor,
    )

    crop = {"height": 48, "width": 48}
    return {  # the processors' own defaults, at sizes small enough for a unit test
        "vit (swin, swiftformer)": ViTImageProcessor(size={"height": 48, "width": 40}),
        "deit": DeiTImageProcessor(size={"height": 64, "width": 64}, crop_size=crop),
        "beit (data2vec-vision)": BeitImageProcessor(
            size={"height": 60, "width": 56}, crop_size=crop
        ),
        "convnext (resnet, regnet, cvt)": ConvNextImageProcessor(
            size={"shortest_edge": 48}, crop_pct=0.875, resample=3
        ),
        "convnext >= 384: warped": ConvNextImageProcessor(size={"shortest_edge": 384}),
        "efficientformer": EfficientFormerImageProcessor(
            size={"shortest_edge": 56}, crop_size=crop
        ),
        "mobilevit (BGR, no normalize)": MobileViTImageProcessor(
            size={"shortest_edge": 56}, crop_size=crop
        ),
        "segformer": SegformerImageProcessor(size={"height": 48, "width": 48}),
    }


def _pictures():
    rng = np.random.default_rng(7)  # landscape, portrait, square
    return [leaf_image(rng, 0, 200)[:150], leaf_image(rng, 1, 200)[:, :130], leaf_image(rng, 2, 90)]


def _as_pixels(pixel_values, spec):
    """A processor's output back in 0-255 pixel units (so that std does not scale errors)."""
    x = np.transpose(pixel_values, (1, 2, 0)).astype(np.float64)
    if spec.do_normalize:
        x = x * np.array(spec.std) + np.array(spec.mean)
    return x / spec.rescale_factor


def _reference(processor, data):
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return processor(images=image, return_tensors="np")["pixel_values"][0]


@pytest.mark.parametrize("name", list(_processors()))
def test_pixels_match_each_processor_on_every_aspect_ratio(name):
    import dataclasses

    processor = _processors()[name]
    spec = images.ImageSpec.from_processor(processor)
    wrong_filter = dataclasses.replace(
        spec, resample="bilinear" if spec.resample == "bicubic" else "bicubic"
    )
    skipped_crop = dataclasses.replace(spec, crop=False, resize=None, shortest_edge=None)
    for picture in _pictures():
        png = _bytes(picture, "PNG")
        expected = _as_pixels(_reference(processor, png), spec)
        ours = images.decode_image(tf.constant(png), spec).numpy()
        assert ours.shape == expected.shape
        error = np.abs(ours - expected).mean()
        assert error < 0.4, (name, picture.shape, error)  # pixel units, 0-255
        # the tolerance is one that a wrong filter or a skipped crop breaks
        assert (
            np.abs(images.decode_image(tf.constant(png), wrong_filter).numpy() - expected).mean()
            > 0.6
        )
        if spec.crop:
            got = images.decode_image(tf.constant(png), skipped_crop).numpy()
            assert np.abs(got - expected).mean() > 5


@pytest.mark.parametrize(
    "name", ["deit", "convnext (resnet, regnet, cvt)", "mobilevit (BGR, no normalize)"]
)
def test_the_pipeline_matches_the_processor_for_jpegs_and_pngs(name):
    processor = _processors()[name]
    spec = images.ImageSpec.from_processor(processor)
    tf.io.gfile.makedirs("ram://images-processors")
    for fmt, tolerance in (("PNG", 0.4), ("JPEG", 3.0)):  # JPEG: decoded at a reduced scale
        paths, expected = [], []
        for i, picture in enumerate(_pictures()):
            data = _bytes(picture, fmt)
            path = f"ram://images-processors/{name[:4]}{i}.{fmt.lower()}"
            with tf.io.gfile.GFile(path, "wb") as f:
                f.write(data)
            paths.append(path)
            expected.append(_as_pixels(_reference(processor, data), spec))
        batches = images.image_batches(paths, [0, 1, 2], spec, global_batch=3)
        features, _, _ = next(iter(batches.dataset()))
        got = [_as_pixels(x, spec) for x in features["pixel_values"].numpy()]
        for path, a, b in zip(paths, got, expected, strict=True):
            assert np.abs(a - b).mean() < tolerance, path


def test_processor_steps_the_pipeline_cannot_do_are_named():
    from transformers import CLIPImageProcessor, ViTImageProcessor

    padded = ViTImageProcessor(size={"height": 32, "width": 32})
    padded.do_pad = True
    with pytest.raises(ValueError, match="applies \\['do_pad'\\], which the tf.data pipeline"):
        images.ImageSpec.from_processor(padded)
    hamming = ViTImageProcessor(size={"height": 32, "width": 32}, resample=5)
    with pytest.raises(ValueError, match="HAMMING filter"):
        images.ImageSpec.from_processor(hamming)
    uncropped = CLIPImageProcessor(size={"shortest_edge": 32}, do_center_crop=False)
    with pytest.raises(ValueError, match="keeps the aspect ratio without cropping"):
        images.ImageSpec.from_processor(uncropped)
    unresized = ViTImageProcessor(do_resize=False)
    with pytest.raises(ValueError, match="do_resize=False"):
        images.ImageSpec.from_processor(unresized)
