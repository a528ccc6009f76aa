"""The input contract: every builder returns a ``pipeline.Batches`` that keeps it, and every
trainer takes one (and refuses anything else with the fix)."""

import glob
import json
from collections import Counter

import numpy as np
import pytest

from tpu_helpers.core import families, pipeline

BATCH = 8


def _tokenized(fixtures_dir, rows=60):
    from tpu_helpers.data import hub, text

    data = text.load_text_dataset(str(fixtures_dir / "cola"))
    tokenizer = hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))
    return text.tokenize(data["train"].select(range(rows)), tokenizer, 64), tokenizer


def _beans(fixtures_dir, split="train", n=21):
    rows = [json.loads(line) for line in open(glob.glob(f"{fixtures_dir}/beans/data/{split}-*")[0])]
    rows = rows[:n]
    return [r["image_file_path"] for r in rows], [r["labels"] for r in rows]


@pytest.fixture(scope="module")
def builders(fixtures_dir, tmp_path_factory):
    """One ``Batches`` from every builder, small."""
    from transformers import AutoImageProcessor

    from tpu_helpers.data import images, mlm, packing, records, text

    split, tokenizer = _tokenized(fixtures_dir)
    folder = tmp_path_factory.mktemp("records")
    records.write_records(split.remove_columns(["sentence"]), str(folder), progress=False)
    spec = images.ImageSpec.from_processor(
        AutoImageProcessor.from_pretrained(str(fixtures_dir / "tiny-vit"))
    )
    paths, labels = _beans(fixtures_dir)
    image_folder = tmp_path_factory.mktemp("image-records")
    images.write_image_records(paths, labels, str(image_folder), progress=False)
    blocks = np.asarray([ids[:8] for ids in split["input_ids"] if len(ids) >= 8], np.int32)
    return {
        "text": text.text_batches(split, global_batch=BATCH, boundaries=[16, 32, 64], seed=3),
        "records": records.read_records(  # shared: host_dataset reads as 2 hosts
            str(folder), global_batch=BATCH, boundaries=[16, 32, 64], seed=3, shared_filesystem=True
        ),
        "images": images.image_batches(
            paths, labels, spec, global_batch=BATCH, training=True, seed=3
        ),
        "cached images": images.image_batches(
            paths, labels, spec, global_batch=BATCH, training=True, seed=3, cache=True
        ),
        "image records": images.image_record_batches(
            str(image_folder), spec, global_batch=BATCH, training=True, seed=3
        ),
        "packed": packing.packed_batches(
            split["input_ids"], split["label"], width=64, global_batch=4, epochs=2, seed=3
        ),
        "masked blocks": mlm.masked_batches(blocks, tokenizer, global_batch=BATCH, seed=3),
        "masked records": mlm.masked_batches(
            records.read_records(
                str(folder), global_batch=BATCH, label_column=None, seed=3, shared_filesystem=True
            ),
            tokenizer,
            seed=3,
        ),
        "arrays": pipeline.from_arrays(
            {"x": np.arange(20.0)[:, None]}, np.arange(20) % 2, global_batch=BATCH
        ),
    }


