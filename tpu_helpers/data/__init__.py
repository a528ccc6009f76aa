"""The data layer: text, TFRecord shards, images, masked-LM blocks and packed rows, each
built into a ``Batches`` (``tpu_helpers.core.pipeline``)."""
