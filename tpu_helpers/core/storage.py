"""Save and load Hugging Face checkpoints anywhere ``tf.io.gfile`` reaches: a local folder,
``gs://bucket/prefix`` or TensorFlow's in-memory ``ram://`` file system.

``save_pretrained`` in transformers writes with ``os`` calls, which cannot reach a bucket;
these helpers stage through a local temporary folder and copy with ``tf.io.gfile``.
"""

from __future__ import annotations

import os
import re
import tempfile

from tpu_helpers.core.errors import InputError, MissingFileError

__all__ = [
    "gfile",
    "SHARED_SCHEMES",
    "is_remote",
    "is_shared",
    "copy_tree",
    "local_copy",
    "check_folder",
]


#: Path schemes that every host of a pod slice reads alike, over a network. ``ram://`` is
#: not one: it is the memory of one process (a stand-in for a bucket in tests).
SHARED_SCHEMES = ("gs://", "s3://", "hdfs://", "az://", "abfs://", "http://", "https://")


#: URL schemes a user may mean, for telling a malformed URL from a local folder's name.
_SCHEMES = ("gs", "gcs", "s3", "http", "https", "hdfs", "ram", "file", "az", "abfs")


def gfile():
    """``tf.io.gfile``, imported when first needed: files on ``gs://``, other registered
    schemes, and local paths, through one interface."""
    import tensorflow as tf

    return tf.io.gfile


def check_folder(path, what: str = "directory") -> None:
    """Refuse a folder to write to that cannot be what was meant, before anything is
    written: a malformed URL (``gs:/bucket``, ``gs:bucket``, ``gcs://``) would be taken as a
    local folder, and every save would be lost with the runtime; a URL of a file system
    TensorFlow cannot write here; a bucket name Cloud Storage does not allow; spaces at the
    ends. Local folders (``outputs/run``, ``/kaggle/working``, a mounted Drive) pass."""
    text = str(path)
    if text != text.strip():
        raise InputError(f"{what}={path!r} has spaces at its ends. Fix: {text.strip()!r}.")
    url = re.match(r"([A-Za-z][\w+.-]+):(/{0,2})(.*)", text)
    if url is None or (url.group(1).lower() not in _SCHEMES and url.group(2) != "//"):
        return  # a local path (``C:\\`` too: a drive's letter is no scheme)
    name, slashes, rest = url.groups()
    scheme = "gs" if name.lower() in ("gs", "gcs") else name.lower()
    if slashes != "//" or scheme != name:
        raise InputError(
            f"{what}={path!r} is neither a local folder nor a well-formed URL: saves there"
            f" would go to a local folder of that name, lost with the runtime. Fix:"
            f" {scheme}://{rest.lstrip('/')!s}, or a local folder."
        )
    import tensorflow as tf

    registered = [s for s in tf.io.gfile.get_registered_schemes() if s]
    if scheme not in registered:
        raise InputError(
            f"{what}={path!r}: TensorFlow here cannot write {scheme}:// paths (it writes"
            f" {', '.join(f'{s}://' for s in sorted(registered))} and local folders). Fix: a"
            " gs://bucket/folder, or a local folder (on Colab a mounted Drive:"
            " /content/drive/MyDrive/...)."
        )
    bucket = rest.split("/", 1)[0]
    if scheme == "gs" and not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket):
        raise InputError(
            f"{what}={path!r}: {bucket!r} is not a Cloud Storage bucket name (lowercase"
            " letters, digits, dashes, underscores and dots, 3 to 63 characters). Fix:"
            " gs://<your-bucket>/<folder>."
        )


def is_remote(path: str) -> bool:
    """True for a path of a TensorFlow file system (``gs://...``, ``ram://...``) that
    ``open()`` and ``os.path`` cannot read (only ``tf.io.gfile``); False for local paths and
    for KerasHub's ``hf://`` names of hub models, which no file system reads."""
    return "://" in str(path) and not str(path).startswith("hf://")


def is_shared(path: str) -> bool:
    """True for a path every host reads alike over a network (``SHARED_SCHEMES``): what a
    pod slice's hosts need, and where reads wait on the network (read several at once)."""
    return str(path).startswith(SHARED_SCHEMES)


def copy_tree(source: str, target: str) -> list[str]:
    """Copy every file below ``source`` to ``target`` (a local folder or a bucket's, made
    when missing) with ``tf.io.gfile``, replacing files of the same names; return targets."""
    import tensorflow as tf

    if not tf.io.gfile.isdir(source):
        raise MissingFileError(
            f"There is no folder {source} to copy. Fix: check the path (save_pretrained or"
            " the training run writes it)."
        )
    written = []
    for folder, _, files in tf.io.gfile.walk(source):
        rel = (
            os.path.relpath(folder, source)
            if not is_remote(source)
            else folder[len(source) :].lstrip("/")
        )
        dest = target if rel in ("", ".") else f"{target.rstrip('/')}/{rel}"
        tf.io.gfile.makedirs(dest)
        for name in files:
            tf.io.gfile.copy(f"{folder.rstrip('/')}/{name}", f"{dest}/{name}", overwrite=True)
            written.append(f"{dest}/{name}")
    return written


def local_copy(path: str) -> str:
    """``path`` on the local disk: itself when local, else a fresh temporary copy (for
    ``from_pretrained``, which reads with ``os``): of a folder and everything below it, or
    of a single file (the local file's path is returned)."""
    if not is_remote(path):
        return path
    import tensorflow as tf

    if not tf.io.gfile.exists(path):
        raise MissingFileError(f"{path} does not exist. Fix: check the bucket and prefix.")
    staging = tempfile.mkdtemp(prefix="tpu_helpers-")
    if not tf.io.gfile.isdir(path):
        local = os.path.join(staging, path.rstrip("/").rsplit("/", 1)[-1])
        tf.io.gfile.copy(path, local, overwrite=True)
        return local
    copy_tree(path, staging)
    return staging
