"""The check-your-answer functions: right answers pass, the usual wrong ones fail with a
message that names the mistake."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers.data import images, text
from tpu_helpers.teaching import workshop
from tpu_helpers.teaching.workshop import ExerciseCheckError as Wrong
from tpu_helpers.tf_engine import tf_classes


def test_replica_total():
    workshop.check_replica_total(10, 4)
    workshop.check_replica_total(tf.constant(3), 2)
    with pytest.raises(Wrong, match="every replica returned 1"):
        workshop.check_replica_total(4, 4)
    with pytest.raises(Wrong, match="one replica's value"):
        workshop.check_replica_total(2, 4)
    with pytest.raises(Wrong, match="not one number"):
        workshop.check_replica_total([1, 2], 2)


@pytest.mark.parametrize("replicas", [1, 2, 8])  # Colab's one chip, the tests', Kaggle's v5e-8
def test_the_replica_checks_judge_right_and_wrong_at_every_replica_count(replicas):
    n, rows = replicas, 4
    total, global_batch = n * (n + 1) // 2, rows * n
    workshop.check_replica_total(total, n)
    workshop.check_split([list(range(i * rows, (i + 1) * rows)) for i in range(n)], n, global_batch)
    workshop.check_global_batch(global_batch, rows, n)
    workshop.check_replica_loss(
        lambda loss, gb: tf.nn.compute_average_loss(loss, global_batch_size=gb), global_batch, n
    )
    _raises(workshop.check_replica_total, total + 1, n, match=f"give {total}")
    _raises(workshop.check_split, [[i] for i in range(n)], n, global_batch, match="GLOBAL batch")
    _raises(workshop.check_split, [[0]] * (n + 1), n, global_batch, match="one value per replica")
    _raises(workshop.check_global_batch, rows + n, rows, n, match=f"= {global_batch}")
    no_division = lambda loss, gb: tf.reduce_sum(loss)  # noqa: E731
    _raises(workshop.check_replica_loss, no_division, global_batch, n, match="global_batch")
    if n > 1:  # on one replica these are the right answers too
        _raises(workshop.check_replica_total, n, n, match="every replica returned 1")
        _raises(workshop.check_replica_total, total / n, n, match="MEAN")
        _raises(workshop.check_replica_total, total - n, n, match="ids count from 0")
        _raises(workshop.check_global_batch, rows, rows, n, match="one replica's batch")
        mean = lambda loss, gb: tf.reduce_mean(loss)  # noqa: E731
        _raises(workshop.check_replica_loss, mean, global_batch, n, match="replicas")


def test_split():
    workshop.check_split([[0, 1], [2, 3]], 2, 4)
    workshop.check_split([np.array([2, 3]), np.array([0, 1])], 2, 4)
    with pytest.raises(Wrong, match="one value per replica"):
        workshop.check_split([[0, 1, 2, 3]], 2, 4)
    with pytest.raises(Wrong, match="GLOBAL batch size"):
        workshop.check_split([[0], [1]], 2, 4)  # batched per replica instead
    with pytest.raises(Wrong, match="not the first batch"):
        workshop.check_split([[0, 1], [1, 2]], 2, 4)


LENGTHS = [9] * 50 + [14] * 30 + [30] * 15 + [60] * 5


def test_widths_accepts_good_ones_and_returns_the_share():
    share = workshop.check_widths([16, 32, 64], LENGTHS, 128)
    assert share == pytest.approx(text.padding_report(LENGTHS, [16, 32, 64]).real_token_share)
    workshop.check_widths([64], LENGTHS, 128, one_width=True)  # padding="max_length" asked
    workshop.check_widths([16], [9, 14, 16] * 10, 128)  # one width is all these need


@pytest.mark.parametrize(
    "widths, message",
    [
        ([], "empty"),
        ([8, 16, 24, 32, 64], "at most 4"),
        ([32, 16, 64], "increasing"),
        ([12, 64], "multiples of 8"),
        ([16, 32], "shorter than the longest"),
        ([16, 256], "exceeds max_length"),
        ([8, 64], "no better than padding everything"),
        ([64], "one width pads every batch to 64"),  # the padding the lesson removes
        ([128], "one width pads every batch to 128"),
        (list(np.percentile(LENGTHS, [50, 90, 100])), r"np.percentile.*\[16, 32, 64\]"),
        ([16.0, 32.0, 64.0], "must be whole numbers of tokens"),
        ([16, 64, 64], "increasing"),
        ([56, 64], "little more than one width"),  # better than one width, far from the best
    ],
)
def test_widths_refuses(widths, message):
    with pytest.raises(Wrong, match=message):
        workshop.check_widths(widths, LENGTHS, 128)


def compiled(**kwargs):
    model = tf.keras.Sequential([tf.keras.layers.Dense(2)])
    settings = {
        "optimizer": tf.keras.optimizers.Adam(learning_rate=3e-5),
        "loss": tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "weighted_metrics": ["accuracy"],
        "steps_per_execution": 32,
    }
    settings.update(kwargs)
    model.compile(**{k: v for k, v in settings.items() if v is not None})
    return model


def test_compiled():
    workshop.check_compiled(compiled(), 3e-5)
    with pytest.raises(Wrong, match="not compiled"):
        workshop.check_compiled(tf.keras.Sequential([tf.keras.layers.Dense(2)]), 3e-5)
    with pytest.raises(Wrong, match="Keras' 1e-3"):
        workshop.check_compiled(compiled(optimizer="adam"), 3e-5)
    with pytest.raises(Wrong, match="from_logits=True"):
        workshop.check_compiled(compiled(loss="sparse_categorical_crossentropy"), 3e-5)
    with pytest.raises(Wrong, match="does not take logits"):
        workshop.check_compiled(
            compiled(loss=tf.keras.losses.SparseCategoricalCrossentropy()), 3e-5
        )
    with pytest.raises(Wrong, match="weighted_metrics"):
        workshop.check_compiled(compiled(weighted_metrics=None, metrics=["accuracy"]), 3e-5)
    workshop.check_compiled(compiled(), 3e-5, 32)


def test_compiled_accepts_the_transformers_models_own_loss(fixtures_dir):
    """compile(optimizer=...) without a loss: the model computes its loss from the labels,
    and the sample weights apply to it (the same weighted loss as Keras' on fillers)."""
    from transformers import TFAutoModelForSequenceClassification

    losses = []
    for loss in (None, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)):
        tf.keras.utils.set_random_seed(0)
        model = tf_classes.from_pretrained(
            TFAutoModelForSequenceClassification, fixtures_dir / "tiny-distilbert", num_labels=2
        )
        extra = {} if loss is None else {"loss": loss}
        model.compile(
            optimizer=tf.keras.optimizers.Adam(learning_rate=3e-5),
            weighted_metrics=["accuracy"],
            **extra,
        )
        workshop.check_compiled(model, 3e-5)
        features = {
            "input_ids": tf.constant([[2, 40, 50, 3]] * 4),
            "attention_mask": tf.ones((4, 4)),
        }
        batch = (features, tf.constant([0, 1, 1, 0]), tf.constant([1.0, 1.0, 1.0, 0.0]))
        losses.append(model.evaluate(tf.data.Dataset.from_tensors(batch), verbose=0)[0])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    with pytest.raises(Wrong, match="1 step\\(s\\) per call.*steps_per_execution=32"):
        workshop.check_compiled(compiled(steps_per_execution=None), 3e-5, 32)
    with pytest.raises(Wrong, match="expects one-hot label rows"):
        loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
        workshop.check_compiled(compiled(loss=loss), 3e-5)
    with pytest.raises(Wrong, match="the optimizer is SGD; the task asks for Adam"):
        workshop.check_compiled(compiled(optimizer=tf.keras.optimizers.SGD(3e-5)), 3e-5)
    with pytest.raises(Wrong, match="the optimizer is RMSprop"):
        workshop.check_compiled(compiled(optimizer=tf.keras.optimizers.RMSprop(3e-5)), 3e-5)


