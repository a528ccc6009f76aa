"""The training core: errors, report rows (``checks``), input validation, the family table,
versions, the log, the ``Batches`` contract, the loop both engines share (``engine``),
metrics and storage."""
