import json
import random
import re
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import run_python

from tpu_helpers.teaching.fixtures import (
    BEANS_CLASSES,
    COLA_SPLITS,
    CPU_TRAIN_ROWS,
    NOTEBOOK_FIXTURES,
    build_fixtures,
    cola_like_sentence,
    leaf_image,
    make_cola_like,
)


def test_cola_like_is_deterministic_per_seed():
    sizes = {"train": 50}
    assert make_cola_like(3, sizes) == make_cola_like(3, sizes)
    assert make_cola_like(3, sizes) != make_cola_like(4, sizes)


def test_cola_like_shape_like_cola():
    rows = make_cola_like(0)
    assert {k: len(v) for k, v in rows.items()} == COLA_SPLITS
    train = rows["train"]
    assert [r["idx"] for r in train] == list(range(len(train)))
    share = sum(r["label"] for r in train) / len(train)
    assert 0.65 < share < 0.75  # CoLA is about 70 % acceptable
    words = [len(r["sentence"].split()) for r in train]
    assert 7 < statistics.mean(words) < 12  # mostly short ...
    assert max(words) > 35  # ... with a long tail
    assert statistics.median(words) < statistics.mean(words)


def test_unacceptable_sentences_carry_a_detectable_error():
    from tpu_helpers.teaching.fixtures import _DETS, _VERBS

    rng = random.Random(1)
    bad_forms = set(_VERBS.values())
    for _ in range(200):
        good = cola_like_sentence(rng, True).rstrip(".").lower().split()
        assert not bad_forms & set(good)
        assert all(not (a == b and a in _DETS) for a, b in zip(good, good[1:], strict=False))
    errors = 0
    for _ in range(200):
        bad = cola_like_sentence(rng, False).rstrip(".").lower().split()
        doubled = any(a == b and a in _DETS for a, b in zip(bad, bad[1:], strict=False))
        errors += bool(bad_forms & set(bad)) or doubled
    assert errors > 150  # the rest lost a noun after a determiner


def test_leaf_classes_differ_in_colour():
    rng = np.random.default_rng(0)
    means = [leaf_image(rng, label, size=96).reshape(-1, 3).mean(0) for label in range(3)]
    # healthy leaves are the greenest: red/green ratio lowest
    ratio = [m[0] / m[1] for m in means]
    assert ratio[2] < ratio[0] and ratio[2] < ratio[1]


def test_build_writes_loadable_artifacts_and_is_idempotent(fixtures_dir, capsys):
    stamp = fixtures_dir / "fixtures.json"
    before = stamp.stat().st_mtime_ns
    paths = build_fixtures(fixtures_dir)
    assert stamp.stat().st_mtime_ns == before
    assert "up to date" in capsys.readouterr().out
    # a stack without transformers' TF classes wants the notebooks' part: there already
    assert build_fixtures(fixtures_dir, references=False).keys() == set(NOTEBOOK_FIXTURES)
    assert stamp.stat().st_mtime_ns == before and "up to date" in capsys.readouterr().out
    assert set(paths) == {*NOTEBOOK_FIXTURES, "engines"}
    # the notebooks' part (built without TensorFlow) holds every fixture a notebook reads
    params = Path(__file__).parent / "params"
    read = {
        m
        for f in params.rglob("*.yaml")
        for m in re.findall(r"\$\{FIXTURES\}/([\w-]+)", f.read_text())
    }
    assert read and read <= set(NOTEBOOK_FIXTURES), read - set(NOTEBOOK_FIXTURES)
    from tpu_helpers.core.families import KERAS3

    for family in KERAS3:  # the Keras 3 engine's references (tests/test_keras3.py)
        folder = Path(paths["engines"]) / family
        assert (folder / "config.json").exists() and (folder / "reference.npz").exists()

    from datasets import load_dataset

    mrpc = load_dataset(paths["mrpc"])
    assert mrpc["train"].column_names == ["sentence1", "sentence2", "label", "idx"]
    assert mrpc["train"].features["label"].names == ["not_equivalent", "equivalent"]
    assert 0.6 < np.mean(mrpc["train"]["label"]) < 0.75  # MRPC is about 68 % equivalent
    cola = load_dataset(paths["cola"])
    assert cola["train"].column_names == ["sentence", "label", "idx"]
    assert cola["train"].features["label"].names == ["unacceptable", "acceptable"]
    assert cola.num_rows == {**COLA_SPLITS, "train": CPU_TRAIN_ROWS["cola"]}
    beans = load_dataset(paths["beans"])
    assert beans["train"].features["labels"].names == list(BEANS_CLASSES)
    first = beans["train"][0]["image_file_path"]
    assert first.endswith(".jpg") and f"/{BEANS_CLASSES[beans['train'][0]['labels']]}/" in first

    from PIL import Image

    with Image.open(first) as img:
        assert img.size == (500, 500) and img.format == "JPEG"
    corpus = load_dataset(paths["text-corpus"])
    lines = corpus["train"]["text"]
    assert corpus["train"].column_names == ["text"] and corpus["validation"].num_rows > 100
    assert " = assert = " in lines and "" in lines  # laid out like wikitext
    assert sum(len(t) for t in lines) > 300_000  # enough prose for a tiny model to learn from


