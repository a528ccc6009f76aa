"""The training core: errors, checks, the family table, versions, the log, the
Batches contract, the engine-neutral trainer loop, metrics, storage and the hub's files."""