def test_global_batch():
    workshop.check_global_batch(128, 16, 8)
    with pytest.raises(Wrong, match="one replica's batch"):
        workshop.check_global_batch(16, 16, 8)
    with pytest.raises(Wrong, match="= 128"):
        workshop.check_global_batch(64, 16, 8)


def test_replica_loss():
    workshop.check_replica_loss(
        lambda loss, gb: tf.nn.compute_average_loss(loss, global_batch_size=gb), 32, 4
    )
    workshop.check_replica_loss(lambda loss, gb: tf.reduce_sum(loss) / gb, 16, 1)
    with pytest.raises(Wrong, match="divided by its own 8 rows"):
        workshop.check_replica_loss(lambda loss, gb: tf.reduce_mean(loss), 32, 4)
    with pytest.raises(Wrong, match="divide by global_batch"):
        workshop.check_replica_loss(lambda loss, gb: tf.reduce_sum(loss), 32, 4)
    with pytest.raises(Wrong, match="raised"):
        workshop.check_replica_loss(lambda loss: loss, 32, 4)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from datasets import Dataset

    from tpu_helpers.data import records

    rows = Dataset.from_dict(
        {"input_ids": [[101, 7, 102], [101, 5, 6, 8, 102], [101, 102]], "label": [1, 0, 1]}
    )
    folder = tmp_path_factory.mktemp("records")
    records.write_records(rows, str(folder), progress=False)
    return records.open_records(str(folder)), rows


def test_parse_spec(written):
    source, rows = written
    workshop.check_parse_spec(
        {"input_ids": tf.io.RaggedFeature(tf.int64), "label": tf.io.FixedLenFeature([], tf.int64)},
        source,
        rows,
    )
    workshop.check_parse_spec(
        {"input_ids": tf.io.VarLenFeature(tf.int64), "label": tf.io.FixedLenFeature([1], tf.int64)},
        source,
        rows,
    )
    with pytest.raises(Wrong, match=r"no entry for \['label'\]"):
        workshop.check_parse_spec({"input_ids": tf.io.VarLenFeature(tf.int64)}, source, rows)
    with pytest.raises(Wrong, match="(?i)its own length"):
        workshop.check_parse_spec(
            {
                "input_ids": tf.io.FixedLenFeature([5], tf.int64),
                "label": tf.io.FixedLenFeature([], tf.int64),
            },
            source,
            rows,
        )
    with pytest.raises(Wrong, match="parsing a record"):
        workshop.check_parse_spec(
            {
                "input_ids": tf.io.VarLenFeature(tf.float32),
                "label": tf.io.FixedLenFeature([], tf.int64),
            },
            source,
            rows,
        )
    with pytest.raises(Wrong, match="do not hold"):
        workshop.check_parse_spec(
            {
                "input_ids": tf.io.VarLenFeature(tf.int64),
                "label": tf.io.FixedLenFeature([], tf.int64),
                "attention_mask": tf.io.VarLenFeature(tf.int64),
            },
            source,
            rows,
        )


SPEC = images.ImageSpec(height=4, width=4, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))