def test_checkpoints_load_like_the_hub_ones(fixtures_dir):
    result = run_python(
        f"""
        from tpu_helpers.data import hub
        from tpu_helpers.tf_engine import tf_classes
        from transformers import (AutoImageProcessor,
            TFAutoModelForImageClassification, TFAutoModelForSequenceClassification)
        tok = hub.load_tokenizer("{fixtures_dir}/tiny-distilbert")
        ids = tok("The dog ate the cake.")["input_ids"]
        print("TOKENS", tok.convert_ids_to_tokens(ids))
        m = tf_classes.from_pretrained(TFAutoModelForSequenceClassification, "{fixtures_dir}/tiny-distilbert", num_labels=2)
        print("MODEL", type(m).__name__, m.config.max_position_embeddings)
        p = AutoImageProcessor.from_pretrained("{fixtures_dir}/tiny-vit")
        v = tf_classes.from_pretrained(
            TFAutoModelForImageClassification, "{fixtures_dir}/tiny-vit", num_labels=3, ignore_mismatched_sizes=True)
        print("VIT", type(v).__name__, v.config.num_labels, p.size, p.image_mean)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "TOKENS ['[CLS]', 'The', 'dog', 'ate', 'the', 'cake', '.', '[SEP]']" in out
    assert "MODEL TFDistilBertForSequenceClassification 512" in out
    assert "VIT TFViTForImageClassification 3 {'height': 32, 'width': 32} [0.5, 0.5, 0.5]" in out


TABLE_FAMILIES = ("distilbert", "bert", "electra", "deberta-v2", "vit", "deit", "swin")


@pytest.fixture(scope="module")
def weight_tables(tmp_path_factory) -> dict:
    """What each family's weight table does in transformers' TF class, one interpreter
    for all of them (TensorFlow and transformers load once): ``{family: its lines}``, or
    its traceback."""
    out = tmp_path_factory.mktemp("tables")
    result = run_python(
        f"""
        import traceback
        from pathlib import Path
        import numpy as np
        import transformers
        from tpu_helpers.teaching import fixtures
        from tpu_helpers.tf_engine import tf_classes

        def tensors(folder):
            from safetensors.numpy import load_file
            return {{k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}}

        def check(family, out):
            if family in ("vit", "deit", "swin"):
                config = fixtures.tiny_image_config(family)
            else:
                overrides = fixtures.ENGINE_FAMILY_OVERRIDES.get(family, {{}})
                config = fixtures.tiny_config(family, 300, 0, **overrides)
            cls = getattr(transformers, "TF" + fixtures._ARCHITECTURES[family])
            fixtures.write_untrained_checkpoint(out / "table", config, seed=3)
            written = tensors(out / "table")
            tf_classes.save_hub_layout(tf_classes.from_pretrained(cls, out / "table"), out / "again")
            again = tensors(out / "again")
            print(family, "NAMES", sorted(written) == sorted(again), len(written))
            print(family, "VALUES", all(np.array_equal(written[k], again.get(k)) for k in written))
            fresh = cls(config)
            fresh(fresh.dummy_inputs)
            tf_classes.save_hub_layout(fresh, out / "tf")
            theirs = tensors(out / "tf")
            print(family, "SHAPES", {{k: v.shape for k, v in written.items()}} == {{k: v.shape for k, v in theirs.items()}})
            name = max((k for k, v in theirs.items() if v.ndim == 2), key=lambda k: theirs[k].size)
            # TF's Swin draws its dense layers from Keras' default (Glorot), PyTorch's from a
            # normal of initializer_range, as the table does (cut at two deviations: 0.88 of it)
            spread = 0.8796 * config.initializer_range if family == "swin" else theirs[name].std()
            print(family, "SPREAD", name, abs(written[name].std() - spread) < 0.003)

        for family in {TABLE_FAMILIES!r}:
            try:
                check(family, Path({str(out)!r}) / family)
            except Exception:
                print(family, "ERROR", traceback.format_exc().replace("\\n", " | "))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split(" ", 1) for line in result.stdout.splitlines() if " " in line]
    return {f: " ".join(rest for name, rest in lines if name == f) for f in TABLE_FAMILIES}


@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_the_weight_table_is_what_transformers_saves(weight_tables, family):
    """The notebooks' checkpoints are written without a framework, from a table of names
    and shapes: transformers' TF class of the same config saves the same names and
    shapes, and reads every written weight (saved again, all come back unchanged: a name
    missing from the table would come back drawn anew, one too many would not come back)."""
    out = weight_tables[family]
    assert "NAMES True" in out and "VALUES True" in out and "SHAPES True" in out, out
    assert re.search(r"SPREAD \S+ True", out), out


