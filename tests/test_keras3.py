"""The Keras 3 engine (``tpu_helpers.keras3``) against the TF engine's own numbers.

``build/fixtures/engines/<family>`` holds a tiny classifier of each family in the hub's
layout and what the TF engine (transformers 4's TF class, on the CPU stack, when the
fixtures were built) computed with it: logits, loss, and logits after one SGD step. Here
KerasHub loads the same files on JAX, over 8 simulated devices. These tests run on the
Keras 3 stack (``STACK=keras3``) and are skipped where KerasHub is not installed.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("STACK") in ("keras3", "colab"):
    import keras_hub  # (the Keras 3 legs must not skip these)
else:
    keras_hub = pytest.importorskip("keras_hub")

from conftest import CompileLog  # noqa: E402

from tpu_helpers import keras3  # noqa: E402
from tpu_helpers.core.errors import (  # noqa: E402
    CheckpointFormatError,
    CheckpointMismatchError,
    EngineError,
    InputError,
    TpuHelpersError,
)
from tpu_helpers.core.families import FAMILIES, KERAS3, MLM  # noqa: E402
from tpu_helpers.keras3.converters import CONVERTERS  # noqa: E402
from tpu_helpers.keras3.distribution import simulation_env  # noqa: E402
from tpu_helpers.keras3.models import HEADS  # noqa: E402
from tpu_helpers.teaching.fixtures import ENGINE_LEARNING_RATE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = keras3.connect(8)
import jax  # noqa: E402
import keras  # noqa: E402

#: How close the engines' logits must be, in float32, relative to the largest logit: both
#: compute the same function in another order.
TOLERANCE = 1e-5
#: After one SGD step of 0.5 the logits have moved by several units and the rounding of
#: both engines' gradients with them: 1.8e-5 was seen for DistilBERT in one CI run.
AFTER_STEP_TOLERANCE = 1e-4
#: Families whose weights after a step differ by design: transformers trains RoBERTa's
#: token-type row and position rows as two tensors, KerasHub has no token types (their
#: row is folded into the positions), so one gradient moves them differently. Their
#: logits and the loss of the step itself are the same.
FOLDED_TOKEN_TYPES = ("roberta", "xlm-roberta")
#: The families whose step also runs through the engine's own compiled steps: that step
#: takes any model, so one of each kind of head and input (a pooler and token types, the
#: first token, images, two heads averaged); Keras' own step checks every family.
COMPILED_STEP_FAMILIES = ("bert", "distilbert", "vit", "deit")


def reference(fixtures_dir, family):
    ref = np.load(fixtures_dir / "engines" / family / "reference.npz")
    features = {k.removeprefix("feature_"): ref[k] for k in ref.files if k.startswith("feature_")}
    return features, ref


def max_logit_gap(model, features, logits) -> float:
    """The largest difference to ``logits``, relative to their largest magnitude."""
    gap = np.abs(np.asarray(model(features, training=False)) - logits).max()
    return float(gap / max(1.0, np.abs(logits).max()))


@pytest.mark.parametrize("family", KERAS3)
def test_both_engines_give_the_same_logits_loss_and_step(fixtures_dir, family, tmp_path):
    features, ref = reference(fixtures_dir, family)
    model = keras3.classifier(fixtures_dir / "engines" / family, verbose=False)
    assert keras3.replicas(DISTRIBUTION) == 8
    assert max_logit_gap(model, features, ref["logits"]) < TOLERANCE

    model.compile(
        optimizer=keras.optimizers.SGD(ENGINE_LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    loss = model.train_on_batch(features, ref["labels"], return_dict=True)["loss"]
    assert loss == pytest.approx(float(ref["loss"]), abs=1e-5)
    if family not in FOLDED_TOKEN_TYPES:
        assert max_logit_gap(model, features, ref["logits_after_step"]) < AFTER_STEP_TOLERANCE

    if family not in COMPILED_STEP_FAMILIES:
        return
    # the same step through the engine's own compiled steps (fit_resumable)
    from tpu_helpers.core.pipeline import from_arrays

    trained = keras3.classifier(fixtures_dir / "engines" / family, verbose=False)
    trained.compile(
        optimizer=keras.optimizers.SGD(ENGINE_LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    one_batch = from_arrays(features, ref["labels"], global_batch=8, shuffle=False)
    history = keras3.fit_resumable(trained, one_batch, 1, str(tmp_path), verbose=0)
    assert history["loss"] == [pytest.approx(float(ref["loss"]), abs=1e-5)]
    if family not in FOLDED_TOKEN_TYPES:
        assert max_logit_gap(trained, features, ref["logits_after_step"]) < AFTER_STEP_TOLERANCE


def compile_masked_lm(model, optimizer, steps_per_execution=1):
    """Notebook 06's compile: the cross-entropy averaged over the masked tokens only (the
    batches' weight 1), and their accuracy."""
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="mlm_accuracy")],
        steps_per_execution=steps_per_execution,
    )


@pytest.mark.parametrize("family", MLM)
def test_the_masked_lm_head_read_from_the_hubs_files_computes_transformers_logits_and_loss(
    fixtures_dir, family
):
    """``keras3.masked_lm`` on a tiny masked-LM checkpoint the TF engine wrote: the same
    logits at every position, the same loss (transformers': the mean over the masked
    tokens, as notebook 06 compiles it) and, but for the folded token types, the same step."""
    folder = fixtures_dir / "engines" / f"{family}-mlm"
    ref = np.load(folder / "reference.npz")
    features = {"input_ids": ref["input_ids"]}  # blocks: no attention_mask, all tokens
    model = keras3.masked_lm(folder, verbose=False)
    assert max_logit_gap(model, features, ref["logits"]) < TOLERANCE
    compile_masked_lm(model, keras.optimizers.SGD(ENGINE_LEARNING_RATE))
    logs = model.train_on_batch(features, ref["labels"], ref["weights"], return_dict=True)
    assert logs["loss"] == pytest.approx(float(ref["loss"]), abs=1e-5)
    if family not in FOLDED_TOKEN_TYPES:
        assert max_logit_gap(model, features, ref["logits_after_step"]) < AFTER_STEP_TOLERANCE