def pipeline_output():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(2, 4, 4, 3)).astype(np.float64)
    x = (pixels * SPEC.rescale_factor - np.asarray(SPEC.mean)) / np.asarray(SPEC.std)
    return np.moveaxis(x, -1, -3)


def right_normalize(pixels):
    x = (np.asarray(pixels) / 255 - np.asarray(SPEC.mean)) / np.asarray(SPEC.std)
    return np.moveaxis(x, -1, -3)


def test_parse_spec_of_a_shard_written_by_hand(tmp_path, written):
    """Notebook 03 checks the spec on a shard it wrote itself (no metadata): the features
    are read from the first record, a gzip shard is read as gzip, and the answers the
    source-based check refuses are refused here too."""
    _, rows = written
    path = str(tmp_path / "train-00000-of-00001.tfrecord")
    with tf.io.TFRecordWriter(path, tf.io.TFRecordOptions(compression_type="GZIP")) as writer:
        for ids, label in zip(rows["input_ids"], rows["label"], strict=True):
            feature = {
                "input_ids": tf.train.Feature(int64_list=tf.train.Int64List(value=ids)),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
            }
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    right = {
        "input_ids": tf.io.RaggedFeature(tf.int64),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    workshop.check_parse_spec(right, path, rows, compression="GZIP")
    with pytest.raises(Wrong, match=r"no entry for \['label'\]"):
        workshop.check_parse_spec({"input_ids": right["input_ids"]}, path, rows, compression="GZIP")
    with pytest.raises(Wrong, match="parsing a record"):
        wrong = {**right, "input_ids": tf.io.VarLenFeature(tf.float32)}
        workshop.check_parse_spec(wrong, path, rows, compression="GZIP")


def test_normalize():
    workshop.check_normalize(right_normalize, SPEC, pipeline_output())
    with pytest.raises(Wrong, match="Channels go first"):
        workshop.check_normalize(
            lambda p: np.moveaxis(right_normalize(p), -3, -1), SPEC, pipeline_output()
        )
    with pytest.raises(Wrong, match="subtracts mean"):  # ImageNet's constants for another model
        workshop.check_normalize(
            lambda p: np.moveaxis((np.asarray(p) / 255 - 0.485) / 0.229, -1, -3),
            SPEC,
            pipeline_output(),
        )
    with pytest.raises(Wrong, match="rescales by"):
        workshop.check_normalize(lambda p: right_normalize(p) * 255, SPEC, pipeline_output())


def test_normalize_names_a_wrong_layout_of_the_right_numbers():
    output = pipeline_output()
    assert output.shape[-1] == output.shape[-2]  # square: the wrong layouts fit the shape

    def channels_last(pixels):
        return np.moveaxis(right_normalize(pixels), -3, -1)

    def reshaped(pixels):
        return channels_last(pixels).reshape(output.shape)

    def swapped(pixels):
        return np.transpose(channels_last(pixels), (0, 3, 2, 1))

    _raises(workshop.check_normalize, reshaped, SPEC, output, match="by a reshape")
    _raises(workshop.check_normalize, swapped, SPEC, output, match="swaps height and width")


def test_normalize_must_read_the_constants_of_the_checkpoint():
    """Numbers copied from one processor pass with that processor only."""
    from types import SimpleNamespace

    processor = SimpleNamespace(
        rescale_factor=1 / 255, image_mean=list(SPEC.mean), image_std=list(SPEC.std)
    )

    def reads(pixels):
        x = np.asarray(pixels) * processor.rescale_factor
        x = (x - np.asarray(processor.image_mean)) / np.asarray(processor.image_std)
        return np.moveaxis(x, -1, -3)

    before = dict(vars(processor))
    workshop.check_normalize(reads, SPEC, pipeline_output(), processor)
    assert vars(processor) == before  # put back as it was, nothing added
    with pytest.raises(Wrong, match="written into the code. Read them from processor"):
        workshop.check_normalize(right_normalize, SPEC, pipeline_output(), processor)
    assert vars(processor) == before

    def reads_the_spec(pixels):  # the pipeline's spec, printed above the exercise: right too
        x = np.asarray(pixels) * SPEC.rescale_factor
        return np.moveaxis((x - np.asarray(SPEC.mean)) / np.asarray(SPEC.std), -1, -3)

    spec_before = SPEC
    workshop.check_normalize(reads_the_spec, SPEC, pipeline_output(), processor)
    assert SPEC == spec_before and SPEC.mean == (0.5, 0.4, 0.3)  # put back


def test_normalize_read_from_the_spec_alone():
    """The main track has no processor (transformers 5 builds none without PyTorch): the
    spec is the processor, and constants written into the code fail, naming the spec."""

    def reads_the_spec(pixels):
        x = np.asarray(pixels) * SPEC.rescale_factor
        return np.moveaxis((x - np.asarray(SPEC.mean)) / np.asarray(SPEC.std), -1, -3)

    def written_in(pixels):
        x = np.asarray(pixels) / 255
        return np.moveaxis((x - np.asarray([0.5, 0.4, 0.3])) / np.asarray([0.2, 0.25, 0.3]), -1, -3)

    before = SPEC
    workshop.check_normalize(reads_the_spec, SPEC, pipeline_output(), SPEC)
    assert SPEC == before and not hasattr(SPEC, "image_mean")  # put back, nothing added
    with pytest.raises(Wrong, match="Read them from spec.rescale_factor, spec.mean"):
        workshop.check_normalize(written_in, SPEC, pipeline_output(), SPEC)
    assert SPEC == before


def test_normalize_channels_last_as_kerashubs_vit_takes_them():
    """The main track's exercise keeps the images' layout (KerasHub's ViT takes channels
    last) and runs in tf.data: a right answer in TensorFlow ops passes; one that puts the
    channels first, writes ViT's constants in, or leaves out the mean fails, saying which."""
    import tensorflow as tf

    def right(pixels):
        x = tf.cast(pixels, tf.float32) * SPEC.rescale_factor
        return (x - tf.constant(SPEC.mean)) / tf.constant(SPEC.std)

    workshop.check_normalize(right, SPEC, pipeline_output(), SPEC, channels_last=True)
    with pytest.raises(Wrong, match=r"channels last\): leave the axes"):
        workshop.check_normalize(
            lambda p: np.moveaxis(np.asarray(right(p)), -1, -3),
            SPEC,
            pipeline_output(),
            channels_last=True,
        )
    with pytest.raises(Wrong, match="Read them from spec.rescale_factor, spec.mean"):
        workshop.check_normalize(
            lambda p: (np.asarray(p) / 255 - np.asarray([0.5, 0.4, 0.3])) / np.asarray(SPEC.std),
            SPEC,
            pipeline_output(),
            SPEC,
            channels_last=True,
        )
    with pytest.raises(Wrong, match="subtracts mean"):
        workshop.check_normalize(
            lambda p: np.asarray(p) * SPEC.rescale_factor / np.asarray(SPEC.std),
            SPEC,
            pipeline_output(),
            channels_last=True,
        )


def test_head():
    from types import SimpleNamespace

    def model(num_labels, names, label2id=None):
        ids = {n: i for i, n in enumerate(names)} if label2id is None else label2id
        return SimpleNamespace(
            config=SimpleNamespace(
                num_labels=num_labels, id2label=dict(enumerate(names)), label2id=ids
            )
        )

    classes = ["a", "b", "c"]
    workshop.check_head(model(3, classes), classes)
    with pytest.raises(Wrong, match="1000 outputs"):
        workshop.check_head(model(1000, [f"LABEL_{i}" for i in range(1000)]), classes)
    with pytest.raises(Wrong, match="id2label"):
        workshop.check_head(model(3, ["LABEL_0", "LABEL_1", "LABEL_2"]), classes)
    with pytest.raises(Wrong, match="label2id is .*'LABEL_0': 0.*pass label2id"):
        workshop.check_head(model(3, classes, {f"LABEL_{i}": i for i in range(3)}), classes)


def test_head_must_start_from_the_checkpoint(fixtures_dir):
    """04.2's wrong answers with a real checkpoint: a random encoder (from_config) and a
    head of the checkpoint's own size; the solution passes."""
    from transformers import AutoConfig, TFAutoModelForImageClassification

    checkpoint, classes = str(fixtures_dir / "tiny-vit"), ["angular", "bean_rust", "healthy"]
    names = {
        "id2label": dict(enumerate(classes)),
        "label2id": {c: i for i, c in enumerate(classes)},
    }
    solution = tf_classes.from_pretrained(
        TFAutoModelForImageClassification,
        checkpoint,
        num_labels=3,
        ignore_mismatched_sizes=True,
        **names,
    )
    workshop.check_head(solution, classes, checkpoint)
    config = AutoConfig.from_pretrained(checkpoint, num_labels=3, **names)
    random_start = TFAutoModelForImageClassification.from_config(config)
    random_start(tf.zeros([1, 3, config.image_size, config.image_size]))  # build the weights
    with pytest.raises(Wrong, match="differ from .*tiny-vit's: the model starts from random"):
        workshop.check_head(random_start, classes, checkpoint)
    own_head = tf_classes.from_pretrained(TFAutoModelForImageClassification, checkpoint)
    with pytest.raises(Wrong, match="outputs for 3 classes"):
        workshop.check_head(own_head, classes, checkpoint)


def test_same_values():
    def reference(x):
        return x * 2 if float(tf.reduce_sum(x)) > 3 else tf.zeros_like(x)

    inputs = [tf.constant([1.0, 1.0]), tf.constant([2.0, 3.0])]
    workshop.check_same_values(
        lambda x: tf.where(tf.reduce_sum(x) > 3, x * 2, 0.0), reference, inputs
    )
    with pytest.raises(Wrong, match="both branches"):
        workshop.check_same_values(lambda x: x * 2, reference, inputs)


def test_static_loss():
    labels = tf.constant([1, -100, 0])
    logits = tf.random.stateless_normal([3, 4], seed=[0, 1])
    keep = labels >= 0
    reference = tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(
            labels[keep], logits[keep], from_logits=True
        )
    )

    def good(labels, logits):
        keep = labels >= 0
        loss = tf.keras.losses.sparse_categorical_crossentropy(
            tf.where(keep, labels, 0), logits, from_logits=True
        )
        kept = tf.reduce_sum(tf.cast(keep, loss.dtype))
        return tf.reduce_sum(tf.where(keep, loss, 0.0)) / tf.maximum(kept, 1.0)

    def no_guard(labels, logits):
        keep = tf.cast(labels >= 0, tf.float32)
        loss = tf.keras.losses.sparse_categorical_crossentropy(
            tf.maximum(labels, 0), logits, from_logits=True
        )
        return tf.reduce_sum(loss * keep) / tf.reduce_sum(keep)

    def unmasked(labels, logits):
        return tf.reduce_mean(
            tf.keras.losses.sparse_categorical_crossentropy(
                tf.maximum(labels, 0), logits, from_logits=True
            )
        )

    workshop.check_static_loss(good, labels, logits, reference)
    with pytest.raises(Wrong, match="tf.maximum"):
        workshop.check_static_loss(no_guard, labels, logits, reference)
    with pytest.raises(Wrong, match="multiply"):
        workshop.check_static_loss(unmasked, labels, logits, reference)


