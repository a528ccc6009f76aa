import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers import hub, mlm


@pytest.fixture(scope="module")
def tokenizer(fixtures_dir):

    return hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))


@pytest.fixture(scope="module")
def corpus(fixtures_dir):
    from datasets import load_dataset

    sentences = load_dataset(str(fixtures_dir / "cola"))["train"]["sentence"][:2400]
    from datasets import Dataset

    texts = [" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4)] + ["", "  "]
    return Dataset.from_dict({"text": texts})


def test_blocks_are_full_and_documents_separated(tokenizer, corpus):
    blocks = mlm.pack_blocks(corpus, tokenizer, block_size=32, batch_size=50)
    ids = np.asarray(blocks["input_ids"])
    assert ids.shape[1] == 32 and len(ids) > 10
    assert (ids[:, 0] == tokenizer.cls_token_id).all()
    assert not (ids == tokenizer.pad_token_id).any()  # every position is a real token
    documents = sum(1 for t in corpus["text"] if t.strip())
    stream = sum(
        len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1
        for t in corpus["text"]
        if t.strip()
    )
    kept = ids[:, 1:].size
    # what is dropped is the tail of each map batch: under one block per batch of documents
    assert stream - 31 * (-(-len(corpus) // 50)) <= kept <= stream
    assert (ids == tokenizer.sep_token_id).sum() >= documents - 2 * (-(-len(corpus) // 50))


def _batch(tokenizer, corpus, rows=64, width=128):
    blocks = mlm.pack_blocks(corpus, tokenizer, block_size=width, batch_size=1000)
    ids = np.asarray(blocks["input_ids"][:rows], np.int32)
    assert ids.shape == (rows, width)
    return ids


def _rates(original, masked, chosen, tokenizer):
    special = np.isin(original, tokenizer.all_special_ids)
    chosen = chosen.astype(bool)
    return {
        "chosen of non-special": chosen[~special].mean(),
        "special chosen": chosen[special].mean() if special.any() else 0.0,
        "mask": (masked[chosen] == tokenizer.mask_token_id).mean(),
        "kept": (masked[chosen] == original[chosen]).mean(),
        "untouched outside": (masked[~chosen] == original[~chosen]).mean(),
    }


def test_masking_statistics_match_the_data_collator(tokenizer, corpus):
    from transformers import DataCollatorForLanguageModeling

    ids = _batch(tokenizer, corpus)
    masked, labels, weights = mlm.mask_tokens(
        ids, [3, 0], tokenizer.mask_token_id, len(tokenizer), tokenizer.all_special_ids
    )
    ours = _rates(ids, masked.numpy(), weights.numpy(), tokenizer)
    np.testing.assert_array_equal(labels.numpy(), ids)

    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="np")
    np.random.seed(0)
    out = collator([{"input_ids": row} for row in ids])
    theirs = _rates(ids, out["input_ids"], out["labels"] != -100, tokenizer)
    for name, expected, tolerance in [
        ("chosen of non-special", 0.15, 0.02),  # 0.10 or 0.20 would be far outside
        ("mask", 0.8, 0.05),
        ("kept", 0.1 + 0.1 / len(tokenizer), 0.04),  # random ids that hit the original too
    ]:
        assert abs(ours[name] - expected) < tolerance, (name, ours)
        assert abs(theirs[name] - expected) < tolerance, (name, theirs)
    assert ours["special chosen"] == 0 and ours["untouched outside"] == 1.0
    got, chosen = masked.numpy(), weights.numpy().astype(bool)
    replaced = got[chosen & (got != tokenizer.mask_token_id) & (got != ids)]
    assert abs(len(replaced) / chosen.sum() - 0.1) < 0.04  # the random-token tenth
    # spread over the vocabulary: about as many distinct ids as uniform draws would give
    vocab, n = len(tokenizer), len(replaced)
    assert len(set(replaced.tolist())) > 0.85 * vocab * (1 - (1 - 1 / vocab) ** n)
    assert replaced.max() > 0.8 * vocab


def test_random_replacements_reach_every_id_of_a_large_vocabulary():
    """XLM-R's 250,002 ids: every id can be drawn, about equally often (reading the id off
    the choosing draw reached half of them, with probabilities 1.5x apart)."""
    vocab = 250_002
    ids = tf.fill([4096, 512], 5)
    drawn = []
    for step in range(12):
        masked, _, weights = mlm.mask_tokens(ids, [7, step], 4, vocab, [0, 1, 2, 3, 4])
        masked = masked.numpy()
        drawn.append(masked[(masked != 4) & (masked != 5)])
    drawn = np.concatenate(drawn)
    assert abs(len(drawn) / (12 * ids.shape[0] * ids.shape[1]) - 0.015) < 0.001
    counts = np.bincount(drawn, minlength=vocab)
    # about 1.5 draws an id: uniform draws leave exp(-1.5) = 22 % of the ids undrawn (an
    # id that cannot be drawn at all adds to that: reading the id off the choosing draw
    # left 52 % undrawn)
    assert abs((counts == 0).mean() - np.exp(-len(drawn) / vocab)) < 0.005
    top, bottom = counts[: vocab // 2].sum(), counts[vocab // 2 :].sum()
    assert abs(top / bottom - 1) < 0.01


def test_the_same_step_gets_the_same_mask_and_epochs_differ(tokenizer, corpus):
    ids = _batch(tokenizer, corpus, rows=64, width=32)
    run = list(mlm.masked_dataset(ids, 8, tokenizer, seed=5, epoch=0))
    again = list(mlm.masked_dataset(ids, 8, tokenizer, seed=5, epoch=0))
    # a run resumed at step 3 (skipping what was done) sees the masks of the uninterrupted one
    resumed = list(mlm.masked_dataset(ids, 8, tokenizer, seed=5, epoch=0).skip(3))
    next_epoch = list(mlm.masked_dataset(ids, 8, tokenizer, seed=5, epoch=1))
    for a, b in zip(run, again, strict=True):
        np.testing.assert_array_equal(a[0]["input_ids"], b[0]["input_ids"])
    np.testing.assert_array_equal(resumed[0][2], run[3][2])
    assert any((a[2].numpy() != b[2].numpy()).any() for a, b in zip(run, next_epoch, strict=True))
    assert run[0][0]["input_ids"].shape == (8, 32) and run[0][2].dtype == tf.float32


def test_rows_that_complete_a_short_record_batch_are_not_trained_on(tokenizer, corpus, tmp_path):
    from tpu_helpers import records

    blocks = _batch(tokenizer, corpus, rows=10, width=32)
    records.write_records([{"input_ids": b} for b in blocks], str(tmp_path), progress=False)
    batches = records.read_records(str(tmp_path), 8, label_column=None, shuffle=False)
    (_, _, first), (_, _, last) = list(mlm.mask_batches(batches, tokenizer, seed=1))
    # 10 blocks in batches of 8: the second batch has 2 blocks and 6 copies weighted 0
    assert (first.numpy().sum(axis=1) > 0).all()
    assert (last.numpy()[:2].sum(axis=1) > 0).all() and last.numpy()[2:].sum() == 0


def test_a_tokenizer_without_a_mask_token_is_refused(tokenizer):

    gpt2_like = hub.load_tokenizer(str(tokenizer.name_or_path))
    gpt2_like.mask_token = None
    with pytest.raises(ValueError, match="has no mask token"):
        mlm.masked_dataset(np.zeros((8, 16), np.int32), 4, gpt2_like)


def test_a_run_of_a_few_blocks_reads_only_the_leading_text_they_need():
    from datasets import Dataset

    lines = Dataset.from_dict({"text": ["x" * (i % 7) * 10 for i in range(25_000)]})
    need = 40 * 16 * mlm.CHARACTERS_PER_TOKEN  # 3,840 characters
    taken = mlm.leading_text(lines, "text", 40, 16, chunk=64)
    sizes = [len(t) for t in taken["text"]]
    assert sum(sizes) >= need > sum(sizes[:-1])  # enough, and not one row more
    assert taken["text"] == lines["text"][: len(taken)]
    assert len(mlm.leading_text(lines, "text", 10**6, 512)) == len(lines)  # all there is
    with pytest.raises(ValueError, match="blocks=0"):
        mlm.leading_text(lines, "text", 0, 16)


def test_blank_lines_and_headings_are_dropped():
    from datasets import Dataset

    lines = [
        "",
        " = Valkyria Chronicles = ",
        "",
        " The game began development . ",
        " = = Plot = = ",
        "   ",
        " It is set in 1935 . ",
    ]
    kept = mlm.clean_lines(Dataset.from_dict({"text": lines}))["text"]
    assert kept == [" The game began development . ", " It is set in 1935 . "]


@pytest.mark.parametrize("kind, mask", [("wordpiece", "[MASK]"), ("bpe", "<mask>")])
def test_a_trained_tokenizer_loads_back_with_autotokenizer(tmp_path, corpus, kind, mask):

    tokenizer = mlm.train_tokenizer(corpus, str(tmp_path / kind), vocab_size=400, kind=kind)
    again = hub.load_tokenizer(str(tmp_path / kind))
    assert tokenizer.mask_token == again.mask_token == mask and len(again) <= 400
    ids = again("The cat sleeps.")["input_ids"]
    assert ids[0] in (again.cls_token_id, again.bos_token_id) and ids[-1] in (
        again.sep_token_id,
        again.eos_token_id,
    )
    assert again.decode(ids, skip_special_tokens=True).replace(" ", "") == "Thecatsleeps."


def test_a_model_that_cannot_take_the_blocks_is_refused_before_training(tokenizer):
    from transformers import AutoConfig

    fits = AutoConfig.for_model("distilbert", vocab_size=len(tokenizer), max_position_embeddings=64)
    mlm.check_model_fits(fits, tokenizer, 64)
    small_vocab = AutoConfig.for_model("distilbert", vocab_size=100)
    with pytest.raises(
        ValueError, match=f"tokenizer has {len(tokenizer)} tokens, the model's vocabulary 100"
    ):
        mlm.check_model_fits(small_vocab, tokenizer, 64)
    with pytest.raises(ValueError, match="block_size=128 exceeds the distilbert model's 64"):
        mlm.check_model_fits(fits, tokenizer, 128)


def test_continued_pretraining_of_the_tiny_checkpoint_lowers_its_loss(
    fixtures_dir, tokenizer, corpus
):
    from transformers import AutoConfig, TFAutoModelForMaskedLM

    checkpoint = str(fixtures_dir / "tiny-distilbert")
    mlm.check_model_fits(AutoConfig.from_pretrained(checkpoint), tokenizer, 32)
    tf.keras.utils.set_random_seed(0)
    model = hub.from_pretrained(TFAutoModelForMaskedLM, checkpoint)
    model.compile(
        optimizer=tf.keras.optimizers.Adam(3e-3),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[
            tf.keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="mlm_loss")
        ],
    )
    blocks = np.asarray(mlm.pack_blocks(corpus, tokenizer, 32)["input_ids"][:256], np.int32)
    data = mlm.masked_dataset(blocks, 16, tokenizer, seed=0)
    before = mlm.perplexity(model.evaluate(data, verbose=0, return_dict=True))
    model.fit(data, epochs=3, verbose=0)
    after = mlm.perplexity(model.evaluate(data, verbose=0, return_dict=True))
    assert after < 0.5 * before, (before, after)
