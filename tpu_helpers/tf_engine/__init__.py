"""The TF engine: transformers' TF classes on tf-keras and ``TPUStrategy`` (the seeds'
track): its trainer, custom loop, strategy, XLA checks and observers."""