def test_positions():
    workshop.check_positions(130, "roberta", 128)
    workshop.check_positions(128, "bert", 128)
    workshop.check_positions(514, "roberta", 512, pad_token_id=1)
    with pytest.raises(Wrong, match="Fix: 130"):
        workshop.check_positions(128, "roberta", 128)
    with pytest.raises(Wrong, match="never used"):
        workshop.check_positions(130, "bert", 128)
    with pytest.raises(Wrong, match="positive integer"):
        workshop.check_positions(0, "bert", 128)


def test_schedule():
    from transformers import create_optimizer

    _, schedule = create_optimizer(1e-4, 100, 10, weight_decay_rate=0.01)
    workshop.check_schedule(schedule, 1e-4, 100, 0.1)
    _, no_warmup = create_optimizer(1e-4, 100, 0)
    with pytest.raises(Wrong, match="warmup from"):
        workshop.check_schedule(no_warmup, 1e-4, 100, 0.1)
    _, too_long = create_optimizer(1e-4, 1000, 10)
    with pytest.raises(Wrong, match="still"):
        workshop.check_schedule(too_long, 1e-4, 100, 0.1)
    with pytest.raises(Wrong, match="not 0.0001"):
        workshop.check_schedule(lambda step: 1e-3 * min(1.0, step / 10), 1e-4, 100, 0.1)


