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
* ``masked_dataset``: batches of blocks, masked with a seed derived from
  ``(seed, epoch, step)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import tpu_helpers._env  # noqa: F401


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
        raise ValueError(f"block_size={block_size} is too small for a language model block.")
    separator = (
        tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    )
    if separator is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has neither a sep nor an eos token to put between"
            " documents. Fix: tokenizer.add_special_tokens({'sep_token': '</s>'}) and resize"
            " the model's embeddings, or use another tokenizer."
        )
    start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    body = block_size - (start is not None)
    missing = [text_column] if text_column not in dataset.column_names else []
    if missing:
        raise ValueError(
            f"The data set has no column {text_column!r} (it has {dataset.column_names})."
            " Fix: pass text_column=."
        )

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

    ids = tf.convert_to_tensor(input_ids)
    seed = tf.cast(tf.convert_to_tensor(seed), tf.int64)
    special = tf.reduce_any(ids[..., None] == tf.constant(list(special_ids), ids.dtype), axis=-1)
    pick = tf.random.stateless_uniform(tf.shape(ids), seed) < probability
    chosen = pick & ~special
    how = tf.random.stateless_uniform(tf.shape(ids), seed + [0, 1])
    random_ids = tf.random.stateless_uniform(
        tf.shape(ids), seed + [0, 2], minval=0, maxval=vocab_size, dtype=ids.dtype
    )
    masked = tf.where(chosen & (how < 0.8), tf.cast(mask_token_id, ids.dtype), ids)
    masked = tf.where(chosen & (how >= 0.8) & (how < 0.9), random_ids, masked)
    return masked, ids, tf.cast(chosen, tf.float32)


def step_seed(seed: int, epoch, step):
    """The stateless seed pair of one step: ``[seed, epoch * 2**32 + step]``."""
    import tensorflow as tf

    return tf.stack(
        [tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64) * 2**32 + tf.cast(step, tf.int64)]
    )


def masked_dataset(
    blocks,
    batch_size: int,
    tokenizer,
    seed: int = 0,
    epoch: int = 0,
    probability: float = 0.15,
):
    """Batches ``({"input_ids", "attention_mask"}, labels, weights)`` from a dataset of
    blocks (``tf.data`` of ``[block_size]`` ids, or anything ``from_tensor_slices`` takes),
    masked per step with ``step_seed(seed, epoch, step)``: a fresh mask every epoch, the
    same one for the same (seed, epoch, step), whatever ran before."""
    import tensorflow as tf

    if tokenizer.mask_token_id is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no mask token, which masked-language-model"
            " training needs. Fix: a tokenizer with one (BERT's [MASK], RoBERTa's <mask>), or"
            " tokenizer.add_special_tokens({'mask_token': '[MASK]'}) before training it."
        )
    if not isinstance(blocks, tf.data.Dataset):
        blocks = tf.data.Dataset.from_tensor_slices(np.asarray(blocks, np.int32))
    special = sorted(set(tokenizer.all_special_ids))
    vocab = len(tokenizer)

    def mask(step, ids):
        masked, labels, weights = mask_tokens(
            ids, step_seed(seed, epoch, step), tokenizer.mask_token_id, vocab, special, probability
        )
        features = {"input_ids": masked, "attention_mask": tf.ones_like(masked)}
        return features, labels, weights

    ds = blocks.batch(batch_size, drop_remainder=True).enumerate()
    return ds.map(mask, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
