"""Checkpoints in every layout the hub serves load into the TF classes with every weight as
saved, per family; files that cannot load, or would leave the encoder at random, are refused
with the file and the fix named."""

import json
import shutil

import numpy as np
import pytest
import tensorflow as tf
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers import (
    AutoConfig,
    AutoTokenizer,
    TFAutoModelForImageClassification,
    TFAutoModelForMaskedLM,
    TFAutoModelForSequenceClassification,
)

from tpu_helpers.core import families
from tpu_helpers.data import hub
from tpu_helpers.teaching import fixtures
from tpu_helpers.tf_engine import tf_classes


def weights_by_name(model, layer=None) -> dict[str, np.ndarray]:
    """Every weight of ``model`` (or of its ``layer``) by name without the model's scope."""
    source = getattr(model, layer) if layer else model
    return {w.name.split("/", 1)[1]: w.numpy() for w in source.weights}


def assert_same_weights(saved: dict, loaded: dict) -> None:
    assert saved.keys() == loaded.keys()
    different = [n for n in saved if not np.array_equal(saved[n], loaded[n])]
    assert not different, f"{len(different)} weights differ, first {different[:3]}"


def tiny_masked_lm(family: str):
    config = fixtures.tiny_config(family, 120, 1 if family in ("roberta", "camembert") else 0)
    tf.keras.utils.set_random_seed(0)
    model = TFAutoModelForMaskedLM.from_config(config)
    model(model.dummy_inputs)
    return model


def save(folder, model, layout="pytorch"):
    """A checkpoint folder of ``model`` in ``layout`` (no tokenizer: none plays a part here;
    shards of 16 KiB, so that even ALBERT's shared layers span several)."""
    fixtures.save_checkpoint(folder, model, layout=layout, shard_bytes=16 * 1024)
    return folder


@pytest.fixture(scope="module")
def distilbert():
    return tiny_masked_lm("distilbert")


def test_a_transposed_view_is_written_as_its_values(tmp_path):
    """safetensors writes an array's buffer, strides ignored: the hub writer hands it
    C-ordered copies, so a weight transposed into PyTorch's layout is written as it reads."""
    kernel = np.arange(12, dtype=np.float32).reshape(3, 4)
    hub.write_hub_weights({"w": kernel.T, "b": kernel[:, ::2]}, tmp_path)
    back = load_file(tmp_path / "model.safetensors")
    assert np.array_equal(back["w"], kernel.T) and np.array_equal(back["b"], kernel[:, ::2])


@pytest.mark.parametrize("layout", fixtures.LAYOUTS)
def test_every_layout_loads_every_weight_as_saved(tmp_path, distilbert, layout):
    folder = save(tmp_path / layout, distilbert, layout)
    expected = {
        "pytorch": "pytorch-safetensors",
        "pytorch+h5": "pytorch-safetensors",  # safetensors first, as from_pretrained does
        "pytorch-sharded": "pytorch-safetensors",
        "tf-h5": "tf-h5",
    }[layout]
    weights = hub.find_weights(folder)
    assert weights.layout == expected and weights.sharded == (layout == "pytorch-sharded")
    if layout == "pytorch-sharded":
        assert len(weights.files) > 1
    loaded = tf_classes.from_pretrained(TFAutoModelForMaskedLM, folder)
    assert_same_weights(weights_by_name(distilbert), weights_by_name(loaded))
    # use_safetensors, as a user passes it to from_pretrained: the files found decide
    again = tf_classes.from_pretrained(TFAutoModelForMaskedLM, folder, use_safetensors=False)
    assert_same_weights(weights_by_name(distilbert), weights_by_name(again))


@pytest.mark.parametrize("layout", ["pytorch", "pytorch-sharded"])
def test_transformers_own_loader_fails_on_pytorch_names(tmp_path, distilbert, layout):
    """What tf_classes.from_pretrained is for: transformers 4.57.6's TF classes stop on the file
    nearly every hub checkpoint has (transformers issue 40028)."""
    folder = save(tmp_path / layout, distilbert, layout)
    with pytest.raises(TypeError, match="'builtins.safe_open' object is not iterable"):
        TFAutoModelForMaskedLM.from_pretrained(folder)