# --- more wrong answers, as learners write them ---------------------------------------
def _raises(check, *args, match):
    with pytest.raises(Wrong, match=match):
        check(*args)


def test_replica_total_more_wrong_answers():
    _raises(workshop.check_replica_total, 2.5, 4, match="the MEAN.*ReduceOp.SUM")  # MEAN
    _raises(workshop.check_replica_total, 6, 4, match="ids count from 0.*\\+ 1")  # no + 1
    _raises(workshop.check_replica_total, None, 4, match="not one number")


def test_split_more_wrong_answers():
    everything = [[0, 1, 2, 3], [0, 1, 2, 3]]  # every replica got the whole batch
    _raises(workshop.check_split, everything, 2, 4, match="GLOBAL batch size")
    _raises(workshop.check_split, [[4, 5], [6, 7]], 2, 4, match="not the first batch")
    _raises(workshop.check_split, 7, 2, 4, match="one list of rows per replica")


def test_global_batch_more_wrong_answers():
    _raises(workshop.check_global_batch, 8, 16, 8, match="= 128")  # the replica count
    _raises(workshop.check_global_batch, 24, 16, 8, match="= 128")  # added, not multiplied
    _raises(workshop.check_global_batch, 2, 16, 8, match="= 128")  # divided


def test_replica_loss_more_wrong_answers():
    def times_replicas(loss, gb):
        return tf.reduce_sum(loss) / gb * 4

    def mean_without_fillers(loss, gb):  # the mean over the rows that are not 0
        return tf.reduce_sum(loss) / tf.reduce_sum(tf.cast(loss > 0, loss.dtype))

    _raises(workshop.check_replica_loss, times_replicas, 32, 4, match="own 8 rows")
    _raises(workshop.check_replica_loss, mean_without_fillers, 32, 4, match="own 8 rows|global")
    _raises(workshop.check_replica_loss, lambda loss, gb: loss / gb, 32, 4, match="raised|global")


def test_parse_spec_more_wrong_answers(written):
    source, rows = written
    ids, label = tf.io.VarLenFeature(tf.int64), tf.io.FixedLenFeature([], tf.int64)
    _raises(
        workshop.check_parse_spec,
        {"input_ids": ids, "label": tf.io.FixedLenFeature([], tf.float32)},
        source,
        rows,
        match="parsing a record",
    )
    _raises(
        workshop.check_parse_spec,
        {"input_ids": tf.io.FixedLenFeature([], tf.int64), "label": label},
        source,
        rows,
        match="(?i)its own length|parsing a record",
    )
    _raises(
        workshop.check_parse_spec,
        {"input_ids": tf.io.VarLenFeature(tf.string), "label": label},
        source,
        rows,
        match="parsing a record",
    )
    _raises(workshop.check_parse_spec, ["input_ids", "label"], source, rows, match="must be a dict")


@tf.autograph.experimental.do_not_convert  # as notebook 05 writes it: a real Python if
def _count_if(ids):
    if tf.reduce_sum(ids) > 100:
        return tf.reduce_sum(tf.cast(ids > 0, tf.int32))
    return tf.constant(0)


# both sides of the condition, and its edge (a sum of exactly 100: > and >= differ)
COUNT_INPUTS = [
    tf.constant([[101, 7, 102, 0]]),
    tf.constant([[5, 3, 0, 0]]),
    tf.constant([[60, 40, 0, 0]]),
]