def test_fingerprints_see_any_change_and_not_where_the_array_lies():
    """What a save keeps of a frozen weight: a flipped sign, two elements swapped, one bit
    of a bfloat16, bool or int8 array each change it; a copy split over 8 devices along
    its second axis has the same one (computed in place, nothing gathered)."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpu_helpers.keras3.steps import fingerprints

    x = (np.arange(64 * 64, dtype=np.float32).reshape(64, 64) - 2000) / 7
    flipped, swapped = x.copy(), x.copy()
    flipped[3, 5], flipped[7, 1] = -flipped[3, 5], -flipped[7, 1]
    swapped[0, 0], swapped[63, 63] = x[63, 63], x[0, 0]
    ints = (np.arange(300) % 128).astype(np.int8)
    arrays = [x, -x, flipped, swapped, jnp.asarray(x, jnp.bfloat16), ints, ints.astype(bool)]
    changed = [
        jnp.asarray(x, jnp.bfloat16).at[9, 9].add(1),
        np.where(np.arange(300) == 5, ints + 1, ints).astype(np.int8),
        np.arange(300) % 2 == 1,
    ]
    prints = fingerprints(arrays + changed)
    assert len(set(prints)) == len(prints), prints
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    split = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "d")))
    assert fingerprints([split, x]) == [prints[0], prints[0]]


@pytest.mark.parametrize("family", ["electra", "deberta-v2"])
def test_a_family_without_a_masked_lm_head_is_refused_with_a_fix_on_this_runtime(
    fixtures_dir, family
):
    """Continued pretraining of a family whose masked-LM head the engine does not build
    (ELECTRA's and DeBERTa-v3's checkpoints are discriminators: their masked LM was a
    separate generator) is refused before any weight is read, saying why, naming the
    families it builds and where a head is added; the fix stays on the Keras 3 runtime."""
    with pytest.raises(EngineError, match=f"'{family}' checkpoint.*discriminator") as refused:
        keras3.masked_lm(fixtures_dir / "engines" / family, verbose=False)
    message = str(refused.value)
    assert family not in MLM and ", ".join(MLM) in message and "families.py" in message
    assert "tf/" not in message and "TF engine" not in message


def test_a_masked_lm_saved_in_the_hubs_layout_loads_back_with_its_logits(fixtures_dir, tmp_path):
    """Every tensor of the checkpoint is written back under its own name, the config names
    the ``*ForMaskedLM`` class, and ``masked_lm`` reads the same logits from the save; a
    checkpoint without a masked-LM head gets a new one and says so."""
    from tpu_helpers.data.hub import open_safetensors

    folder = fixtures_dir / "engines" / "bert-mlm"
    ids = np.load(folder / "reference.npz")["input_ids"]
    model = keras3.masked_lm(folder, verbose=False)
    for variable in model.trainable_variables[-5:]:  # the head, moved off the checkpoint's
        variable.assign(variable.value + 0.01)
    want = np.asarray(model({"input_ids": ids}))
    names = keras3.save_hub_layout(model, tmp_path / "saved")
    assert "config.json" in names and "tokenizer.json" in names
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and "id2label" not in config
    with open_safetensors(folder / "model.safetensors") as original:
        with open_safetensors(tmp_path / "saved" / "model.safetensors") as saved:
            assert set(saved.keys()) >= set(original.keys())
    again = keras3.masked_lm(tmp_path / "saved", verbose=False)
    np.testing.assert_allclose(np.asarray(again({"input_ids": ids})), want, atol=1e-5)


def _masked_blocks(fixtures_dir, blocks=96, block_size=32):
    from datasets import load_dataset

    from tpu_helpers.data import hub, mlm

    checkpoint = fixtures_dir / "tiny-distilbert"
    tokenizer = hub.load_tokenizer(checkpoint)
    text = mlm.clean_lines(load_dataset(str(fixtures_dir / "text-corpus"))["train"])
    packed = mlm.pack_blocks(text, tokenizer, block_size).select(range(blocks))
    ids = np.asarray(packed["input_ids"], "int32")
    return checkpoint, mlm.masked_batches(ids, tokenizer, global_batch=16, seed=3)


def test_masked_lm_pretraining_stopped_mid_epoch_resumes_to_the_uninterrupted_weights(
    fixtures_dir, tmp_path
):
    """Continued pretraining of the tiny DistilBERT (dropout on) on packed, dynamically
    masked blocks: stopped after 4 of its 6 steps of the first epoch, before the save due
    there (saves every 2), and run again with a model made again, it ends with the weights
    of a run never stopped: the blocks and masks of the steps done again are the same.
    Callbacks see each fused call begin at its first step and end at its last."""
    checkpoint, batches = _masked_blocks(fixtures_dir)
    calls = []

    def trained(folder, stop_after=None):
        model = keras3.masked_lm(checkpoint, verbose=False)
        compile_masked_lm(model, keras.optimizers.AdamW(1e-3), steps_per_execution=2)

        class Stop(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                calls.append(("begin", batch))

            def on_train_batch_end(self, batch, logs=None):
                calls.append(("end", batch))
                if stop_after and batch + 1 >= stop_after:
                    raise KeyboardInterrupt  # a lost runtime, between two saves

        history = keras3.fit_resumable(
            model, batches, 2, str(folder), every_steps=2, callbacks=[Stop()], verbose=0
        )
        return model, history

    whole, history = trained(tmp_path / "whole")
    assert len(history["loss"]) == 2 and history["loss"][1] < history["loss"][0]
    one_epoch = [
        (event, step + end) for step in (0, 2, 4) for event, end in (("begin", 0), ("end", 1))
    ]
    assert calls == one_epoch * 2, calls  # 6 steps an epoch, 2 a call
    with pytest.raises(KeyboardInterrupt):
        trained(tmp_path / "cut", stop_after=4)
    latest = json.loads((tmp_path / "cut" / "latest.json").read_text())
    assert (latest["epoch"], latest["step"]) == (0, 2), latest  # steps 3-4 lost: done again
    del calls[:]
    resumed, _ = trained(tmp_path / "cut")
    assert calls == one_epoch[2:] + one_epoch, calls  # from step 2: its calls' own numbers
    for a, b in zip(whole.weights, resumed.weights, strict=True):
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), rtol=1e-5, atol=1e-6)


def _backbone_of(model):
    return next(
        layer for layer in model.network.layers if isinstance(layer, keras_hub.models.Backbone)
    )


def _trained_and_saved(fixtures_dir, family, folder):
    """The family's classifier after one SGD step (every weight moved), saved in the hub's
    layout; and its logits on the reference features."""
    features, ref = reference(fixtures_dir, family)
    model = keras3.classifier(fixtures_dir / "engines" / family, verbose=False)
    model.compile(
        optimizer=keras.optimizers.SGD(ENGINE_LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.train_on_batch(features, ref["labels"])
    keras3.save_hub_layout(model, folder)
    return model, np.asarray(model(features, training=False))


@pytest.fixture(scope="module")
def saved(fixtures_dir, tmp_path_factory):
    """``saved(family)``: ``_trained_and_saved`` once per family for the module (the
    saves read back by this engine and by the TF engine are the same files)."""
    done, root = {}, tmp_path_factory.mktemp("saved")

    def get(family):
        if family not in done:
            done[family] = (root / family, *_trained_and_saved(fixtures_dir, family, root / family))
        return done[family]

    return get


def test_a_model_saved_on_a_bucket_loads_back_from_it(fixtures_dir):
    """``output_dir`` on ``gs://`` (here ``ram://``, another of TensorFlow's file systems
    that ``open()`` cannot read): what ``save_hub_layout`` wrote there, ``classifier``
    reads back, through a local copy."""
    tf = pytest.importorskip("tensorflow")
    features, _ = reference(fixtures_dir, "distilbert")
    model, logits = _trained_and_saved(fixtures_dir, "distilbert", "ram://bucket/saved")
    assert "model.safetensors" in tf.io.gfile.listdir("ram://bucket/saved")
    again = keras3.classifier("ram://bucket/saved", verbose=False)
    np.testing.assert_allclose(np.asarray(again(features, training=False)), logits, atol=1e-5)


@pytest.mark.parametrize("family", ["electra", "deberta-v2", "deit"])
def test_the_hubs_sharded_layout_gives_the_logits_of_one_file(fixtures_dir, family, tmp_path):
    """A large checkpoint comes as shards and their index (``model-00001-of-0000N``): the
    families KerasHub does not read from the hub (ELECTRA, DeBERTa-v3: the engine's
    converters) and one it does (DeiT; Swin's converter reads through the same reader, and
    its model is the slowest here to compile) read from shards give transformers' logits."""
    from safetensors.numpy import load_file

    from tpu_helpers.data.hub import write_hub_weights

    sharded = tmp_path / "sharded"
    shutil.copytree(fixtures_dir / "engines" / family, sharded)
    tensors = load_file(sharded / "model.safetensors")
    third = sum(v.nbytes for v in tensors.values()) // 3
    names = write_hub_weights(tensors, sharded, max_shard_bytes=third)
    assert "model.safetensors.index.json" in names and len(names) >= 4, names
    assert not (sharded / "model.safetensors").exists()
    features, ref = reference(fixtures_dir, family)
    model = keras3.classifier(sharded, verbose=False)
    assert max_logit_gap(model, features, ref["logits"]) < TOLERANCE


def test_a_save_the_hubs_layout_cannot_hold_is_refused_and_writes_nothing(fixtures_dir, tmp_path):
    """A model of unknown weight names, a save over the checkpoint the model still reads,
    and class names that are not one per class: each refused naming the fix, before any
    file is written."""
    folder = fixtures_dir / "tiny-distilbert"
    before = sorted(p.name for p in folder.iterdir())
    model = keras3.classifier(folder, num_labels=2, verbose=False)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(EngineError, match="not made by keras3.classifier.*Fix"):
        keras3.save_hub_layout(plain, tmp_path / "plain")
    with pytest.raises(InputError, match="the folder the model was read from.*Fix"):
        keras3.save_hub_layout(model, folder)
    with pytest.raises(InputError, match=r"id2label=\{0: 'neg'\} must name each of the 2.*Fix"):
        keras3.save_hub_layout(model, tmp_path / "labels", id2label={0: "neg"})
    assert sorted(p.name for p in folder.iterdir()) == before
    assert not any((tmp_path / name).exists() for name in ("plain", "labels"))


@pytest.mark.parametrize("family", KERAS3)
def test_a_trained_model_saved_in_the_hubs_layout_loads_back_with_its_logits(
    fixtures_dir, family, saved
):
    features, ref = reference(fixtures_dir, family)
    folder, model, logits = saved(family)
    assert np.abs(logits - ref["logits"]).max() > 1e-2  # the step moved the logits
    files = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" in files and "config.json" in files
    config = json.loads((folder / "config.json").read_text())
    head = FAMILIES[family].keras3
    assert config["architectures"] == [(head.alternative or head).architecture]  # DeiT's: two

    again = keras3.classifier(folder, verbose=False)
    np.testing.assert_allclose(np.asarray(again(features, training=False)), logits, atol=1e-5)
    if family in CONVERTERS:  # KerasHub does not read this family from the hub's files
        return
    # KerasHub's own loader reads the same encoder (RoBERTa's positions aside: KerasHub
    # drops its token-type row, which the engine folds into them)
    theirs = keras_hub.models.Backbone.from_preset(str(folder))
    ours = _backbone_of(model)
    assert len(theirs.weights) == len(ours.weights)
    for a, b in zip(theirs.weights, ours.weights, strict=True):
        if family == "roberta" and "position" in a.path:
            continue
        np.testing.assert_allclose(
            np.asarray(a.value), np.asarray(b.value), atol=1e-6, err_msg=a.path
        )


