"""What a record set is on disk: shard and metadata names, the format tag, the dtypes a
column may have, and the error every reader and writer raises.
"""

from __future__ import annotations

import re

from tpu_helpers.core.errors import TpuHelpersError
from tpu_helpers.core.storage import SHARED_SCHEMES  # noqa: F401  (re-exported)

FORMAT = "tpu_helpers.records/1"
DEFAULT_SHARD_BYTES = 100 * 1024 * 1024
DTYPES = ("int64", "float32", "bytes")
LIST_KIND = {"int64": "int64_list", "float32": "float_list", "bytes": "bytes_list"}


def tf_dtypes() -> dict:
    """Our dtype names -> TensorFlow dtypes (TensorFlow is imported only when needed)."""
    import tensorflow as tf

    return {"int64": tf.int64, "float32": tf.float32, "bytes": tf.string}


# --- writing -------------------------------------------------------------------------
def shard_name(split: str, index: int, total: int, compression: str | None = None) -> str:
    """``train-00003-of-00016.tfrecord`` (``.gz`` added for GZIP)."""
    suffix = ".tfrecord.gz" if compression == "GZIP" else ".tfrecord"
    return f"{split}-{index:05d}-of-{total:05d}{suffix}"


def metadata_path(output_dir: str, split: str) -> str:
    return f"{output_dir.rstrip('/')}/{split}.metadata.json"


def split_files(folder: str, split: str) -> list[str]:
    """The shard files of exactly ``split`` in ``folder``: ``train`` does not take the
    shards of ``train-aug``, nor the unfinished files of a writer.

    >>> split_files("ram://nowhere", "train")
    []
    """
    import tensorflow as tf

    exact = re.compile(re.escape(split) + r"-\d{5}-of-\d{5}\.tfrecord(?:\.gz)?$")
    found = tf.io.gfile.glob(f"{folder.rstrip('/')}/{split}-*-of-*.tfrecord*")
    return sorted(p for p in found if exact.match(p.rsplit("/", 1)[-1]))


# --- reading -------------------------------------------------------------------------
class RecordsError(TpuHelpersError, ValueError):
    """Records and their metadata disagree, or a shard is corrupt."""