def test_same_values_more_wrong_answers():
    def counts_padding_too(ids):
        return tf.where(tf.reduce_sum(ids) > 100, tf.size(ids), 0)

    def no_condition(ids):
        return tf.reduce_sum(tf.cast(ids > 0, tf.int32))

    def count_where(ids):
        return tf.where(tf.reduce_sum(ids) > 100, tf.reduce_sum(tf.cast(ids > 0, tf.int32)), 0)

    workshop.check_same_values(count_where, _count_if, COUNT_INPUTS)

    def greater_or_equal(ids):
        return tf.where(tf.reduce_sum(ids) >= 100, tf.reduce_sum(tf.cast(ids > 0, tf.int32)), 0)

    def cond(ids):  # tf.cond is no Python if: right too
        count = tf.reduce_sum(tf.cast(ids > 0, tf.int32))
        return tf.cond(tf.reduce_sum(ids) > 100, lambda: count, lambda: tf.constant(0))

    workshop.check_same_values(cond, _count_if, COUNT_INPUTS)
    for wrong, message in [
        (_count_if, "XLA cannot compile it|Python `if`"),  # the original, still a Python if
        (counts_padding_too, "both branches"),
        (no_condition, "both branches"),
        (greater_or_equal, "both branches"),
    ]:
        _raises(workshop.check_same_values, wrong, _count_if, COUNT_INPUTS, match=message)


def test_the_original_copied_into_the_notebook_is_refused():
    """In a notebook (the ``__main__`` module) AutoGraph rewrites the original's Python
    ``if`` into tf.cond, so it compiled and passed: the check compiles the answer as
    written. A separate interpreter runs it as a notebook would."""
    from conftest import run_python

    result = run_python(
        """
        import tpu_helpers, tensorflow as tf
        from tpu_helpers.teaching import workshop

        def copied(ids):
            if tf.reduce_sum(ids) > 100:
                return tf.reduce_sum(tf.cast(ids > 0, tf.int32))
            return tf.constant(0)

        reference = tf.autograph.experimental.do_not_convert(copied)
        try:
            workshop.check_same_values(copied, reference, [tf.constant([[101, 7, 102, 0]])])
        except workshop.ExerciseCheckError as err:
            assert "Python `if`" in str(err), err
            print("OK")
        """
    )
    assert result.stdout.strip().endswith("OK"), result.stdout[-2000:] + result.stderr[-3000:]


def test_static_loss_more_wrong_answers():
    labels = tf.constant([1, -100, 0])
    logits = tf.random.stateless_normal([3, 4], seed=[0, 1])

    def boolean_mask(labels, logits):
        keep = labels >= 0
        return tf.reduce_mean(
            tf.keras.losses.sparse_categorical_crossentropy(
                labels[keep], logits[keep], from_logits=True
            )
        )

    def over_every_position(labels, logits):  # zeroes the masked, divides by all
        keep = labels >= 0
        loss = tf.keras.losses.sparse_categorical_crossentropy(
            tf.where(keep, labels, 0), logits, from_logits=True
        )
        return tf.reduce_mean(tf.where(keep, loss, 0.0))

    def labels_left_at_minus_100(labels, logits):
        keep = tf.cast(labels >= 0, tf.float32)
        loss = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return tf.reduce_sum(loss * keep) / tf.maximum(tf.reduce_sum(keep), 1.0)

    reference = boolean_mask(labels, logits)
    for wrong, message in [
        (boolean_mask, "value-dependent shapes"),
        (over_every_position, "multiply"),
        (labels_left_at_minus_100, "raised|multiply|NaN"),
    ]:
        _raises(workshop.check_static_loss, wrong, labels, logits, reference, match=message)


def test_positions_more_wrong_answers():
    _raises(workshop.check_positions, 512, "roberta", 128, match="never used")
    _raises(workshop.check_positions, 129, "roberta", 128, match="Fix: 130")
    _raises(workshop.check_positions, 130.0, "roberta", 128, match="positive integer")


def test_schedule_more_wrong_answers():
    from transformers import create_optimizer

    _, half_warmup = create_optimizer(1e-4, 100, 50)  # warmup over half the run
    _raises(workshop.check_schedule, half_warmup, 1e-4, 100, 0.1, match="after warmup")
    _, one_step_warmup = create_optimizer(1e-4, 100, 1)
    _raises(workshop.check_schedule, one_step_warmup, 1e-4, 100, 0.1, match="after warmup")
    _raises(workshop.check_schedule, lambda step: 1e-4, 1e-4, 100, 0.1, match="starts at")
    # a run of 1,000 steps with 5 % warmup: the fraction passed as the number of steps,
    # and a warmup of one step, both end near the peak at step 50
    _, fraction_as_steps = create_optimizer(1e-4, 1000, 0.05)
    _raises(
        workshop.check_schedule,
        fraction_as_steps,
        1e-4,
        1000,
        0.05,
        match="num_warmup_steps is a number of steps",
    )
    _, one_step = create_optimizer(1e-4, 1000, 1)
    _raises(workshop.check_schedule, one_step, 1e-4, 1000, 0.05, match="halfway|after warmup")

    def jump(step):  # 0, then the peak at once at the warmup's last step: no warmup at all
        return 0.0 if step < 50 else 1e-4 * (1000 - step) / 950

    _raises(workshop.check_schedule, jump, 1e-4, 1000, 0.05, match="halfway")
    optimizer, schedule = create_optimizer(1e-4, 1000, 50)  # no weight_decay_rate
    workshop.check_schedule(schedule, 1e-4, 1000, 0.05)
    _raises(
        workshop.check_schedule,
        schedule,
        1e-4,
        1000,
        0.05,
        "06.2",
        optimizer,
        0.01,
        match="weight decay is 0, not weight_decay=0.01",
    )
    decaying, schedule = create_optimizer(1e-4, 1000, 50, weight_decay_rate=0.01)
    workshop.check_schedule(schedule, 1e-4, 1000, 0.05, optimizer=decaying, weight_decay=0.01)