def test_a_distilled_deit_averages_its_two_heads_and_other_labels_get_transformers_one_head(
    fixtures_dir,
):
    """A distilled DeiT (``DeiTForImageClassificationWithTeacher``) classifies with the mean
    of a head on its class token and one on its distillation token, both read from the
    file; asked for other labels it is refused, or with ``ignore_mismatched_sizes`` gets
    ``DeiTForImageClassification``'s one new head on the class token (transformers'
    ``WithTeacher`` class has no training loss: a fine-tune trains one head)."""
    features, ref = reference(fixtures_dir, "deit")
    folder = fixtures_dir / "engines" / "deit"
    model = keras3.classifier(folder, verbose=False)
    names = [name for name, _ in model.hub_source.layers]
    assert names == ["cls_classifier", "distillation_classifier"]
    assert model.hub_source.head.architecture == "DeiTForImageClassificationWithTeacher"
    hidden = np.asarray(_backbone_of(model)(np.moveaxis(features["pixel_values"], 1, -1)))
    heads = [layer for _, layer in model.hub_source.layers]
    by_token = [np.asarray(head(hidden[:, i, :])) for i, head in enumerate(heads)]
    logits = np.asarray(model(features, training=False))
    np.testing.assert_allclose(logits, (by_token[0] + by_token[1]) / 2, rtol=1e-5, atol=1e-6)
    assert np.abs(by_token[0] - by_token[1]).max() > 1e-2  # two heads, not one read twice

    with pytest.raises(CheckpointFormatError, match="ignore_mismatched_sizes=True"):
        keras3.classifier(folder, num_labels=5, verbose=False)
    new = keras3.classifier(folder, num_labels=5, ignore_mismatched_sizes=True, verbose=False)
    assert [name for name, _ in new.hub_source.layers] == ["classifier"]
    assert new.hub_source.head.architecture == "DeiTForImageClassification"
    assert np.asarray(new(features, training=False)).shape == (len(logits), 5)