def _flat(element):
    import tensorflow as tf

    return [t.numpy() for t in tf.nest.flatten(element)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(np.array_equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


NAMES = [
    "text",
    "records",
    "images",
    "cached images",
    "image records",
    "packed",
    "masked blocks",
    "masked records",
    "arrays",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_builder_keeps_the_contract(builders, name):
    """Same type; the steps an epoch yields; three-part elements of the global batch; the
    weights count each example once; a resumed epoch is the tail of the whole one; another
    epoch is another order (for the shuffled ones)."""
    batches = builders[name]
    assert isinstance(batches, pipeline.Batches)
    epoch = [_flat(e) for e in batches.dataset(1)]
    assert len(epoch) == batches.steps_per_epoch, name
    element = next(iter(batches.dataset(1)))
    assert isinstance(element, tuple) and len(element) == 3 and isinstance(element[0], dict)
    features, labels, weights = element
    assert labels.shape[0] == weights.shape[0] == batches.global_batch
    if name not in ("packed", "masked blocks", "masked records"):  # weights per slot / token
        total = sum(float(e[2].numpy().sum()) for e in batches.dataset(1))
        assert total == batches.examples, (name, total, batches.examples)
    tail = [_flat(e) for e in batches.dataset(1, skip_steps=2)]
    assert _same(tail, epoch[2:]), name
    again = [_flat(e) for e in batches.dataset(1)]
    assert _same(again, epoch), f"{name}: the same epoch twice differs"
    if name not in ("arrays",):
        other = [_flat(e) for e in batches.dataset(0)]
        assert not _same(other, epoch), f"{name}: epochs 0 and 1 are alike"


def test_padding_and_widths_are_declared(builders):
    text, packed = builders["text"], builders["packed"]
    assert text.max_width == 64 and 0 < text.padding.real_token_share < 1
    assert (
        packed.max_width == 64 and packed.padding.real_token_share > text.padding.real_token_share
    )
    assert builders["records"].max_width == 64


def test_skip_steps_and_epochs_outside_the_plan_are_refused(builders):
    batches = builders["text"]
    steps = batches.steps_per_epoch
    with pytest.raises(ValueError, match=rf"skip 0 to {steps - 1}\. Fix: resume with the global"):
        batches.dataset(0, skip_steps=steps + 1)
    # an epoch's last step is the next epoch's start, not another global batch
    with pytest.raises(ValueError, match=r"is the end of epoch 3 .*Fix: go on at epoch 4, step 0"):
        batches.dataset(3, skip_steps=steps)
    with pytest.raises(ValueError, match="epoch=-1 must be a whole number"):
        batches.dataset(-1)
    with pytest.raises(ValueError, match="planned for 2 epochs"):
        builders["packed"].dataset(2)


def test_seed_pairs_are_one_rule_for_numpy_and_tensorflow():
    import tensorflow as tf

    pair = pipeline.seed_pair(5, 3, 7, pipeline.STREAMS["mask"])
    tensor = pipeline.seed_pair(5, tf.constant(3), 7, pipeline.STREAMS["mask"])
    assert pair == tuple(tensor.numpy().tolist()) == (5 * 1_000_003 + 2, 3 * 2**32 + 7)
    assert pipeline.seed_pair(5, 3, 7, 0) != pair  # streams do not share draws
    a, b = pipeline.rng(1, 2).permutation(50), pipeline.rng(1, 2).permutation(50)
    assert (a == b).all() and not (a == pipeline.rng(1, 3).permutation(50)).all()


def test_distribute_gives_each_replica_its_rows_of_the_global_batch(builders):
    """On two simulated replicas (a separate process), the per-replica batches of a step
    put together are the global batch of that step, for a builder that cuts global
    batches here and for one that reads per host."""
    from conftest import run_python

    result = run_python(
        """
        import tpu_helpers, numpy as np
        strategy = tpu_helpers.connect(simulated_replicas=2)
        from tpu_helpers.core import pipeline
        b = pipeline.from_arrays({"x": np.arange(12.0)[:, None]}, np.arange(12), global_batch=4)
        whole = [y.numpy().tolist() for _, y, _ in b.dataset(1, skip_steps=1)]
        parts = []
        for _, y, _ in b.distribute(strategy, 1, skip_steps=1):
            parts.append(sum((t.numpy().tolist() for t in strategy.experimental_local_results(y)), []))
        assert parts == whole, (parts, whole)
        assert b.steps_on(strategy) == 3 and pipeline.input_pipelines(strategy) == 1
        try:
            pipeline.from_arrays({"x": np.zeros((6, 1))}, np.zeros(6), global_batch=3).distribute(strategy)
        except ValueError as err:
            assert "global batch 3 does not divide across 2 replicas" in str(err), err
        else:
            raise AssertionError("3 rows on 2 replicas")
        print("OK")
        """
    )
    assert result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def _real_rows(elements) -> Counter:
    """The token rows of weight > 0 in ``elements`` (padding left out), counted."""
    return Counter(
        tuple(int(t) for t in ids if t)
        for features, _, weights in elements
        for ids, weight in zip(np.asarray(features["input_ids"]), np.asarray(weights), strict=True)
        if weight > 0
    )


@pytest.mark.parametrize("name", NAMES)
def test_each_host_feeds_its_rows_of_every_step_and_every_example_is_read_once(builders, name):
    """JAX on a pod slice (``Batches.host_dataset``): two hosts of two devices each get
    half of every global batch, the same number of steps (``steps_on_hosts``), one width
    per step on both; together every example of the epoch once. A pipeline that makes
    global batches gives each host its slice of them; one that reads per host (records)
    gives each host its own files' rows."""
    batches = builders[name]
    steps = batches.steps_on_hosts(2, 4)
    parts = [
        [tuple(e) for e in batches.host_dataset(1, hosts=2, host=h, devices=4)] for h in (0, 1)
    ]
    assert len(parts[0]) == len(parts[1]) == steps
    for first, second in zip(*parts, strict=True):
        for a, b in zip(_flat(first), _flat(second), strict=True):
            assert a.shape == b.shape and a.shape[0] == batches.global_batch // 2
    whole = [tuple(e) for e in batches.dataset(1)]
    if not batches.reads_per_host:
        joined = [
            [np.concatenate(pair) for pair in zip(_flat(a), _flat(b), strict=True)]
            for a, b in zip(*parts, strict=True)
        ]
        assert _same(joined, [_flat(e) for e in whole])
    elif not name.startswith("masked"):  # masked records: the records' rows, masked per host
        assert _real_rows(parts[0] + parts[1]) == _real_rows(whole)
    with pytest.raises(ValueError, match="skip 0 to"):
        batches.host_dataset(0, skip_steps=steps + 1, hosts=2, host=1, devices=4)


def _compiled_classifier(fixtures_dir):
    import tensorflow as tf
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.tf_engine import tf_classes

    model = tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, str(fixtures_dir / "tiny-distilbert"), num_labels=2
    )
    model.compile(
        optimizer=tf.keras.optimizers.SGD(0.01),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_trainers_refuse_what_is_not_a_plan(fixtures_dir, tmp_path, builders):
    from tpu_helpers.tf_engine import observe
    from tpu_helpers.tf_engine.trainer import fit_resumable

    model = _compiled_classifier(fixtures_dir)
    dataset = builders["text"].dataset(0)
    for call in (
        lambda: fit_resumable(model, dataset, 1, str(tmp_path)),
        lambda: fit_resumable(model, lambda epoch, skip: dataset, 1, str(tmp_path)),
        lambda: observe.input_bound_check(model, dataset),
    ):
        with pytest.raises(TypeError, match="pipeline.from_dataset_fn"):
            call()


def test_rows_wider_than_the_models_positions_are_refused_before_any_step(fixtures_dir, tmp_path):
    from tpu_helpers.data import text
    from tpu_helpers.tf_engine.trainer import fit_resumable

    model = _compiled_classifier(fixtures_dir)
    limit = families.position_limit(model.config)
    split, _ = _tokenized(fixtures_dir)
    wide = text.text_batches(split, global_batch=BATCH, boundaries=[16, limit + 8])
    with pytest.raises(ValueError, match=rf"up to {limit + 8} tokens.*embeds {limit}.*Fix"):
        fit_resumable(model, wide, 1, str(tmp_path))
    assert not list(tmp_path.iterdir()), "nothing is written before the check"


def test_a_corrupt_shard_is_named_when_training_reads_it(fixtures_dir, tmp_path):
    """A flipped byte in a shard: the error names the shard and the fix, not only
    TensorFlow's DataLossError (which names no file)."""
    import tensorflow as tf

    from tpu_helpers.data import records
    from tpu_helpers.tf_engine.trainer import fit_resumable

    split, _ = _tokenized(fixtures_dir, rows=40)
    records.write_records(
        split, str(tmp_path / "r"), columns=["input_ids", "label"], shard_records=10, progress=False
    )
    shard = sorted((tmp_path / "r").glob("train-*.tfrecord"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # opening checks the files' sizes, which a flipped byte keeps
    batches = records.read_records(str(tmp_path / "r"), global_batch=4, boundaries=[64], seed=0)
    model = _compiled_classifier(fixtures_dir)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"{shard.name}.*Fix: copy the shard"):
        fit_resumable(model, batches, 1, str(tmp_path / "ckpt"), verbose=0)


def test_from_dataset_fn_wraps_your_own_pipeline(fixtures_dir, tmp_path):
    import tensorflow as tf

    from tpu_helpers.tf_engine.trainer import fit_resumable

    def make(epoch, skip_steps):
        ids = tf.random.stateless_uniform([24, 16], [epoch, 0], 5, 300, tf.int32)
        rows = {"input_ids": ids, "attention_mask": tf.ones_like(ids)}
        ds = tf.data.Dataset.from_tensor_slices((rows, tf.zeros([24], tf.int32), tf.ones([24])))
        return ds.batch(8, drop_remainder=True).skip(skip_steps)

    mine = pipeline.from_dataset_fn(make, steps_per_epoch=3, global_batch=8)
    history = fit_resumable(
        _compiled_classifier(fixtures_dir), mine, 2, str(tmp_path), verbose=0, log=lambda m: None
    )
    assert len(history["loss"]) == 2


def test_whole_number_labels_of_arrays_are_class_ids_unless_the_head_has_one_output():
    from types import SimpleNamespace

    from tpu_helpers.core.pipeline import from_arrays

    rows = {"x": np.zeros((4, 2), np.float32)}
    ids = from_arrays(rows, [0, 3, 1, 2], global_batch=4)
    assert ids.max_label == 3
    ids.check_model(SimpleNamespace(num_labels=4))
    with pytest.raises(ValueError, match="class label 3, but the model has 2 outputs.*Fix"):
        ids.check_model(SimpleNamespace(num_labels=2))
    ids.check_model(SimpleNamespace(num_labels=1))  # one output: a regression's targets
    assert from_arrays(rows, np.eye(4, dtype=np.int64), global_batch=4).max_label is None
    with pytest.raises(ValueError, match="label -1 at row 2"):
        from_arrays(rows, [0, 1, -1, 0], global_batch=4)