def test_schedule_decays_over_the_whole_run():
    """A decay that ends before the last step reaches 0 there too: the check looks inside."""
    from transformers import create_optimizer

    steps_per_epoch, epochs = 300, 2
    total = steps_per_epoch * epochs
    warmup = int(0.05 * total)
    for wrong in (
        create_optimizer(1e-4, steps_per_epoch, warmup)[1],  # one epoch, not the run
        create_optimizer(1e-4, total - warmup, warmup)[1],  # the decay's length alone
    ):
        _raises(workshop.check_schedule, wrong, 1e-4, total, 0.05, match="three quarters")
    workshop.check_schedule(create_optimizer(1e-4, total, warmup)[1], 1e-4, total, 0.05)
    # a warmup of round() or ceil() steps, one more than int() here, is right too
    workshop.check_schedule(create_optimizer(1e-4, 90, 5)[1], 1e-4, 90, 0.05)
    # a run of one or two steps has no warmup step (int(0.06 * 2) == 0): judged all the same
    for total in (1, 2, 3):
        workshop.check_schedule(create_optimizer(1e-4, total, 0)[1], 1e-4, total, 0.06)
        _raises(workshop.check_schedule, lambda step: 1e-4, 1e-4, total, 0.06, match="still")


def test_attention_mask():
    def solution(segment_ids):
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        return same & (segment_ids[:, None, :] > 0)

    workshop.check_attention_mask(solution)
    workshop.check_attention_mask(lambda s: tf.constant(solution(s)))  # a tensor works too
    # the TF engine's own mask, held to the check's NumPy rule (keras3's: test_workshop_jax)
    from tpu_helpers.tf_engine.packed_classes import same_example

    workshop.check_attention_mask(lambda s: same_example(tf.constant(s)))
    wrong_answers = [
        (lambda s: s[:, :, None] == s[:, None, :], "padding key must be hidden"),
        (lambda s: np.broadcast_to(s[:, None, :] > 0, (*s.shape, s.shape[1])), "different"),
        (lambda s: s > 0, r"shape \[3, 10\]; .*\[3, 10, 10\]"),  # a padding mask
        (lambda s: np.tril(solution(s)), "same example must see each other"),  # causal
        (lambda s: solution(s).T, "shape|differ"),  # transposed batch axes
    ]
    for wrong, message in wrong_answers:
        with pytest.raises(Wrong, match=message):
            workshop.check_attention_mask(wrong)


def test_restarted_positions():
    def solution(segment_ids):
        out = np.zeros_like(segment_ids)
        for r, row in enumerate(segment_ids):
            for i in range(1, len(row)):
                same = row[i] == row[i - 1] and row[i] > 0
                out[r, i] = out[r, i - 1] + 1 if same else 0
        return out

    workshop.check_restarted_positions(solution)

    def one_based(s):
        return np.where(s > 0, solution(s) + 1, 0)

    def padding_counted(s):  # restarts at each example, but padding goes on counting
        out = solution(s)
        for r, row in enumerate(s):
            pad = np.flatnonzero(row == 0)
            if len(pad):
                out[r, pad] = np.arange(1, len(pad) + 1) + out[r, pad[0] - 1]
        return out

    wrong_answers = [
        (lambda s: np.broadcast_to(np.arange(s.shape[1]), s.shape), "count along the whole row"),
        (one_based, "first token of each example is at 0"),
        (padding_counted, "Padding \\(segment 0\\) gets position 0"),
        (lambda s: solution(s)[:, :-1], "shape"),
        (lambda s: 1 / 0, "raised ZeroDivisionError"),
    ]
    for wrong, message in wrong_answers:
        with pytest.raises(Wrong, match=message):
            workshop.check_restarted_positions(wrong)


def test_replica_loss_is_judged_inside_strategy_run_on_every_replica():
    """Given the strategy, the answer runs where the loop runs it: there
    ``tf.nn.compute_average_loss`` without ``global_batch_size`` finds the replicas itself
    (right), while a per-replica mean is still refused."""
    from conftest import run_python

    result = run_python(
        """
        import tpu_helpers
        strategy = tpu_helpers.connect(simulated_replicas=2)
        import tensorflow as tf
        from tpu_helpers.teaching import workshop
        workshop.check_replica_loss(lambda loss, gb: tf.nn.compute_average_loss(loss), 16, strategy)
        workshop.check_replica_loss(
            lambda loss, gb: tf.nn.compute_average_loss(loss, global_batch_size=gb), 16, strategy
        )
        try:
            workshop.check_replica_loss(lambda loss, gb: tf.reduce_mean(loss), 16, strategy)
        except workshop.ExerciseCheckError as err:
            assert "own 8 rows" in str(err), err
        else:
            raise AssertionError("a per-replica mean passed")
        print("OK")
        """
    )
    assert result.stdout.strip().endswith("OK"), result.stdout[-2000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def many_written(tmp_path_factory):
    """60 records of lengths 3-40, labels mixed, written grouped by length."""
    from datasets import Dataset

    from tpu_helpers.data import records

    rng = np.random.default_rng(0)
    ids = [[101, *rng.integers(5, 90, n).tolist(), 102] for n in rng.integers(1, 38, 60)]
    rows = Dataset.from_dict({"input_ids": ids, "label": [i % 2 for i in range(60)]})
    folder = tmp_path_factory.mktemp("many-records")
    records.write_records(rows, str(folder), shard_records=10, progress=False)
    return records.open_records(str(folder))


def test_record_batches_right_and_wrong(many_written):
    """03.2: the run's stream is accepted; a hand-built tf.data pipeline, one replica's
    batch, another seed, no shuffle and other widths are refused with their reason."""
    from tpu_helpers.data import records

    source, widths, batch = many_written, [16, 24, 40], 8

    def read(**options):
        options = {"global_batch": batch, "boundaries": widths, "seed": 0, **options}
        return records.read_records(source, **options)

    workshop.check_record_batches(read(), source, widths, batch, seed=0)
    by_hand = tf.data.TFRecordDataset([s.path for s in source.shards]).batch(batch)
    _raises(workshop.check_record_batches, by_hand, source, widths, batch, match="pipeline.Batches")
    _raises(
        workshop.check_record_batches,
        read(global_batch=2),
        source,
        widths,
        batch,
        match="one replica's share of 4",
    )
    _raises(
        workshop.check_record_batches, read(seed=1), source, widths, batch, match="another seed"
    )
    _raises(
        workshop.check_record_batches,
        read(shuffle=False),
        source,
        widths,
        batch,
        match="not shuffled",
    )
    _raises(
        workshop.check_record_batches,
        read(boundaries=[40]),
        source,
        widths,
        batch,
        match="not to the widths chosen",
    )


def _tokenized(n=400, width=12):
    """Distinct rows of token ids, as a tokenizer padded to one width gives them."""
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 1000, (n, width)).astype("int32")
    ids[:, 0] = np.arange(n)  # every row distinct
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}, rng.integers(0, 2, n)


