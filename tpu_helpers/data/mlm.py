"""Masked-language-model data: packed blocks and dynamic masking inside ``tf.data``.

* ``pack_blocks``: tokenize raw text with a batched ``datasets.map`` and cut the
  concatenated token stream into blocks of exactly ``block_size`` tokens, a separator
  between documents, so that no position of a training batch is padding.
* ``mask_tokens``: BERT's masking for a whole batch at once, with static shapes: 15 % of
  the non-special tokens chosen per example, 80 % of those replaced by the mask token,
  10 % by a random token, 10 % kept. Stateless: the same ``seed`` pair gives the same
  mask, so a run resumed from a checkpoint sees the masks an uninterrupted run would
  have seen. Labels are the original ids with a 0/1 weight per position (the XLA-safe
  masked loss), never ``-100`` with boolean indexing.
* ``masked_batches`` / ``mask_batches``: batches of blocks, masked with a seed derived
  from ``(seed, epoch, step)``.
* ``clean_lines``: raw-text lines as a reader of wikitext expects them: no blank lines, no
  `` = Heading = `` lines.
* ``train_tokenizer``: a WordPiece (BERT family) or byte-level BPE (RoBERTa family)
  tokenizer trained from a ``datasets`` column streamed in batches, saved so that
  ``AutoTokenizer.from_pretrained(folder)`` loads it.
* ``check_model_fits``: vocabulary, mask token and block size against a model config,
  before any training step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from tpu_helpers.core.errors import InputError, NotFoundError
from tpu_helpers.core.validate import check_positive

__all__ = [
    "clean_lines",
    "CHARACTERS_PER_TOKEN",
    "leading_text",
    "train_tokenizer",
    "untrained_tokenizer",
    "check_model_fits",
    "pack_blocks",
    "mask_tokens",
    "step_seed",
    "mask_batches",
    "masked_batches",
    "fill_mask_table",
    "perplexity",
]

#: Special tokens per family, in the order their ids are given.
_SPECIALS = {
    "wordpiece": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "bpe": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
}
_HEADING = re.compile(r"^\s*(=\s+)+.*?(\s+=)+\s*$")


def clean_lines(dataset, text_column: str = "text"):
    """Drop blank lines and wikitext headings (`` = = Title = = ``): what is left is prose,
    one paragraph per row, which ``pack_blocks`` joins with separators."""

    def keep(batch):
        return [bool(t and t.strip()) and not _HEADING.match(t) for t in batch[text_column]]

    return dataset.filter(keep, batched=True, desc="drop blank lines and headings")


# English prose is about 4 to 4.5 characters a token under BPE and WordPiece vocabularies
# of 30-50k; 6 leaves a margin for smaller vocabularies and for what clean_lines drops.
CHARACTERS_PER_TOKEN = 6


def leading_text(dataset, text_column: str, blocks: int, block_size: int, chunk: int = 10_000):
    """The leading rows of ``dataset`` that hold about enough text for ``blocks`` blocks
    of ``block_size`` tokens (``CHARACTERS_PER_TOKEN`` characters a token), read
    ``chunk`` rows at a time: a run limited to ``blocks`` blocks trains its tokenizer on,
    tokenizes and packs only those rows, not the whole corpus."""
    check_positive(blocks=blocks)
    need, read = blocks * block_size * CHARACTERS_PER_TOKEN, 0
    for start in range(0, len(dataset), chunk):
        texts = dataset[start : start + chunk][text_column]
        ends = read + np.cumsum([len(t or "") for t in texts])
        if ends[-1] >= need:
            return dataset.select(range(start + int(np.searchsorted(ends, need)) + 1))
        read = int(ends[-1])
    return dataset


def train_tokenizer(
    dataset,
    folder: str,
    text_column: str = "text",
    vocab_size: int = 30522,
    kind: str = "wordpiece",
    batch_size: int = 1000,
    lowercase: bool = False,
):
    """Train a tokenizer on ``dataset[text_column]``, read ``batch_size`` rows at a time
    (never the whole corpus as one list), save it to ``folder`` and return it loaded with
    ``AutoTokenizer.from_pretrained(folder)``.

    ``kind="wordpiece"``: BERT's scheme and special tokens ([CLS] [SEP] [MASK] ...), for
    BERT and DistilBERT configs. ``kind="bpe"``: byte-level BPE with RoBERTa's (<s> </s>
    <mask> ...), for RoBERTa configs.
    """
    from tokenizers import processors
    from transformers import AutoTokenizer, BertTokenizerFast, RobertaTokenizerFast

    if kind not in _SPECIALS:
        raise InputError(f"kind={kind!r}: use 'wordpiece' (BERT family) or 'bpe' (RoBERTa).")
    special = _SPECIALS[kind]

    def batches():
        for batch in dataset.iter(batch_size=batch_size):
            yield [t for t in batch[text_column] if t]

    unk = "[UNK]" if kind == "wordpiece" else "<unk>"
    tok, trainer = untrained_tokenizer(kind, special, unk, vocab_size, lowercase)
    tok.train_from_iterator(batches(), trainer, length=len(dataset))
    first, last = (special[2], special[3]) if kind == "wordpiece" else (special[0], special[2])
    a, b = tok.token_to_id(first), tok.token_to_id(last)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}",
        pair=f"{first} $A {last} $B:1 {last}:1",
        special_tokens=[(first, a), (last, b)],
    )
    wrapper = BertTokenizerFast if kind == "wordpiece" else RobertaTokenizerFast
    tokenizer = wrapper(tokenizer_object=tok, do_lower_case=lowercase)
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def untrained_tokenizer(
    kind: str, specials: list[str], unk: str, vocab_size: int, lowercase: bool = False
):
    """``(tokenizer, trainer)`` of a kind: ``wordpiece`` (BERT's; cased unless
    ``lowercase``), byte-level ``bpe`` (RoBERTa's) or a ``unigram`` over Metaspace pieces
    (SentencePiece's), ``specials`` first in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=unk))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        return tok, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        return tok, trainer
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok, trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=specials, unk_token=unk
    )


def _require_mask_token(tokenizer) -> None:
    if tokenizer.mask_token_id is None:
        raise InputError(
            f"{type(tokenizer).__name__} has no mask token, which masked-language-model"
            " training needs. Fix: a tokenizer with one (BERT's [MASK], RoBERTa's <mask>),"
            " train_tokenizer(), or tokenizer.add_special_tokens({'mask_token': '[MASK]'})."
        )


def check_model_fits(config, tokenizer, block_size: int) -> None:
    """``ValueError`` before any training step when the model cannot take these blocks: a
    tokenizer without a mask token, ids beyond the model's vocabulary, blocks longer than
    its position embeddings."""
    from tpu_helpers.core.families import position_limit

    _require_mask_token(tokenizer)
    if len(tokenizer) > config.vocab_size:
        raise InputError(
            f"The tokenizer has {len(tokenizer)} tokens, the model's vocabulary"
            f" {config.vocab_size}: ids beyond it would fail (CPU) or read wrong rows (TPU)."
            f" Fix: vocab_size={len(tokenizer)} in the config (from scratch), or"
            " model.resize_token_embeddings(len(tokenizer)) (continued pretraining)."
        )
    limit = position_limit(config)
    if limit is not None and block_size > limit:
        raise InputError(
            f"block_size={block_size} exceeds the {config.model_type} model's {limit}"
            f" positions. Fix: block_size <= {limit}."
        )


def _separator(tokenizer) -> int:
    """The token put between documents: the tokenizer's ``sep``, else its ``eos``."""
    separator = (
        tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    )
    if separator is None:
        raise InputError(
            f"{type(tokenizer).__name__} has neither a sep nor an eos token to put between"
            " documents. Fix: tokenizer.add_special_tokens({'sep_token': '</s>'}) and resize"
            " the model's embeddings, or use another tokenizer."
        )
    return separator


def pack_blocks(
    dataset,
    tokenizer,
    block_size: int,
    text_column: str = "text",
    batch_size: int = 1000,
    keep_empty: bool = False,
):
    """A ``datasets.Dataset`` with one column ``input_ids`` of ``block_size`` ids per row.

    Documents are tokenized without special tokens, joined with the tokenizer's separator
    (``sep_token``, else ``eos_token``) and cut into blocks; each block starts with the
    ``cls``/``bos`` token when the tokenizer has one, as the model saw in pretraining.
    Within each map batch of ``batch_size`` documents, the tokens after the last whole
    block are dropped (as transformers' ``run_mlm`` ``group_texts`` does): at most
    ``block_size - 1`` tokens per batch of documents, so that every position is a real
    token. Blank documents are left out unless ``keep_empty``.
    """
    if block_size < 8:
        raise InputError(
            f"block_size={block_size} is too small for a language model block. Fix: 128 or"
            " more (BERT and RoBERTa were pretrained on blocks of 512)."
        )
    if text_column not in dataset.column_names:
        raise InputError(
            f"The data set has no column {text_column!r} (it has {dataset.column_names})."
            " Fix: pass text_column=."
        )
    separator = _separator(tokenizer)
    start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    body = block_size - (start is not None)

    def blocks(batch):
        texts = [t for t in batch[text_column] if keep_empty or (t and t.strip())]
        if not texts:
            return {"input_ids": []}
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        stream = np.fromiter(
            (i for doc in ids for i in (*doc, separator)),
            dtype=np.int64,
            count=sum(len(d) + 1 for d in ids),
        )
        n = len(stream) // body
        rows = stream[: n * body].reshape(n, body)
        if start is not None:
            rows = np.concatenate([np.full((n, 1), start, np.int64), rows], axis=1)
        return {"input_ids": rows.tolist()}

    return dataset.map(
        blocks,
        batched=True,
        batch_size=batch_size,
        remove_columns=dataset.column_names,
        desc=f"pack into blocks of {block_size}",
    )


def mask_tokens(
    input_ids,
    seed,
    mask_token_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    probability: float = 0.15,
):
    """``(masked ids, labels, weights)`` for a batch of token ids ``[B, T]``.

    ``seed`` is a stateless seed pair (``[2]`` int). Each non-special token is chosen with
    ``probability``; chosen tokens become ``mask_token_id`` (80 %), a random id (10 %) or
    stay (10 %). ``labels`` are the original ids, ``weights`` 1.0 where chosen.
    """
    import tensorflow as tf

    if isinstance(probability, bool) or not 0 < probability < 1:
        raise InputError(
            f"probability={probability!r} must be between 0 and 1 (the share of tokens to"
            " mask). Fix: 0.15, as BERT and RoBERTa were pretrained."
        )
    if mask_token_id is None:
        raise InputError(
            "mask_token_id is None: the tokenizer has no mask token. Fix: a tokenizer made for"
            " masked-LM ([MASK] or <mask>), e.g. mlm.train_tokenizer, or"
            " tokenizer.add_special_tokens({'mask_token': '[MASK]'}) and a resized model."
        )
    ids = tf.convert_to_tensor(input_ids)
    seed = tf.cast(tf.convert_to_tensor(seed), tf.int64)
    # one lookup per token in a table of the vocabulary, not a comparison per special id
    table = np.zeros(max(vocab_size, max(special_ids, default=0) + 1), bool)
    table[list(special_ids)] = True
    special = tf.gather(tf.constant(table), ids)
    # One uniform draw per position chooses it (u < probability) and what it becomes: for
    # a chosen one u / probability is again uniform in [0, 1): below 0.8 the mask token,
    # 0.8-0.9 a random id, above 0.9 the token stays. The random id is a draw of its own,
    # uniform over the whole vocabulary (a float32 u has too few values in that band to
    # reach every id of a 250,000-token vocabulary).
    u = tf.random.stateless_uniform(tf.shape(ids), seed)
    chosen = (u < probability) & ~special
    how = u / probability
    id_seed = tf.random.experimental.stateless_fold_in(seed, 1)
    random_ids = tf.random.stateless_uniform(tf.shape(ids), id_seed, 0, vocab_size, dtype=tf.int64)
    random_ids = tf.cast(random_ids, ids.dtype)
    masked = tf.where(chosen & (how < 0.8), tf.cast(mask_token_id, ids.dtype), ids)
    masked = tf.where(chosen & (how >= 0.8) & (how < 0.9), random_ids, masked)
    return masked, ids, tf.cast(chosen, tf.float32)


def step_seed(seed: int, epoch, step):
    """The stateless seed pair of one step's masks: ``pipeline.seed_pair`` of the
    ``"mask"`` stream, as an int64 tensor ``[2]``."""
    import tensorflow as tf

    from tpu_helpers.core.pipeline import STREAMS, seed_pair

    return seed_pair(seed, tf.cast(epoch, tf.int64), step, STREAMS["mask"])


def mask_batches(
    batches,
    tokenizer,
    seed: int = 0,
    epoch: int = 0,
    first_step: int = 0,
    probability: float = 0.15,
):
    """Mask a ``tf.data`` dataset of id batches (``[B, T]``, a dict with ``input_ids``,
    or ``(features, labels, weights)`` from a ``pipeline.Batches``):
    ``({"input_ids"}, labels, weights)``, batch ``i`` masked with
    ``step_seed(seed, epoch, first_step + i)``; rows weighted 0 (the copies completing a
    short batch) get weight 0 at every position. Pass ``first_step`` when resuming an
    epoch after skipping the batches already done: the masks are the uninterrupted run's.
    ``masked_batches`` does all this for a ``pipeline.Batches``.
    """
    import tensorflow as tf

    _require_mask_token(tokenizer)
    special = sorted(set(tokenizer.all_special_ids))
    vocab = len(tokenizer)

    def ids_of(element):
        if isinstance(element, tuple):
            element = element[0]
        return element["input_ids"] if isinstance(element, dict) else element

    def mask(step, element):
        ids = ids_of(element)
        masked, labels, weights = mask_tokens(
            ids,
            step_seed(seed, epoch, step + first_step),
            tokenizer.mask_token_id,
            vocab,
            special,
            probability,
        )
        if isinstance(element, tuple) and len(element) > 1:
            # the pipeline's row weights: the copies completing a short batch count for 0
            weights = weights * tf.cast(element[-1], weights.dtype)[:, None]
        # every position of a packed block is a token: no attention_mask (models take all)
        return {"input_ids": masked}, labels, weights

    return batches.enumerate().map(mask, num_parallel_calls=tf.data.AUTOTUNE)


def masked_batches(
    blocks,
    tokenizer,
    *,
    global_batch: int | None = None,
    seed: int = 0,
    probability: float = 0.15,
):
    """The ``pipeline.Batches`` of masked-LM batches ``({"input_ids"}, labels, weights)``.

    ``blocks``: a ``pipeline.Batches`` of token blocks (``records.read_records(...,
    label_column=None)``), or an array ``[n, block_size]`` of them (batched here into
    ``global_batch`` rows, each epoch in the order of ``pipeline.rng(seed, epoch)``). Each
    batch is masked with ``step_seed(seed, epoch, step)``: a fresh mask every epoch, the
    same one for the same (seed, epoch, step) whatever ran before, a resumed epoch
    included."""
    import tensorflow as tf

    from tpu_helpers.core.pipeline import Batches, from_arrays

    _require_mask_token(tokenizer)
    if not isinstance(blocks, Batches):
        if global_batch is None:
            raise InputError(
                "masked_batches of an array needs global_batch=. Fix: the rows per step."
            )
        ids = np.asarray(blocks, np.int32)
        blocks = from_arrays(
            {"input_ids": ids},
            np.zeros(len(ids), np.int32),
            global_batch=global_batch,
            seed=seed,
            name="masked-LM blocks",
        )
    source = blocks

    def build(epoch, skip_steps, input_context):
        local = 1
        if input_context is not None and source.reads_per_host:  # a batch per replica
            replicas = input_context.num_replicas_in_sync
            local = max(1, replicas // input_context.num_input_pipelines)
        ds = source.build(epoch, skip_steps, input_context)
        masked = mask_batches(ds, tokenizer, seed, epoch, skip_steps * local, probability)
        return masked.prefetch(tf.data.AUTOTUNE)

    return dataclasses.replace(source, build=build, name=f"masked {source.name}")


def fill_mask_table(model, tokenizer, texts: Sequence[str], k: int = 3, words: int = 12):
    """For each text, mask one token (the middle one of its first ``words`` tokens) and
    list the model's top ``k`` guesses: rows of ``{"text", "answer", "guesses", "right"}``
    (what a fill-mask demonstration prints before and after training). ``model``: the TF
    engine's ``*ForMaskedLM`` or the Keras 3 engine's ``keras3.masked_lm``."""
    rows = []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=words + 2)["input_ids"]
        inner = [i for i, t in enumerate(ids) if t not in tokenizer.all_special_ids]
        if not inner:
            continue
        at = inner[len(inner) // 2]
        answer = ids[at]
        masked = list(ids)
        masked[at] = tokenizer.mask_token_id
        out = model({"input_ids": np.asarray([masked], np.int32)}, training=False)
        logits = np.asarray(getattr(out, "logits", out)[0, at], np.float32)
        top = np.argsort(-logits, kind="stable")[:k].tolist()
        rows.append(
            {
                "text": tokenizer.decode(masked, skip_special_tokens=False),
                "answer": tokenizer.convert_ids_to_tokens(answer),
                "guesses": " ".join(tokenizer.convert_ids_to_tokens(top)),
                "right": answer in top,
            }
        )
    return rows


def perplexity(history_or_logs: dict, key: str = "mlm_loss") -> float:
    """``exp`` of the masked-token cross-entropy a compiled weighted metric named ``key``
    reports (the mean over masked positions only, not over every position)."""
    if key not in history_or_logs:
        raise NotFoundError(
            f"{key!r} is not among the logged metrics {sorted(history_or_logs)}. Fix: compile"
            f" with weighted_metrics named {key!r} (see notebook 06), or pass key= one of them."
        )
    value = history_or_logs[key]
    if isinstance(value, list):
        if not value:
            raise InputError(f"{key!r} holds no values yet. Fix: train or evaluate first.")
        value = value[-1]
    return float(np.exp(value))