def test_a_build_without_the_references_is_completed_by_one_that_wants_them(tmp_path, monkeypatch):
    """Where transformers has no TF classes the notebooks' part is built alone; a later
    build that wants the engines' references builds them; one that wants fewer builds
    nothing. (The writers are stubs here: what they write is tested above.)"""
    import tpu_helpers.teaching.fixtures as fixtures

    calls = []

    def stub(name):
        def write(out, *args, **kwargs):
            calls.append(name)
            Path(out).mkdir(parents=True, exist_ok=True)

        return write

    for name in [n for n in dir(fixtures) if n.startswith("write_")]:
        monkeypatch.setattr(fixtures, name, stub(name))
    monkeypatch.setattr(fixtures, "tf_classes_present", lambda: True)
    assert set(build_fixtures(tmp_path, references=False, verbose=False)) == set(NOTEBOOK_FIXTURES)
    assert "write_engine_references" not in calls and not (tmp_path / "engines").exists()
    calls.clear()
    assert "engines" in build_fixtures(tmp_path, verbose=False)
    assert {"write_engine_references", "write_mlm_references"} <= set(calls)
    calls.clear()
    build_fixtures(tmp_path, references=False, verbose=False)
    assert calls == [] and (tmp_path / "engines").is_dir()
    monkeypatch.setattr(fixtures, "tf_classes_present", lambda: False)
    with pytest.raises(ValueError, match="references=True.*Fix: build them in the CPU stack"):
        build_fixtures(tmp_path / "other", references=True)


def test_stamp_records_seed(fixtures_dir):
    stamp = json.loads((fixtures_dir / "fixtures.json").read_text())
    assert stamp["seed"] == 0 and stamp["version"] >= 1


@pytest.mark.parametrize("seed", [0])
def test_weights_are_deterministic(tmp_path, seed):
    # Two builds of the text checkpoint from the same seed hold the same weights.
    code = """
        import sys, tpu_helpers, hashlib
        from pathlib import Path
        from tpu_helpers.teaching.fixtures import write_tiny_distilbert
        out = Path(sys.argv[1])
        write_tiny_distilbert(out, ["the dog ate the cake ."] * 20, seed={seed})
        print("HASH", hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()[:16])
        import tensorflow as tf
        from transformers import TFAutoModel
        from tpu_helpers.data import hub
        from tpu_helpers.tf_engine import tf_classes
        w = tf_classes.from_pretrained(TFAutoModel, out).get_weights()
        print("SUM", sum(float(abs(x).sum()) for x in w))
    """.replace("{seed}", str(seed))

    def build(name):  # in a process of its own: another hash seed, fresh TensorFlow
        return run_python(code.replace("sys.argv[1]", repr(str(tmp_path / name))))

    outs = []
    with ThreadPoolExecutor(2) as pool:  # both at once: each mostly waits on imports
        for r in pool.map(build, ("a", "b")):
            assert r.returncode == 0, r.stderr[-3000:]
            outs.append(
                [line for line in r.stdout.splitlines() if line.startswith(("HASH", "SUM"))]
            )
    assert outs[0] == outs[1] and len(outs[0]) == 2


def test_the_cpu_runs_train_on_fewer_rows_and_the_benchmarks_on_the_data_sets_own(tmp_path):
    from datasets import load_dataset

    from tpu_helpers.teaching.fixtures import MRPC_SPLITS, write_cola, write_mrpc

    write_cola(tmp_path / "cpu", 0, CPU_TRAIN_ROWS["cola"])
    write_cola(tmp_path / "full", 0)  # full_splits: the data set's own sizes
    write_mrpc(tmp_path / "mrpc", 0, CPU_TRAIN_ROWS.get("mrpc"))
    for folder, rows in (("cpu", CPU_TRAIN_ROWS["cola"]), ("full", COLA_SPLITS["train"])):
        cola = load_dataset(str(tmp_path / folder))
        assert cola.num_rows == {**COLA_SPLITS, "train": rows}, folder
    mrpc = load_dataset(str(tmp_path / "mrpc"))
    assert mrpc.num_rows == {**MRPC_SPLITS, "train": CPU_TRAIN_ROWS.get("mrpc", 3668)}
    assert MRPC_SPLITS["train"] == 3668 and COLA_SPLITS["train"] == 8551  # GLUE's own sizes


def test_two_builders_of_one_folder_take_turns_and_the_second_reads_the_first(
    tmp_path, monkeypatch
):
    import threading
    import time

    from tpu_helpers.teaching import fixtures

    calls = []

    def staged(staging, seed, train_rows, references):  # a slow build, without the models
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        for name in fixtures.NOTEBOOK_FIXTURES:
            if name != "beans":  # written in place, as write_beans does
                (staging / name).mkdir()

    monkeypatch.setattr(fixtures, "_write_staged", staged)
    monkeypatch.setattr(fixtures, "write_beans", lambda out, seed: out.mkdir())
    results, errors = [], []

    def build():
        try:
            results.append(build_fixtures(tmp_path, references=False, verbose=False))
        except Exception as error:  # noqa: BLE001 - shown by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=build, name=f"builder {i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(calls) == 1, (errors, calls)  # one built, one waited and read
    assert results[0] == results[1] and all(Path(p).is_dir() for p in results[0].values())