def test_in_memory_right_answers():
    enc, labels = _tokenized()
    whole = tf.data.Dataset.from_tensor_slices((dict(enc), labels))
    workshop.check_in_memory(
        whole.shuffle(len(labels)).batch(32, drop_remainder=True), enc, labels, 32
    )
    seeded = whole.shuffle(len(labels), seed=3).batch(32, drop_remainder=True)
    workshop.check_in_memory(seeded.prefetch(tf.data.AUTOTUNE), enc, labels, 32)


def test_in_memory_takes_repeated_rows_with_other_labels():
    """Data sets repeat sentences, sometimes with another label, and truncation makes long
    ones equal: a row is any of its copies."""
    enc, labels = _tokenized()
    enc["input_ids"][1::2] = enc["input_ids"][0::2]  # every row twice ...
    labels[1::2] = 1 - labels[0::2]  # ... with the other label
    whole = tf.data.Dataset.from_tensor_slices((dict(enc), labels))
    workshop.check_in_memory(whole.shuffle(400).batch(32, drop_remainder=True), enc, labels, 32)


def test_in_memory_wrong_answers():
    enc, labels = _tokenized()
    whole = tf.data.Dataset.from_tensor_slices((dict(enc), labels))
    check = workshop.check_in_memory
    _raises(check, whole.shuffle(400).batch(32), enc, labels, 32, match="drop_remainder=True")
    _raises(check, whole.batch(32, drop_remainder=True), enc, labels, 32, match="not shuffled")
    batches_shuffled = whole.batch(32, drop_remainder=True).shuffle(20, seed=1)  # batch 4 first
    _raises(check, batches_shuffled, enc, labels, 32, match="whole batches are shuffled")
    window = whole.shuffle(40, seed=1).batch(32, drop_remainder=True)
    _raises(check, window, enc, labels, 32, match="shuffle buffer holds only part")
    per_replica = whole.shuffle(400).batch(4, drop_remainder=True)
    _raises(check, per_replica, enc, labels, 32, match="one replica's share of 8")
    apart = tf.data.Dataset.zip(
        (
            tf.data.Dataset.from_tensor_slices(dict(enc)).shuffle(400, seed=1),
            tf.data.Dataset.from_tensor_slices(labels).shuffle(400, seed=2),
        )
    ).batch(32, drop_remainder=True)
    _raises(check, apart, enc, labels, 32, match="labels of other rows")
    _raises(check, [enc], enc, labels, 32, match="not a tf.data.Dataset")
    _raises(check, whole.shuffle(400), enc, labels, 32, match="single rows, not batches")
    repeated = whole.shuffle(400).batch(32, drop_remainder=True).repeat()
    _raises(check, repeated, enc, labels, 32, match="repeats without end")
    once = whole.shuffle(400, reshuffle_each_iteration=False).batch(32, drop_remainder=True)
    _raises(check, once, enc, labels, 32, match="second epoch starts with the same batch")
    cached = whole.shuffle(400).cache().batch(32, drop_remainder=True)
    _raises(check, cached, enc, labels, 32, match="second epoch starts with the same batch")
    small = whole.take(20).shuffle(20).batch(32, drop_remainder=True)
    _raises(check, small, {"input_ids": enc["input_ids"][:20]}, labels[:20], 32, match="fewer than")
    features_only = tf.data.Dataset.from_tensor_slices(dict(enc)).batch(32, drop_remainder=True)
    _raises(check, features_only, enc, labels, 32, match="not \\(features, label\\) pairs")


def test_limit_right_and_wrong_answers():
    workshop.check_limit(lambda r: "input" if r.input_per_second < r.step_per_second else "step")
    wrong = {
        "together against the step": lambda r: (
            "input" if r.together_per_second < r.step_per_second else "step"
        ),
        "the comparison reversed": lambda r: (
            "input" if r.input_per_second > r.step_per_second else "step"
        ),
        "the report's three-way verdict": lambda r: r.verdict,
    }
    for answer in wrong.values():
        _raises(workshop.check_limit, answer, match="compare the input pipeline alone")
    _raises(workshop.check_limit, lambda r: r.missing, match="09.2")
