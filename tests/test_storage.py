import os

import pytest
from conftest import run_python

from tpu_helpers.core import storage
from tpu_helpers.core.storage import is_remote


def test_is_remote():
    assert is_remote("gs://bucket/x") and is_remote("ram://b/y")
    assert not is_remote("/tmp/x") and not is_remote("outputs/01")


def test_save_and_reload_through_a_bucket_like_path(fixtures_dir, tmp_path):
    result = run_python(
        f"""
        import os, tpu_helpers
        import tensorflow as tf
        from transformers import TFAutoModelForSequenceClassification
        from tpu_helpers.data import hub
        from tpu_helpers.tf_engine import tf_classes
        from tpu_helpers.core.storage import local_copy
        from tpu_helpers.tf_engine.tf_classes import save_pretrained
        tok = hub.load_tokenizer("{fixtures_dir}/tiny-distilbert")
        model = tf_classes.from_pretrained(TFAutoModelForSequenceClassification, "{fixtures_dir}/tiny-distilbert", num_labels=2)
        written = save_pretrained("ram://bucket/model", model, tok)
        print("WRITTEN", sorted(os.path.basename(w) for w in written))
        here = local_copy("ram://bucket/model")
        again = tf_classes.from_pretrained(TFAutoModelForSequenceClassification, here)
        x = dict(tok(["The dog ate."], return_tensors="tf"))
        print("SAME", bool(tf.reduce_all(model(x).logits == again(x).logits)))
        try:
            local_copy("ram://bucket/missing")
        except FileNotFoundError as err:
            print("MISSING", err)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "config.json" in out and "tf_model.h5" in out and "tokenizer.json" in out
    assert "model.safetensors" in out  # beside tf_model.h5, PyTorch-named, as on the hub
    assert "SAME True" in out
    assert "MISSING ram://bucket/missing does not exist" in out
    assert not os.path.exists("ram:")


def test_shared_paths_are_network_file_systems_and_ram_is_one_process():
    from tpu_helpers.core.storage import is_shared
    from tpu_helpers.data.records import SHARED_SCHEMES

    assert is_shared("gs://bucket/x") and not is_shared("ram://b/y")
    assert not is_shared("/tmp/x") and SHARED_SCHEMES[0] == "gs://"


@pytest.mark.parametrize(
    "path",
    [
        "outputs/run",
        "/kaggle/working/run",
        "/content/drive/MyDrive/run",
        "gs://my-bucket/a",
        "ram://x/y",
        "C:\\runs\\a",
        "run:2",
        "file:///tmp/run",
    ],
)
def test_folders_a_user_means_pass(path):
    storage.check_folder(path)


@pytest.mark.parametrize(
    "path, message",
    [
        ("gs:/bucket/run", r"nor a well-formed URL.*Fix: gs://bucket/run"),
        ("gs:bucket/run", r"Fix: gs://bucket/run"),
        ("gcs://bucket/run", r"Fix: gs://bucket/run"),
        ("GS://bucket/run", r"Fix: gs://bucket/run"),
        ("s3://bucket/run", r"cannot write s3:// paths.*gs://.*Fix"),
        ("https://example.com/run", r"cannot write https:// paths"),
        ("gs://My Bucket/run", r"'My Bucket' is not a Cloud Storage bucket name.*Fix"),
        ("gs:///run", r"'' is not a Cloud Storage bucket name"),
        (" gs://bucket/run", r"spaces at its ends. Fix: 'gs://bucket/run'"),
    ],
)
def test_a_malformed_folder_is_refused_with_the_fix(path, message):
    with pytest.raises(ValueError, match=message):
        storage.check_folder(path)