def test_pytorch_names_and_layouts_are_the_hubs(tmp_path, distilbert):
    """Names and shapes as in distilbert-base-cased's model.safetensors: linear weights
    (out_features, in_features), no TF scope, the tied decoder matrix left out."""
    save(tmp_path / "m", distilbert)
    with safe_open(str(tmp_path / "m" / hub.SAFETENSORS), framework="np") as archive:
        assert archive.metadata() == {"format": "pt"}
        shapes = {k: tuple(archive.get_slice(k).get_shape()) for k in archive.keys()}
    dim, hidden = distilbert.config.dim, distilbert.config.hidden_dim
    assert shapes["distilbert.embeddings.word_embeddings.weight"] == (120, dim)
    assert shapes["distilbert.transformer.layer.0.ffn.lin1.weight"] == (hidden, dim)
    assert shapes["distilbert.transformer.layer.1.ffn.lin2.weight"] == (dim, hidden)
    assert shapes["distilbert.transformer.layer.0.sa_layer_norm.weight"] == (dim,)
    assert shapes["vocab_projector.bias"] == (120,)
    assert "vocab_projector.weight" not in shapes and not any("/" in k for k in shapes)


@pytest.mark.parametrize("layout", ["pytorch", "pytorch-sharded"])
@pytest.mark.parametrize("family", families.PACKED)
def test_each_family_loads_from_pytorch_names_with_a_new_head(tmp_path, family, layout):
    model = tiny_masked_lm(family)
    folder = save(tmp_path / family, model, layout)
    assert hub.find_weights(folder).sharded == (layout == "pytorch-sharded")
    again = tf_classes.from_pretrained(TFAutoModelForMaskedLM, folder)
    assert_same_weights(weights_by_name(model), weights_by_name(again))
    classifier, info = tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, folder, num_labels=3, output_loading_info=True
    )
    main = model.base_model_prefix
    saved, loaded = (  # the pooler aside: most masked LMs have none, so it may start new
        {n: w for n, w in weights_by_name(m, main).items() if "/pooler/" not in n}
        for m in (model, classifier)
    )
    assert_same_weights(saved, loaded)
    new = info["missing_keys"]
    assert new and all(not k.startswith(main) or ".pooler." in k for k in new), info


def test_an_image_checkpoint_loads_with_a_head_of_other_size(tmp_path):
    config = AutoConfig.for_model("vit", **fixtures.TINY_VIT)
    tf.keras.utils.set_random_seed(0)
    model = TFAutoModelForImageClassification.from_config(config)
    model(model.dummy_inputs)
    folder = save(tmp_path / "vit", model)
    tensors = load_file(str(folder / hub.SAFETENSORS))
    assert tensors["vit.embeddings.patch_embeddings.projection.weight"].shape == (32, 3, 8, 8)
    assert tensors["classifier.weight"].shape == (10, 32)
    with pytest.raises(hub.CheckpointFormatError, match="Fix: pass ignore_mismatched_sizes"):
        tf_classes.from_pretrained(TFAutoModelForImageClassification, folder, num_labels=3)
    three, info = tf_classes.from_pretrained(
        TFAutoModelForImageClassification,
        folder,
        num_labels=3,
        ignore_mismatched_sizes=True,
        output_loading_info=True,
    )
    assert three.classifier.kernel.shape == (32, 3) and info["mismatched_keys"]
    assert_same_weights(weights_by_name(model, "vit"), weights_by_name(three, "vit"))


def test_an_encoder_weight_missing_from_the_file_is_refused(tmp_path, distilbert):
    folder = save(tmp_path / "m", distilbert)
    tensors = load_file(str(folder / hub.SAFETENSORS))
    del tensors["distilbert.transformer.layer.1.attention.q_lin.weight"]
    save_file(tensors, str(folder / hub.SAFETENSORS), metadata={"format": "pt"})
    with pytest.raises(hub.CheckpointFormatError, match="layer.1.attention.q_lin.weight"):
        tf_classes.from_pretrained(TFAutoModelForSequenceClassification, folder, num_labels=2)


def test_weights_of_another_family_are_refused(tmp_path):
    folder = save(tmp_path / "bert", tiny_masked_lm("bert"))
    tiny_masked_lm("distilbert").config.save_pretrained(folder)  # the config says distilbert
    with pytest.raises(hub.CheckpointFormatError, match="encoder are not in .*model_type 'distil"):
        tf_classes.from_pretrained(TFAutoModelForSequenceClassification, folder, num_labels=2)


def test_a_checkpoint_without_a_pooler_still_loads(tmp_path):
    """Masked-LM checkpoints of BERT are saved without the pooler, which a classifier
    then starts new, as transformers says (not an error: the hub is full of them)."""
    model = tiny_masked_lm("bert")
    folder = save(tmp_path / "bert", model)
    assert not any("pooler" in k for k in load_file(str(folder / hub.SAFETENSORS)))
    classifier, info = tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, folder, num_labels=2, output_loading_info=True
    )
    assert any("pooler" in k for k in info["missing_keys"])