def test_a_checkpoint_kerashub_would_compute_otherwise_is_refused_naming_each_difference(
    fixtures_dir, tmp_path
):
    """KerasHub's ``DebertaV3Backbone`` computes DeBERTa-v3 only: a ``deberta-v2`` config with
    absolute positions or position embeddings without their layer norm (DeBERTa-v2's own
    checkpoints) is refused before any weight is read, naming both and the fix; so is a
    Swin with absolute position embeddings."""
    folder = tmp_path / "deberta-v2"
    shutil.copytree(fixtures_dir / "engines" / "deberta-v2", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(position_biased_input=True, norm_rel_ebd="none")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TpuHelpersError, match="absolute position embeddings") as refused:
        keras3.classifier(folder, verbose=False)
    assert "without their layer norm" in str(refused.value)
    assert "microsoft/deberta-v3-base" in str(refused.value)
    # a Swin with absolute position embeddings: KerasHub's Swin has none
    folder = tmp_path / "swin"
    shutil.copytree(fixtures_dir / "engines" / "swin", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_absolute_embeddings": True}))
    with pytest.raises(TpuHelpersError, match="swin checkpoint has absolute position embeddings"):
        keras3.classifier(folder, verbose=False)


#: microsoft/deberta-v3-base's config.json, the fields the engine reads
DEBERTA_V3_BASE = {
    "model_type": "deberta-v2",
    "hidden_size": 768,
    "max_position_embeddings": 512,
    "max_relative_positions": -1,
    "norm_rel_ebd": "layer_norm",
    "pos_att_type": "p2c|c2p",
    "position_biased_input": False,
    "position_buckets": 256,
    "relative_attention": True,
    "share_att_key": True,
    "type_vocab_size": 0,
}


def test_the_hubs_deberta_v3_configs_are_read_and_deberta_v2s_refused_naming_why():
    """The hub's DeBERTa-v3 configs pass (their attention types written "p2c|c2p", as the
    hub's are, or as a list); DeBERTa-v2 xlarge's convolution layer and DeBERTa-v1-style
    defaults (fields left out: no relative attention, absolute positions) are refused."""
    from tpu_helpers.keras3.converters import _deberta_v3_config

    _deberta_v3_config(DEBERTA_V3_BASE)
    _deberta_v3_config({**DEBERTA_V3_BASE, "pos_att_type": ["p2c", "c2p"]})
    with pytest.raises(TpuHelpersError, match="a convolution layer"):
        _deberta_v3_config({**DEBERTA_V3_BASE, "conv_kernel_size": 3, "hidden_size": 1536})
    with pytest.raises(TpuHelpersError, match="relative attention off.*absolute position"):
        _deberta_v3_config({"model_type": "deberta-v2", "hidden_size": 32})


def test_a_trained_swin_is_saved_with_its_query_key_and_value_apart_as_trained(fixtures_dir, saved):
    """KerasHub's Swin converter fuses each block's query, key and value into one dense
    layer; the save splits the trained one again (not the file's untrained three), and
    copies the relative position index transformers keeps beside them."""
    from safetensors.numpy import load_file

    folder, _, _ = saved("swin")
    before = load_file(fixtures_dir / "engines" / "swin" / "model.safetensors")
    after = load_file(folder / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name in before:
        if name.endswith("relative_position_index"):
            np.testing.assert_array_equal(after[name], before[name])
        elif ".attention.self.query." in name or ".attention.self.value." in name:
            assert np.abs(after[name] - before[name]).max() > 1e-4, name  # trained


def test_the_tf_engine_loads_what_the_keras3_engine_saved_with_the_same_logits(fixtures_dir, saved):
    python = ROOT / ".venv" / "bin" / "python"  # the CPU stack, which wrote the references
    if not python.exists():
        pytest.skip("the CPU stack (.venv) is not made here")
    want, folders = {}, {}
    for family in KERAS3:
        folders[family], _, want[family] = saved(family)
    script = (
        "import sys, json, numpy as np\n"
        "import tpu_helpers\n"
        "from tpu_helpers.tf_engine import tf_classes\n"
        "import transformers\n"
        "out = {}\n"
        "for family, folder in zip(sys.argv[2::2], sys.argv[3::2]):\n"
        "    ref = np.load(f'{sys.argv[1]}/engines/{family}/reference.npz')\n"
        "    x = {k[8:]: ref[k] for k in ref.files if k.startswith('feature_')}\n"
        "    name = json.load(open(f'{folder}/config.json'))['architectures'][0]\n"
        "    model = tf_classes.from_pretrained(getattr(transformers, 'TF' + name), folder)\n"
        "    out[family] = np.asarray(model(x, training=False).logits).tolist()\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [
            str(python),
            "-c",
            script,
            str(fixtures_dir),
            *(str(x) for f in KERAS3 for x in (f, folders[f])),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for family in KERAS3:
        np.testing.assert_allclose(np.asarray(got[family]), want[family], atol=1e-4, err_msg=family)


def test_a_keras_release_not_written_for_is_warned_of_naming_the_ones_that_are(monkeypatch):
    from tpu_helpers.core import versions

    monkeypatch.setattr(keras3, "installed", lambda: {"keras": ("3.99.0", False)})
    with pytest.warns(UserWarning, match=r"keras 3\.99\.0: .*written for keras 3\.15\. Fix:"):
        keras3._warn_of_releases_not_written_for()
    assert versions.KERAS_REQUIREMENT == "keras>=3.15,<4" and versions.WRITTEN_FOR["keras"] == (
        "3.15",
    )


def test_the_private_keras_and_kerashub_parts_the_engine_needs_are_where_they_were(
    fixtures_dir,
):
    from tpu_helpers.core import versions
    from tpu_helpers.keras3 import internals as internals

    found = versions.installed()
    assert found["keras"][1] and found["keras-hub"][1], (found, versions.WRITTEN_FOR)
    folder = fixtures_dir / "engines" / "distilbert"
    config = json.loads((folder / "config.json").read_text())
    assert callable(internals.hub_converter(config["model_type"]).convert_weights)
    encoders = internals.encoder_layer_classes()  # DeBERTa-v3's, which KerasHub does not export
    assert [c.__name__ for c in encoders] == ["TransformerEncoder", "DisentangledAttentionEncoder"]
    model = keras3.classifier(folder, verbose=False)
    norms = [
        layer
        for layer in internals.sublayers(_backbone_of(model))
        if isinstance(layer, keras.layers.LayerNormalization)
    ]
    assert len(norms) == 1 + 2 * 2  # the embeddings', and two in each of the two layers
    keras3.compile_classifier(model, 1e-3)
    before = len(model.metrics_variables)  # the loss tracker's, not the compiled metrics'
    features, ref = reference(fixtures_dir, "distilbert")
    weights = np.ones(len(ref["labels"]), "float32")
    internals.build_for_training(model, (features, ref["labels"], weights))
    assert len(model.metrics_variables) >= before + 2  # the accuracy's total and count

    # each compile call is told apart, the same optimizer object kept or not
    from tpu_helpers.keras3.steps import Steps

    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(True))
    first = Steps.of(model)
    assert Steps.of(model) is first
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(False))
    assert Steps.of(model) is not first


def test_a_weight_left_unloaded_or_a_mask_ignored_is_caught(fixtures_dir, monkeypatch):
    features, ref = reference(fixtures_dir, "bert")
    folder = fixtures_dir / "engines" / "bert"

    unmasked = dict(features, attention_mask=np.ones_like(features["attention_mask"]))
    model = keras3.classifier(folder, verbose=False)
    assert max_logit_gap(model, unmasked, ref["logits"]) > 100 * TOLERANCE

    port = keras3.models._Reader.port_weight

    def skip_one(self, keras_variable, hf_weight_key, hook_fn=None):
        if hf_weight_key.endswith("encoder.layer.1.attention.self.query.weight"):
            return None  # left as initialised
        return port(self, keras_variable, hf_weight_key, hook_fn)

    monkeypatch.setattr(keras3.models._Reader, "port_weight", skip_one)
    model = keras3.classifier(folder, verbose=False)
    assert max_logit_gap(model, features, ref["logits"]) > 100 * TOLERANCE


def test_a_single_sentence_needs_no_token_types_and_reads_them_as_zeros(fixtures_dir):
    features, _ = reference(fixtures_dir, "bert")
    model = keras3.classifier(fixtures_dir / "engines" / "bert", verbose=False)
    single = {k: v for k, v in features.items() if k != "token_type_ids"}
    zeros = dict(single, token_type_ids=np.zeros_like(single["input_ids"]))
    np.testing.assert_array_equal(np.asarray(model(single)), np.asarray(model(zeros)))
    assert np.abs(np.asarray(model(features)) - np.asarray(model(zeros))).max() > 1e-3


def test_predict_classes_scores_every_example_once_over_the_devices(fixtures_dir):
    from tpu_helpers.core.pipeline import from_arrays

    features, ref = reference(fixtures_dir, "distilbert")
    model = keras3.classifier(fixtures_dir / "engines" / "distilbert", verbose=False)
    rows = {k: v[:6] for k, v in features.items()}  # 6 examples in batches of 8: 2 fillers
    batches = from_arrays(rows, ref["labels"][:6], global_batch=8, shuffle=False)
    labels, predictions, weights = keras3.predict_classes(model, batches)
    assert weights.sum() == 6 and len(labels) == 8
    np.testing.assert_array_equal(labels[:6], ref["labels"][:6])
    np.testing.assert_array_equal(predictions[:6], ref["logits"][:6].argmax(-1))


def test_predict_classes_on_data_that_ends_before_its_steps_names_both_counts(fixtures_dir):
    """As on the TF engine (tests/test_metrics.py): no StopIteration from inside, and no
    fewer rows than the steps promise without a word."""
    import tensorflow as tf

    from tpu_helpers.core.pipeline import from_dataset_fn

    features, ref = reference(fixtures_dir, "distilbert")
    model = keras3.classifier(fixtures_dir / "engines" / "distilbert", verbose=False)
    rows = {k: v[:8] for k, v in features.items()}
    data = tf.data.Dataset.from_tensor_slices((rows, ref["labels"][:8], np.ones(8, "float32")))
    for given, dataset in [(0, data.take(0)), (1, data)]:
        batches = from_dataset_fn(
            lambda e, s, d=dataset: d.batch(8, drop_remainder=True),
            steps_per_epoch=3,
            global_batch=8,
        )
        with pytest.raises(ValueError, match=f"gave {given} batch.*3 step.*Fix:"):
            keras3.predict_classes(model, batches)


def test_a_tf_keras_model_or_a_tf_keras_option_is_refused_naming_the_tf_engine(fixtures_dir):
    from tpu_helpers.core.errors import EngineError

    tf_keras_model = type("TFDistilBertModel", (), {"__module__": "tf_keras.src.engine"})()
    for call in (
        lambda: keras3.fit_resumable(tf_keras_model, None, 1, "unused"),
        lambda: keras3.predict_classes(tf_keras_model, None),
    ):
        with pytest.raises(EngineError, match=r"not a Keras 3 model.*checkpoints\."):
            call()
    model = keras3.classifier(fixtures_dir / "tiny-distilbert", num_labels=2, verbose=False)
    with pytest.raises(TypeError, match=r"\['max_to_keep'\]: not options of .* Fix: leave"):
        keras3.fit_resumable(model, None, 1, "unused", max_to_keep=3)


def test_a_run_directory_of_another_plan_is_refused_before_any_step(fixtures_dir, tmp_path):
    from tpu_helpers.core.pipeline import from_arrays

    features, ref = reference(fixtures_dir, "distilbert")
    model = keras3.classifier(fixtures_dir / "engines" / "distilbert", verbose=False)
    with pytest.raises(keras3.EngineError, match="compile"):
        keras3.fit_resumable(model, from_arrays(features, ref["labels"], global_batch=8), 1, "x")
    keras3.compile_classifier(model, 1e-3)
    model.optimizer.build(model.trainable_variables)
    saves = keras3.RunSaves(str(tmp_path), {"steps_per_epoch": 1, "global_batch": 8})
    saves.save(model, keras3.ResumePoint(0, 1))
    other = from_arrays(features, ref["labels"], global_batch=16)  # 1 step of 16
    with pytest.raises(CheckpointMismatchError, match="global_batch was 8 there and is 16"):
        keras3.fit_resumable(model, other, 1, str(tmp_path))


@pytest.mark.parametrize("family", ["distilbert", "electra", "deberta-v2", "deit", "swin"])
def test_bfloat16_computes_close_to_float32_and_returns_float32_logits(fixtures_dir, family):
    """Mixed bfloat16 (every notebook's default on a TPU), on a family KerasHub reads and
    on those the engine converts itself (ELECTRA, DeBERTa-v3's relative attention), and
    the image families of their own heads (a distilled DeiT's two, Swin's windows)."""
    features, ref = reference(fixtures_dir, family)
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = keras3.classifier(fixtures_dir / "engines" / family, verbose=False)
        logits = model(features, training=False)
    finally:
        keras.config.set_dtype_policy("float32")
    assert str(logits.dtype) == "float32"
    assert any("bfloat16" in str(layer.compute_dtype) for layer in model.layers)
    gap = float(np.abs(np.asarray(logits) - ref["logits"]).max() / np.abs(ref["logits"]).max())
    # bfloat16 keeps 8 bits of mantissa (0.4% per rounding), through two layers: close, not
    # equal (3.2% of the largest logit in a CI run of this test)
    assert 0 < gap < 0.1


def test_a_base_checkpoint_gets_a_new_head_and_says_what_was_not_read(fixtures_dir, capsys):
    # tiny-bert: a masked-LM save (no pooler, an MLM head), sharded, written as
    # transformers 5 writes
    model = keras3.classifier(fixtures_dir / "tiny-bert", num_labels=4)
    said = capsys.readouterr().out
    assert "pooler.dense.weight" in said and "classifier" in said and "cls.predictions" in said
    ids = np.array([[2, 7, 9, 3, 0]], dtype="int32")
    out = model(
        {
            "input_ids": ids,
            "attention_mask": (ids > 0).astype("int32"),
            "token_type_ids": np.zeros_like(ids),
        }
    )
    assert tuple(out.shape) == (1, 4)


def test_a_head_of_another_size_needs_ignore_mismatched_sizes(fixtures_dir):
    folder = fixtures_dir / "engines" / "distilbert"
    with pytest.raises(CheckpointFormatError, match="ignore_mismatched_sizes=True"):
        keras3.classifier(folder, num_labels=5, verbose=False)
    model = keras3.classifier(folder, num_labels=5, ignore_mismatched_sizes=True, verbose=False)
    assert model.network.output.shape[-1] == 5


def test_a_new_head_is_saved_with_names_of_its_own_and_a_half_precision_checkpoint_in_float32(
    fixtures_dir, tmp_path
):
    from safetensors.numpy import load_file, save_file

    half = _copy(fixtures_dir / "engines" / "distilbert", tmp_path / "half")
    tensors = load_file(half / "model.safetensors")
    save_file(
        {k: v.astype(np.float16) for k, v in tensors.items()},
        half / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((half / "config.json").read_text())
    config.update(torch_dtype="float16", id2label={"0": "neg", "1": "mixed", "2": "pos"})
    (half / "config.json").write_text(json.dumps(config))
    model = keras3.classifier(half, num_labels=2, ignore_mismatched_sizes=True, verbose=False)
    for variable in model.trainable_variables:  # a fine-tuning's small moves
        variable.assign(variable.value + 1e-4)
    keras3.save_hub_layout(model, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert {str(v.dtype) for v in saved.values()} == {"float32"}
    again = keras3.classifier(tmp_path / "saved", verbose=False)
    for a, b in zip(model.trainable_variables, again.trainable_variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=a.path)
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert written["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}  # not 'neg', 'mixed'
    assert written["torch_dtype"] == "float32"


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_an_encoder_saved_without_its_model_prefix_loads_and_is_saved_with_it(
    fixtures_dir, family, tmp_path
):
    """A base model saved alone (``AutoModel``; sentence-transformers' checkpoints) names
    its tensors without ``bert.``, as transformers' classifiers load it too."""
    from safetensors.numpy import load_file, save_file

    source = fixtures_dir / "engines" / family
    prefix = HEADS[family].prefix + "."
    bare = _copy(source, tmp_path / "bare")
    tensors = {}
    for shard in sorted(bare.glob("model*.safetensors")):  # one file or shards: one file
        tensors.update(load_file(shard))
        shard.unlink()
    (bare / "model.safetensors.index.json").unlink(missing_ok=True)
    encoder = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    save_file(encoder, bare / "model.safetensors", metadata={"format": "pt"})
    features, _ = reference(fixtures_dir, family)
    ours = keras3.classifier(bare, num_labels=2, verbose=False)
    whole = keras3.classifier(source, num_labels=2, ignore_mismatched_sizes=True, verbose=False)
    expected = np.asarray(whole(features, training=False))
    np.testing.assert_array_equal(np.asarray(ours(features, training=False)), expected)
    keras3.save_hub_layout(ours, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) <= set(tensors) and any(k.startswith(prefix) for k in saved)
    assert {k for k in saved if not k.startswith(prefix)} == {  # the new head alone
        k for k in tensors if not k.startswith(prefix) and k in saved
    }
    again = keras3.classifier(tmp_path / "saved", verbose=False)
    np.testing.assert_allclose(np.asarray(again(features, training=False)), expected, atol=1e-6)


def test_a_misspelt_option_or_a_rate_that_cannot_train_is_refused_naming_it(fixtures_dir):
    with pytest.raises(TypeError, match="num_label: not an option .* Fix"):
        keras3.classifier(fixtures_dir / "tiny-distilbert", num_label=5, verbose=False)
    model = keras3.classifier(fixtures_dir / "tiny-distilbert", num_labels=2, verbose=False)
    for rate in (-1e-3, 0.0, float("nan"), "3e-5"):
        with pytest.raises(ValueError, match=f"learning_rate={rate!r} must be a number above 0"):
            keras3.compile_classifier(model, rate)
    assert keras3.compile_classifier(model, 3e-5).optimizer is not None


def test_a_run_resumed_with_another_learning_rate_is_refused_naming_both(fixtures_dir, tmp_path):
    checkpoint, train = _cola_batches(fixtures_dir, max_shapes=1)

    def compiled(rate):
        model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
        return keras3.compile_classifier(model, rate)

    keras3.fit_resumable(compiled(1e-3), train, 1, str(tmp_path), verbose=0)
    with pytest.raises(CheckpointMismatchError, match=r"learning rate \(was 0.001 there, is 5e-05"):
        keras3.fit_resumable(compiled(5e-5), train, 2, str(tmp_path), verbose=0)
    assert (
        len(keras3.fit_resumable(compiled(1e-3), train, 2, str(tmp_path), verbose=0)["loss"]) == 2
    )


def test_a_loss_that_is_no_longer_a_number_stops_the_run_before_it_saves(fixtures_dir, tmp_path):
    from tpu_helpers.core.errors import TrainingDivergedError

    checkpoint, train = _cola_batches(fixtures_dir, max_shapes=1)
    model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(model, 1e-3)
    keras3.fit_resumable(model, train, 1, str(tmp_path), verbose=0)
    saved = sorted(p.name for p in tmp_path.iterdir())
    good = [np.asarray(v.value) for v in model.trainable_variables]

    class Diverge(keras.callbacks.Callback):  # what a step that overflowed leaves
        def on_epoch_begin(self, epoch, logs=None):
            weight = self.model.trainable_variables[0]
            weight.assign(weight.value * float("nan"))

    for every_steps in (1, None):  # a save due mid-epoch, then the epoch's end
        with pytest.raises(TrainingDivergedError, match="the loss is nan in epoch 2 .* Fix:"):
            keras3.fit_resumable(
                model, train, 2, str(tmp_path), every_steps=every_steps, callbacks=[Diverge()]
            )
        assert sorted(p.name for p in tmp_path.iterdir()) == saved  # the last good save kept
    keras3.fit_resumable(model, train, 2, str(tmp_path), verbose=0)  # resumes from it
    for before, after in zip(good, model.trainable_variables, strict=True):
        assert np.isfinite(np.asarray(after.value)).all() and after.shape == before.shape


def _compiled_with_eight_rows(fixtures_dir):
    """The engines' DistilBERT (3 classes) compiled, its reference's first 8 rows, and the
    reference."""
    features, ref = reference(fixtures_dir, "distilbert")
    model = keras3.classifier(fixtures_dir / "engines" / "distilbert", verbose=False)
    keras3.compile_classifier(model, 1e-3)
    return model, {k: v[:8] for k, v in features.items()}, ref


def test_an_epoch_whose_data_ends_before_its_steps_is_refused_before_its_save(
    fixtures_dir, tmp_path
):
    import tensorflow as tf

    from tpu_helpers.core.pipeline import from_dataset_fn

    model, rows, ref = _compiled_with_eight_rows(fixtures_dir)
    data = tf.data.Dataset.from_tensor_slices((rows, ref["labels"][:8], np.ones(8, "float32")))
    three = from_dataset_fn(
        lambda e, s: data.batch(8, drop_remainder=True), steps_per_epoch=3, global_batch=8
    )
    with pytest.raises(ValueError, match="gave 1 batch.* in epoch 1 of fit_resumable.*3 step"):
        keras3.fit_resumable(model, three, 1, str(tmp_path), verbose=0)
    assert not list(tmp_path.glob("state-1-*"))  # the start's save alone


def _copy(source: Path, target: Path, drop: str | None = None) -> Path:
    """A copy of a one-file checkpoint folder, without the tensors named ``drop...``."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    if drop:
        tensors = load_file(target / "model.safetensors")
        kept = {k: v for k, v in tensors.items() if not k.startswith(drop.removesuffix("weight"))}
        assert len(kept) < len(tensors)
        save_file(kept, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_an_albert_base_without_a_pooler_gets_a_new_one_and_says_so(fixtures_dir, tmp_path, capsys):
    folder = _copy(
        fixtures_dir / "engines" / "albert", tmp_path / "albert", drop="albert.pooler.weight"
    )
    keras3.classifier(folder)
    assert "newly initialised: ['albert.pooler.weight'" in capsys.readouterr().out


def test_a_checkpoint_missing_an_encoder_weight_is_refused_naming_it(fixtures_dir, tmp_path):
    source = fixtures_dir / "engines" / "distilbert"
    name = "distilbert.transformer.layer.0.ffn.lin1.weight"
    folder = _copy(source, tmp_path / "dropped", drop=name)
    with pytest.raises(CheckpointFormatError, match="ffn.lin1.weight"):
        keras3.classifier(folder, verbose=False)


def test_other_families_and_layouts_are_refused_with_a_fix_for_this_runtime(fixtures_dir, tmp_path):
    folder = _copy(fixtures_dir / "engines" / "distilbert", tmp_path / "mpnet")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mpnet"}))
    # the fix works on the runtime at hand: the families that run here, or how to add one
    with pytest.raises(keras3.EngineError, match=r"'mpnet' checkpoint.*Fix: a checkpoint of") as e:
        keras3.classifier(folder, verbose=False)
    assert "families.py" in str(e.value) and "notebooks 0" not in str(e.value)

    h5_only = tmp_path / "h5"
    h5_only.mkdir()
    for name in ("config.json", "tf_model.h5"):
        shutil.copy(fixtures_dir / "engines" / "distilbert" / name, h5_only / name)
    with pytest.raises(CheckpointFormatError, match="save_pretrained"):
        keras3.classifier(h5_only, verbose=False)


def test_transformers_5_reads_the_tokenizer_files_it_wrote(fixtures_dir):
    from tpu_helpers.data.hub import load_tokenizer

    tokenizer = load_tokenizer(fixtures_dir / "engines" / "bert")
    ids = tokenizer("the cat sat", "a dog ran")
    assert ids["input_ids"][0] == tokenizer.cls_token_id and 1 in ids["token_type_ids"]


def _cola_batches(fixtures_dir, rows=96, global_batch=16, group_widths=1, max_shapes=3):
    """96 CoLA-like rows in batches of up to ``max_shapes`` widths (each a compilation of
    every step: tests of what a resume checks take one)."""
    from tpu_helpers.data import hub, text

    checkpoint = fixtures_dir / "tiny-distilbert"
    data = text.load_text_dataset(str(fixtures_dir / "cola"))
    tokenized = text.tokenize(data["train"].select(range(rows)), hub.load_tokenizer(checkpoint), 64)
    lengths = np.asarray(tokenized["length"])
    widths = text.choose_boundaries(lengths, max_shapes=max_shapes, max_length=64)
    plan = text.text_batches(
        tokenized, global_batch=global_batch, boundaries=widths, seed=0, group_widths=group_widths
    )
    return checkpoint, plan


def test_each_width_compiles_once_over_epochs_calls_and_a_resume(fixtures_dir, tmp_path):
    # one device, as Colab's v5e-1: Keras' own fit compiled its step again at every call
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:1]))
    try:
        checkpoint, train = _cola_batches(fixtures_dir, group_widths=2)
        model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
        keras3.compile_classifier(model, 1e-3, steps_per_execution=2)
        run = str(tmp_path / "run")
        with CompileLog() as first:
            keras3.fit_resumable(model, train, 1, run, validation=train, verbose=0)
        assert len(first.steps()) == 2 * len(train.widths), first.compiled  # train, evaluate

        class Interrupt(keras.callbacks.Callback):  # a learner stopping the cell
            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if self.epoch == 1 and batch + 1 >= 3:
                    raise KeyboardInterrupt

        with CompileLog() as later:
            with pytest.raises(KeyboardInterrupt):
                keras3.fit_resumable(
                    model, train, 3, run, validation=train, every_steps=1, callbacks=[Interrupt()]
                )
            latest = json.loads((tmp_path / "run" / "latest.json").read_text())
            assert latest["epoch"] == 1 and latest["step"] >= 2  # stopped mid-epoch
            history = keras3.fit_resumable(model, train, 3, run, validation=train)
        assert later.steps() == [], later.compiled
        assert len(history["loss"]) == len(history["val_accuracy"]) == 3
        steps = model._tpu_helpers_steps
        assert sorted(set(steps.compiles.values())) == [1]  # each kind and shape once
    finally:
        keras.distribution.set_distribution(DISTRIBUTION)


def test_fused_steps_give_the_weights_of_one_step_per_call(fixtures_dir, tmp_path):
    checkpoint, train = _cola_batches(fixtures_dir, group_widths=4, max_shapes=2)
    start = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    # some width's batches are not a multiple of 4: calls completed with idle steps
    widths = [b[0]["input_ids"].shape[1] for b in train.dataset(0).as_numpy_iterator()]
    assert any(widths.count(w) % 4 for w in set(widths)), widths
    runs = [len(list(run)) for _, run in itertools.groupby(widths)]  # of one width, in order
    trained = {}
    for per_call in (1, 4):
        model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
        keras3.compile_classifier(model, 1e-3, steps_per_execution=per_call)
        said = []
        keras3.fit_resumable(model, train, 2, str(tmp_path / str(per_call)), log=said.append)
        trained[per_call] = [np.asarray(v.value) for v in model.weights]
        # the first epoch's line: its steps in one call per run of up to per_call steps
        calls = sum(-(-run // per_call) for run in runs)
        assert f"{len(widths)} steps in {calls} calls" in said[0], said
    assert sum(-(-run // 4) for run in runs) < len(widths)  # so fusing is seen to fuse
    moved = max(np.abs(a - b).max() for a, b in zip(trained[1], start.get_weights(), strict=True))
    assert moved > 1e-3
    for fused, one in zip(trained[4], trained[1], strict=True):
        np.testing.assert_allclose(fused, one, rtol=1e-5, atol=1e-6)


def test_a_model_and_optimizer_made_again_resume_the_run_and_bad_settings_are_refused(
    fixtures_dir, tmp_path
):
    checkpoint, train = _cola_batches(fixtures_dir)

    def made_again():  # what re-running a notebook's model and compile cells makes
        model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
        return keras3.compile_classifier(model, 1e-3)

    keras3.fit_resumable(made_again(), train, 1, str(tmp_path), verbose=0)
    history = keras3.fit_resumable(made_again(), train, 2, str(tmp_path), verbose=0)
    assert len(history["loss"]) == 2
    model = made_again()
    for bad, match in (
        ({"every_minutes": "10"}, "every_minutes='10' must be a number of minutes"),
        ({"every_steps": -3}, "every_steps"),
        ({"epochs": 0}, "epochs"),
        ({"directory": "gs:/bucket/run"}, "Fix: gs://bucket/run"),  # not a local folder
    ):
        with pytest.raises(ValueError, match=match):
            keras3.fit_resumable(
                model, train, **{"epochs": 1, "directory": str(tmp_path / "x"), **bad}
            )
        assert not (tmp_path / "x").exists() and not os.path.exists("gs:")
    keras3.fit_resumable(model, train, 1, str(tmp_path / "ab"), run={"model": "a"}, verbose=0)
    with pytest.raises(CheckpointMismatchError, match="model was 'a' there and is 'b' now"):
        keras3.fit_resumable(model, train, 2, str(tmp_path / "ab"), run={"model": "b"})
    # another order of the epoch's batches: a resumed epoch would skip other batches
    _, regrouped = _cola_batches(fixtures_dir, group_widths=2)
    with pytest.raises(CheckpointMismatchError, match="order was .*'group_widths': 1"):
        keras3.fit_resumable(model, regrouped, 2, str(tmp_path / "ab"), run={"model": "a"})
    assert issubclass(CheckpointMismatchError, TpuHelpersError)


def test_a_learning_rate_a_callback_sets_is_the_one_the_steps_use(fixtures_dir, tmp_path):
    checkpoint, train = _cola_batches(fixtures_dir)
    model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(model, 1e-3)
    keras3.fit_resumable(model, train, 1, str(tmp_path), verbose=0)
    after_one = [np.asarray(v.value) for v in model.trainable_variables]
    frozen = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.0 if epoch else rate)
    keras3.fit_resumable(model, train, 2, str(tmp_path), callbacks=[frozen], verbose=0)
    for before, after in zip(after_one, model.trainable_variables, strict=True):
        np.testing.assert_array_equal(np.asarray(after.value), before)  # rate 0: no move
    assert float(model.optimizer.learning_rate) == 0.0


def test_a_global_batch_the_devices_cannot_split_is_refused_before_any_step(fixtures_dir):
    from tpu_helpers.core.pipeline import from_arrays

    features, ref = reference(fixtures_dir, "distilbert")
    model = keras3.classifier(fixtures_dir / "engines" / "distilbert", verbose=False)
    keras3.compile_classifier(model, 1e-3)
    rows = {k: np.concatenate([v, v[:4]]) for k, v in features.items()}
    twelve = from_arrays(rows, np.concatenate([ref["labels"], ref["labels"][:4]]), global_batch=12)
    with pytest.raises(ValueError, match="global batch 12 does not divide across 8 replicas"):
        keras3.fit_resumable(model, twelve, 1, "unused")
    with pytest.raises(ValueError, match="multiple of 8"):
        keras3.predict_classes(model, twelve)


def test_the_input_bound_check_tells_a_slow_pipeline_from_a_slow_step(fixtures_dir):
    """``keras3.input_bound_check``: the same batches read slowly make the run input-bound,
    read as they are it is not; the model's variables are as they were, and an uncompiled
    model is refused. The slow pipeline waits, per batch, five times the slower of the step
    and the pipeline as the check just measured them, so that reading is at most a fifth of
    either rate however loaded the machine (on CI's loaded machine a fixed 250 ms wait read
    faster than the step ran, and a wait of three steps read more than half as fast as the
    pipeline without it, itself slowed to 6.6 batches a second)."""
    import time

    import tensorflow as tf

    checkpoint, plan = _cola_batches(fixtures_dir, rows=256, global_batch=16, group_widths=4)
    model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    with pytest.raises(keras3.EngineError, match="not compiled"):
        keras3.input_bound_check(model, plan)
    keras3.compile_classifier(model, 1e-3, steps_per_execution=4)
    before = [np.asarray(v.value).copy() for v in model.variables]

    fast = keras3.input_bound_check(model, plan, steps=12, cached_batches=4)
    assert min(fast.input_per_second, fast.step_per_second, fast.together_per_second) > 0
    wait = max(0.25, 5 / min(fast.step_per_second, fast.input_per_second))

    def late(weights):
        time.sleep(wait)
        return weights

    def sleepy(ds):
        def wait(features, labels, weights):
            waited = tf.numpy_function(late, [weights], weights.dtype)
            return features, labels, tf.ensure_shape(waited, weights.shape)

        return ds.map(wait)

    slow = keras3.input_bound_check(model, plan.with_transform(sleepy), steps=12, cached_batches=4)
    assert slow.verdict == "input-bound", (fast, slow)
    assert slow.input_per_second < 1.1 / wait and slow.together_per_second < 1.1 / wait, slow
    assert fast.input_per_second > 2 * slow.input_per_second, (fast, slow)
    for was, variable in zip(before, model.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), was)


def test_a_resume_point_in_the_filler_steps_of_several_hosts_compiles_its_widths(fixtures_dir):
    """Hosts reading their own shards may run more steps an epoch than one host
    (``steps_on_hosts``): a save made in those last steps resumes; compiling the widths
    before it takes the first batch of one host's epoch no further than its last step."""
    checkpoint, plan = _cola_batches(fixtures_dir)
    model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(model, 1e-3)
    steps = keras3.trainer._steps_for(model, plan, where="test")
    past = plan.steps_per_epoch + 2  # a step only the hosts' longer epoch has
    keras3.trainer._precompile(steps, steps.state(), (plan, 0, past), (None, 0, 0))
    assert len(steps._executables) == len(plan.widths)  # each width's train step, one each


def _worker(fixtures_dir, tmp_path, name, kill_at=0):
    command = [
        sys.executable,
        str(ROOT / "tests" / "keras3_worker.py"),
        str(fixtures_dir),
        "--dir",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path / f"{name}.npz"),
    ]
    if kill_at:
        command += ["--kill-at", str(kill_at)]
    return command


def _train(fixtures_dir, tmp_path, name, kill_at=0):
    command = _worker(fixtures_dir, tmp_path, name, kill_at)
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def uninterrupted(fixtures_dir, tmp_path_factory):
    """The folder of the worker's run in one process of 8 devices, never stopped."""
    folder = tmp_path_factory.mktemp("whole")
    whole = _train(fixtures_dir, folder, "final")
    assert whole.returncode == 0, whole.stderr[-3000:]
    return folder


def test_a_killed_run_resumes_to_the_weights_of_one_that_never_stopped(
    fixtures_dir, uninterrupted, tmp_path
):
    killed = _train(fixtures_dir, tmp_path / "killed", "final", kill_at=6)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL, between two saves
    latest = json.loads((tmp_path / "killed" / "run" / "latest.json").read_text())
    assert latest["epoch"] == 0 and 3 <= latest["step"] < 6, latest  # the save of 3+ steps
    resumed = _train(fixtures_dir, tmp_path / "killed", "final")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    history = json.loads((tmp_path / "killed" / "final.json").read_text())
    assert len(history["loss"]) == 2  # both epochs, the first from the killed session
    want = np.load(uninterrupted / "final.npz")
    got = np.load(tmp_path / "killed" / "final.npz")
    assert len(want.files) == len(got.files) > 10
    for key in want.files:
        np.testing.assert_array_equal(got[key], want[key])


def _worker_host(host, port):
    """The worker's options as one of two hosts of 4 devices, the coordinator at ``port``."""
    return ["--devices", "4", "--processes", "2", "--process-id", str(host), "--port", str(port)]


def _two_hosts(command, tmp_path, host_options=_worker_host):
    """Run ``command`` as the two JAX processes of a pod slice on loopback, 4 CPU devices
    each, JAX's CPU collectives between them; fails unless both end well."""
    import socket

    with socket.socket() as probe:  # a free port on loopback for the coordinator
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logs = [tmp_path / f"host-{i}.log" for i in (0, 1)]  # files: a full pipe would stall a host
    hosts = []
    for i, log in enumerate(logs):
        with log.open("w") as out:
            hosts.append(
                subprocess.Popen(
                    [*command, *host_options(i, port)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
    try:
        for host in hosts:
            host.wait(timeout=600)
    finally:
        for host in hosts:
            host.kill()
    for host, log in zip(hosts, logs, strict=True):
        assert host.returncode == 0, log.read_text()[-3000:]


def _same_weights_and_history(want_folder, got_folder):
    """Both hosts' weights equal, and equal to those of ``want_folder``'s one process; the
    same two-epoch history; one run's saves."""
    want = np.load(want_folder / "final.npz")
    first, second = np.load(got_folder / "final.npz"), np.load(got_folder / "final-1.npz")
    assert len(want.files) == len(first.files) > 10
    for key in want.files:
        np.testing.assert_array_equal(second[key], first[key])
        np.testing.assert_allclose(first[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
    history = [json.loads((got_folder / n).read_text()) for n in ("final.json", "final-1.json")]
    assert history[0] == history[1] and len(history[0]["loss"]) == 2
    # the last epoch's line counts every host's examples (a resumed first one, fewer)
    whole = json.loads((want_folder / "final.json").read_text())["examples_per_epoch"]
    assert history[0]["examples_per_epoch"][-1] == whole[-1] > 0, (history[0], whole)
    latest = json.loads((got_folder / "run" / "latest.json").read_text())
    assert (latest["epoch"], latest["step"]) == (2, 0)


def test_two_processes_on_loopback_train_as_one_process_of_as_many_devices(
    fixtures_dir, uninterrupted, tmp_path
):
    """A pod slice's two hosts, rehearsed: two JAX processes of 4 CPU devices each train the
    worker's run (saves every 3 steps, two epochs) to the weights of one process of 8
    devices on the same global batches, each host putting its rows of each batch on its
    devices; both end with the same weights and history, and the saves are one run's."""
    _two_hosts(_worker(fixtures_dir, tmp_path, "final"), tmp_path)
    _same_weights_and_history(uninterrupted, tmp_path)


def test_two_hosts_read_their_own_shards_and_train_as_one_process(fixtures_dir, tmp_path):
    """The records on a pod slice: each of two JAX processes reads only its own TFRecord
    shards (``records.plan_reads``: disjoint, every record once) and feeds its own 4
    devices; they end with the weights of one process of 8 devices trained on the global
    batches the two hosts' reads make together (``Batches.host_dataset``). The two hosts
    run notebook 03's slice script as its last section tells a learner to, and its saved
    model holds those weights."""
    sys.path.insert(0, str(ROOT / "tests"))
    from keras3_worker import BATCH, EPOCHS, rows
    from safetensors.numpy import load_file

    from tpu_helpers.data import records

    tokenized, boundaries = rows(fixtures_dir)
    shards = tmp_path / "shards"
    columns = ["input_ids", "label"]
    records.write_records(tokenized, str(shards), split="train", columns=columns, shard_records=8)
    source = records.open_records(str(shards / "train.metadata.json"))
    plan = records.plan_reads(source, BATCH // 8, boundaries, pipelines=2, local_replicas=4)
    mine = [{p for width in host for p in width} for host in plan.files]
    assert mine[0] and mine[1] and not mine[0] & mine[1]
    assert plan.counts.sum() == len(tokenized)

    whole = _worker(fixtures_dir, tmp_path / "one", "final") + ["--records", str(shards)]
    done = subprocess.run(
        [*whole, "--as-hosts", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    script = [sys.executable, str(ROOT / "notebooks" / "scripts" / "03_train_from_records.py")]
    script += ["--records", str(shards), "--checkpoint", str(fixtures_dir / "tiny-distilbert")]
    script += ["--output", str(tmp_path / "two"), "--epochs", str(EPOCHS), "--float32"]
    script += ["--per-replica-batch", str(BATCH // 8), "--learning-rate", "1e-3"]
    script += ["--max-length", "64", "--max-widths", "3", "--steps-per-execution", "2"]
    _two_hosts(script, tmp_path, _script_host)

    # the one process's weights, saved as the script saves its model
    model = keras3.classifier(fixtures_dir / "tiny-distilbert", num_labels=2, verbose=False)
    want = np.load(tmp_path / "one" / "final.npz")
    for i, variable in enumerate(model.weights):
        variable.assign(want[f"arr_{i}"])
    keras3.save_hub_layout(model, tmp_path / "want")
    want, got = (load_file(tmp_path / f / "model.safetensors") for f in ("want", "two/model"))
    assert sorted(got) == sorted(want) and len(want) > 10
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    latest = json.loads((tmp_path / "two" / "checkpoints" / "latest.json").read_text())
    assert (latest["epoch"], latest["step"]) == (EPOCHS, 0)
    said = [(tmp_path / f"host-{i}.log").read_text() for i in (0, 1)]
    assert "saved the model" in said[0] and "saved the model" not in said[1]  # one writer
    assert "process 0 of 2" in said[0] and "process 1 of 2" in said[1]  # both ended well


def _script_host(host, port):
    """Notebook 03's slice script's options as one of two hosts of 4 simulated devices."""
    options = ["--simulated-devices", "4", "--coordinator", f"127.0.0.1:{port}"]
    return options + ["--processes", "2", "--process-id", str(host)]


def test_kerashubs_own_vit_classifier_differs_from_transformers_by_its_layer_norm(fixtures_dir):
    """Notebook 04 trains KerasHub's ``ViTImageClassifier`` first, then ``keras3.classifier``,
    and says how the two differ: KerasHub's ViT normalizes with an epsilon of 1e-6 where the
    checkpoint's config (and transformers) says 1e-12. With the same head weights the stock
    model misses transformers' logits by more than the engines' tolerance, and meets it
    once its layer norms take the checkpoint's epsilon; ``keras3.classifier`` meets it as
    loaded."""
    features, ref = reference(fixtures_dir, "vit")
    folder = fixtures_dir / "engines" / "vit"
    config = json.loads((folder / "config.json").read_text())
    ours = keras3.classifier(folder, verbose=False)
    stock = keras_hub.models.ViTImageClassifier(
        keras_hub.models.Backbone.from_preset(str(folder)), num_classes=ref["logits"].shape[-1]
    )
    stock.output_dense.set_weights(ours.hub_source.layers[-1][1].get_weights())
    pixels = np.moveaxis(features["pixel_values"], 1, -1)  # KerasHub's ViT: channels last

    def stock_gap():
        gap = np.abs(np.asarray(stock(pixels, training=False)) - ref["logits"]).max()
        return float(gap / max(1.0, np.abs(ref["logits"]).max()))

    norms = [x for x in stock._flatten_layers() if isinstance(x, keras.layers.LayerNormalization)]
    assert {n.epsilon for n in norms} == {1e-6} and config["layer_norm_eps"] == 1e-12
    assert max_logit_gap(ours, features, ref["logits"]) < TOLERANCE < stock_gap()
    for norm in norms:
        norm.epsilon = config["layer_norm_eps"]
    assert stock_gap() < TOLERANCE


def test_image_preprocessing_is_read_without_pytorch(fixtures_dir, tmp_path):
    """On the Keras 3 stacks (no PyTorch, as on a TPU VM with JAX alone; transformers 5
    builds no image processor there) the image lessons still get the checkpoint's
    preprocessing; tests/test_images.py holds it equal to transformers' own."""
    import importlib.util
    import json

    from tpu_helpers.data import images

    assert importlib.util.find_spec("torch") is None
    spec = images.ImageSpec.from_pretrained(str(fixtures_dir / "tiny-vit"))
    assert (spec.height, spec.width, spec.mean, spec.resample) == (32, 32, (0.5,) * 3, "bilinear")
    unknown = tmp_path / "a"
    unknown.mkdir()
    (unknown / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "DonutImageProcessor"})
    )
    with pytest.raises(ValueError, match="DonutImageProcessor.*not known.*Fix"):
        images.ImageSpec.from_pretrained(str(unknown))
    with pytest.raises(ValueError, match="no preprocessor_config.json.*Fix"):
        images.ImageSpec.from_pretrained(str(fixtures_dir / "tiny-distilbert"))


def test_labels_and_token_ids_the_model_has_no_row_for_are_refused_before_any_step(
    cola_with_row_5, tmp_path
):
    """On JAX both train silently (a label out of range counts nothing; an id out of range
    gathers garbage, a nan loss): the core refuses them, naming the value and the fix, and
    writes nothing. tests/test_tf_trainer.py holds the TF engine to the same messages."""
    checkpoint, batches, cases = cola_with_row_5
    model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(model, 1e-3)
    for i, (bad, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            keras3.fit_resumable(model, batches(**bad), 1, str(tmp_path / str(i)))
        assert not (tmp_path / str(i)).exists()  # refused before the first save
    assert keras3.fit_resumable(model, batches(label=1), 1, str(tmp_path / "ok"), verbose=0)


def test_class_ids_of_in_memory_arrays_are_checked_against_the_head_before_any_step(
    fixtures_dir, tmp_path
):
    from tpu_helpers.core.pipeline import from_arrays

    model, rows, _ = _compiled_with_eight_rows(fixtures_dir)
    seven = from_arrays(rows, np.full(8, 7), global_batch=8)
    with pytest.raises(ValueError, match="class label 7, but the model has 3 outputs.*Fix"):
        keras3.fit_resumable(model, seven, 1, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="label -1 at row 2"):
        from_arrays(rows, [0, 1, -1, 0, 1, 2, 0, 1], global_batch=8)


@pytest.mark.parametrize("kind", ["truncated", "missing shard"])
def test_a_broken_download_is_named_with_the_fix(broken_checkpoints, kind):
    folder = broken_checkpoints[kind]
    with pytest.raises(CheckpointFormatError, match=r"model.*safetensors.*Fix: download the"):
        keras3.classifier(str(folder), num_labels=2, verbose=False)


def test_a_folder_of_another_checkpoints_run_is_not_resumed_in_its_place(
    fixtures_dir, two_checkpoints, tmp_path
):
    """The run record holds a fingerprint of the weights the model was loaded from: the
    same checkpoint at another path resumes, another one with the same shapes is refused
    (it would be silently replaced by the earlier run's weights)."""
    _, train = _cola_batches(fixtures_dir)
    same, other = two_checkpoints

    def model_of(checkpoint):
        model = keras3.classifier(str(checkpoint), num_labels=2, verbose=False)
        return keras3.compile_classifier(model, 1e-3)

    keras3.fit_resumable(
        model_of(fixtures_dir / "tiny-distilbert"), train, 1, str(tmp_path), verbose=0
    )
    assert (
        len(keras3.fit_resumable(model_of(same), train, 2, str(tmp_path), verbose=0)["loss"]) == 2
    )
    with pytest.raises(CheckpointMismatchError, match=r"started from another checkpoint.*Fix"):
        keras3.fit_resumable(model_of(other), train, 3, str(tmp_path), verbose=0)


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_lost_or_damaged_newest_save_falls_back_to_the_one_before(fixtures_dir, tmp_path, damage):
    """A save folder copied in part, or a state file damaged: the run resumes from the
    newest whole save, says so, and ends with the weights of a run never stopped."""
    checkpoint, train = _cola_batches(fixtures_dir)

    def fresh():
        keras.utils.set_random_seed(0)
        model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
        return keras3.compile_classifier(model, 1e-3)

    whole = fresh()
    keras3.fit_resumable(whole, train, 2, str(tmp_path / "whole"), verbose=0)
    keras3.fit_resumable(fresh(), train, 2, str(tmp_path / "run"), verbose=0)
    newest = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert newest["file"] == "state-2-0.npz" and newest["previous"] == "state-1-0.npz"
    state = tmp_path / "run" / newest["file"]
    if damage == "removed":
        state.unlink()
    else:
        state.write_bytes(state.read_bytes()[:100])
    said = []
    model = fresh()
    keras3.fit_resumable(model, train, 2, str(tmp_path / "run"), log=said.append, verbose=0)
    assert any("state-2-0.npz cannot be read" in line for line in said), said
    after = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert after["previous"] == "state-1-0.npz"  # the save before is kept for the next loss
    assert (tmp_path / "run" / "state-1-0.npz").exists()
    for got, want in zip(model.trainable_variables, whole.trainable_variables, strict=True):
        np.testing.assert_allclose(
            np.asarray(got.value), np.asarray(want.value), rtol=1e-5, atol=1e-6
        )
    for name in ("state-2-0.npz", "state-1-0.npz"):  # neither whole: refused, with the fix
        (tmp_path / "run" / name).unlink(missing_ok=True)
    with pytest.raises(CheckpointMismatchError, match="no save of this run can be read.*Fix"):
        keras3.fit_resumable(fresh(), train, 3, str(tmp_path / "run"), log=said.append, verbose=0)


def test_simulated_devices_run_a_loop_of_all_reduce_steps_without_waiting_for_good():
    """2000 small steps with an all-reduce, dispatched as fast as Python can, at 8
    simulated devices in a fresh process: with ``simulation_env`` they end in a second or
    two; with XLA's default pool on a 2-core machine every such run waited for good at the
    all-reduce (jaxlib 0.7.2 and 0.10.2), which XLA ends 10 or 40 s later."""
    script = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "mesh = Mesh(np.array(jax.devices()), ('batch',))\n"
        "assert len(jax.devices()) == 8, jax.devices()\n"
        "w = jax.device_put(jnp.full((32, 32), 0.01), NamedSharding(mesh, P()))\n"
        "x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P('batch')))\n"
        "step = jax.jit(lambda w, x: w - 0.1 * jax.grad("
        "lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w))\n"
        "for _ in range(2000):\n"
        "    w = step(w, x)\n"
        "print(float(w.sum()))\n"
    )
    bare = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env = {**bare, **simulation_env(8, bare)}
    assert env["PJRT_NPROC"] == "16"
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
        )
    except subprocess.TimeoutExpired as stuck:
        pytest.fail(f"8 simulated devices waited at an all-reduce for good: {stuck.stderr!r:.2000}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert np.isfinite(float(done.stdout.split()[-1]))
    # This process's own devices were made by the leg's environment or by keras3.devices.
    assert int(os.environ.get("PJRT_NPROC", 0)) >= 2 * len(jax.devices()) or len(jax.devices()) == 1


@pytest.mark.parametrize("reader", ["keras fit", "fit_resumable"])
def test_a_corrupt_shard_met_by_keras_own_fit_or_fit_resumable_is_named_with_the_fix(
    tmp_path, reader
):
    """The records' per-shard check stops Keras' own ``fit`` too (on JAX, fed
    ``batches.dataset()``), naming the shard and the fix; ``fit_resumable`` says where in
    the run it was met. TensorFlow's own DataLossError names no file."""
    import tensorflow as tf

    from tpu_helpers.data import records

    rows = [{"x": [float(i)] * 4, "label": i % 2} for i in range(120)]
    meta = records.write_records(rows, str(tmp_path / "r"), shard_records=40, progress=False)
    shard = tmp_path / "r" / meta["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, broken CRC
    shard.write_bytes(bytes(data))
    # unshuffled: the damage is met mid-epoch, after the first batch's checks
    batches = records.read_records(str(tmp_path / "r"), global_batch=8, shuffle=False)
    inputs = keras.Input((4,), name="x")
    model = keras.Model({"x": inputs}, keras.layers.Dense(2)(inputs))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    named = rf"{shard.name} ends after \d+ of the 40 records.*Fix: copy the shard again"
    with pytest.raises(tf.errors.InvalidArgumentError, match=named) as caught:
        if reader == "keras fit":
            model.fit(batches.dataset(0), epochs=1, verbose=0)
        else:
            keras3.fit_resumable(model, batches, 1, str(tmp_path / "run"), verbose=0)
    if reader == "fit_resumable":
        assert str(caught.value).startswith("Read in epoch 1 after step 0: The record file")