def test_pytorch_pickles_alone_and_no_weights_are_refused_with_the_way_out(tmp_path, distilbert):
    folder = tmp_path / "pickle"
    folder.mkdir()
    distilbert.config.save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(hub.CheckpointFormatError, match="pytorch_model.bin, a PyTorch pickle"):
        tf_classes.from_pretrained(TFAutoModelForSequenceClassification, folder, num_labels=2)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(hub.CheckpointFormatError, match="has no model weights"):
        tf_classes.from_pretrained(TFAutoModelForSequenceClassification, folder, num_labels=2)


def test_tokenizer_files_of_transformers5_load_as_the_same_tokenizer(tmp_path):
    corpus = [r["sentence"] for r in fixtures.make_cola_like(2, {"train": 300})["train"]]
    four = tmp_path / "four"
    fixtures.write_tiny_checkpoint(four, "bert", corpus, layout="pytorch")
    five = tmp_path / "five"
    shutil.copytree(four, five)
    fixtures.as_saved_by_transformers5(five)
    assert json.loads((five / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "TokenizersBackend"
    )
    with pytest.raises(ValueError, match="TokenizersBackend does not exist"):
        AutoTokenizer.from_pretrained(str(five))
    old, new = hub.load_tokenizer(four), hub.load_tokenizer(five)
    assert type(new).__name__ == "BertTokenizerFast"
    texts = corpus[:20]
    assert old(texts, texts[::-1]) == new(texts, texts[::-1])
    for name in ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id", "unk_token_id"):
        assert getattr(old, name) == getattr(new, name), name
    assert AutoConfig.from_pretrained(str(five)).model_type == "bert"


def test_the_built_in_checkpoints_are_in_the_hubs_layouts(fixtures_dir):
    layouts = {
        name: hub.find_weights(fixtures_dir / name)
        for name in ("tiny-distilbert", "tiny-bert", "tiny-vit")
    }
    assert {n: (w.layout, w.sharded) for n, w in layouts.items()} == {
        "tiny-distilbert": ("pytorch-safetensors", False),
        "tiny-bert": ("pytorch-safetensors", True),
        "tiny-vit": ("pytorch-safetensors", False),
    }
    # beside tf_model.h5, as distilbert-base-cased is on the hub
    assert hub.find_weights(fixtures_dir / "engines" / "distilbert").layout == "pytorch-safetensors"
    assert (fixtures_dir / "engines" / "distilbert" / hub.TF_H5).exists()
    settings = json.loads((fixtures_dir / "tiny-bert" / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "TokenizersBackend"


@pytest.mark.parametrize("kind", ["truncated", "missing shard"])
def test_a_broken_download_is_named_with_the_fix(broken_checkpoints, kind):
    """An interrupted download: the file (or the missing shard) named, and the fix, not
    the safetensors or OS error from inside."""
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.core.errors import CheckpointFormatError

    folder = broken_checkpoints[kind]
    with pytest.raises(CheckpointFormatError, match=r"model.*safetensors.*Fix: download the"):
        tf_classes.from_pretrained(TFAutoModelForSequenceClassification, str(folder), num_labels=2)


def test_a_path_that_is_no_folder_here_is_named_with_the_working_directory(
    fixtures_dir, tmp_path, monkeypatch
):
    from tpu_helpers.core.errors import CheckpointFormatError

    monkeypatch.chdir(tmp_path)
    for given in ("outputs/01_cola/model", "./model", str(tmp_path / "nothing"), "~/nothing/x"):
        with pytest.raises(CheckpointFormatError, match=f"not a folder here .*{tmp_path}.*Fix"):
            hub.load_tokenizer(given)
        with pytest.raises(CheckpointFormatError, match="not a folder here"):
            hub.find_weights(given)
    shutil.copytree(fixtures_dir / "tiny-distilbert", tmp_path / "outputs" / "model")
    assert hub.load_tokenizer("./outputs/model")("a b").input_ids  # a relative folder there
    assert hub.find_weights("outputs/model").layout == "pytorch-safetensors"
    monkeypatch.setenv("HOME", str(tmp_path))  # a folder under ~, as a shell would expand it
    assert hub.load_tokenizer("~/outputs/model")("a b").input_ids
    assert hub.find_weights("~/outputs/model").files[0].startswith(str(tmp_path))
