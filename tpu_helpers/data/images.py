"""Images for TPUs: stream files (local or ``gs://``) through ``tf.data`` into a ViT.

Hugging Face image processors run in Python on PIL images, which a ``tf.data`` pipeline
(and a legacy TPU Node's remote input workers) cannot call. This module reads the
processor's settings once (size, rescale factor, mean, std) and does the same work with
TensorFlow ops: read, decode (JPEG at a reduced scale when the target is much smaller,
which is most of the cost saved), resize, augment (training only), rescale, normalize
and move channels first, as TF ViT models expect ``pixel_values``.

Bad files fail with their name: missing files (found by listing each folder once, before
reading), and a file that is not a JPEG/PNG/GIF/BMP or is truncated (checked in the
pipeline, before decoding). With
``on_error="skip"`` every file is checked once up front and the bad ones are left out and
reported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.errors import InputError, MissingFileError
from tpu_helpers.core.messages import say
from tpu_helpers.core.validate import check_labels, check_positive

__all__ = [
    "ImageSpec",
    "rebase_paths",
    "write_image_files",
    "files_of",
    "check_classes",
    "MAX_PIXELS",
    "image_size",
    "image_problem",
    "scan_images",
    "missing_files",
    "JPEG_SUFFIXES",
    "REDUCED_DECODE_MARGIN",
    "decode_scale",
    "decode_image",
    "resize_like_processor",
    "load_image",
    "crop_and_flip",
    "augment",
    "normalize",
    "pixels_of",
    "image_batches",
    "write_image_records",
    "image_record_batches",
]

_JPEG, _PNG = b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"
_OTHER = (b"GIF87a", b"GIF89a", b"BM")


# --- settings from the processor --------------------------------------------------------
#: PIL resampling filters (``PILImageResampling`` values) and the ``tf.image.resize``
#: method that computes the same kernel (both antialias when shrinking).
_RESAMPLE = {0: "nearest", 1: "lanczos3", 2: "bilinear", 3: "bicubic", 4: "area"}
_RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
#: Processor steps the pipeline reproduces (``do_reduce_labels`` concerns segmentation
#: maps, never class labels; ``do_convert_rgb``: images are decoded to RGB anyway).
_STEPS = {
    "do_resize",
    "do_center_crop",
    "do_rescale",
    "do_normalize",
    "do_flip_channel_order",
    "do_convert_rgb",
    "do_reduce_labels",
}


@dataclass(frozen=True)
class ImageSpec:
    """What a Hugging Face image processor does, as numbers ``tf.data`` can use.

    Attributes:
        height, width: the size of ``pixel_values`` (after any crop).
        mean, std, rescale_factor, do_normalize: ``pixels * rescale_factor``, then
            ``(x - mean) / std`` per channel when ``do_normalize``.
        resize: ``(height, width)`` to resize to first, ``None``: ``(height, width)``.
        shortest_edge: instead of ``resize``, resize keeping the aspect ratio so that the
            shorter side has this length (the longer one ``int(edge * long / short)``).
        crop: center-crop the resized image to ``(height, width)``.
        resample: ``tf.image.resize`` method matching the processor's PIL filter.
        flip_channels: RGB to BGR (MobileViT's processor).
    """

    height: int
    width: int
    mean: tuple
    std: tuple
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    resize: tuple | None = None
    shortest_edge: int | None = None
    crop: bool = False
    resample: str = "bilinear"
    flip_channels: bool = False

    @property
    def decode_size(self) -> tuple[int, int]:
        """The smallest ``(height, width)`` a decoded image must cover before resizing."""
        if self.shortest_edge:
            return self.shortest_edge, self.shortest_edge
        return self.resize or (self.height, self.width)

    @classmethod
    def from_pretrained(cls, checkpoint: str, **hub_options) -> ImageSpec:
        """The spec of ``checkpoint``'s image processor (a folder or a hub id), read from
        its ``preprocessor_config.json`` with the defaults of the processor class it names
        (``PROCESSOR_DEFAULTS``): no image processor object, so no PyTorch, which
        transformers 5's image processors need (Colab's TPU runtime ships transformers
        5.15; a TPU VM with JAX alone has no PyTorch). It equals ``from_processor`` of
        transformers' own processor (tests/test_images.py)."""
        return cls.from_processor(processor_settings(checkpoint, **hub_options))

    @classmethod
    def from_processor(cls, processor) -> ImageSpec:
        """The spec of ``processor`` (any image processor of transformers' TF image
        classifiers: ViT, DeiT, BEiT/Data2Vec, ConvNeXt (also ResNet, RegNet, CvT), Swin,
        EfficientFormer, MobileViT, Segformer; or ``processor_settings``). A step it cannot
        reproduce raises ``ValueError`` naming the step; nothing is left out silently."""
        name = getattr(processor, "image_processor_type", None) or type(processor).__name__
        code = _resample_code(processor, name)
        height, width, resize, shortest, do_crop = _geometry(processor, name)
        do_rescale = getattr(processor, "do_rescale", True)
        mean = getattr(processor, "image_mean", None) or (0.0, 0.0, 0.0)
        std = getattr(processor, "image_std", None) or (1.0, 1.0, 1.0)
        return cls(
            height=int(height),
            width=int(width),
            mean=tuple(float(m) for m in mean),
            std=tuple(float(v) for v in std),
            rescale_factor=float(processor.rescale_factor if do_rescale else 1.0),
            do_normalize=bool(getattr(processor, "do_normalize", False)),
            resize=None if resize == (height, width) and not do_crop else resize,
            shortest_edge=shortest,
            crop=do_crop,
            resample=_RESAMPLE[code],
            flip_channels=bool(getattr(processor, "do_flip_channel_order", False)),
        )


_STANDARD, _IMAGENET = [0.5, 0.5, 0.5], [[0.485, 0.456, 0.406], [0.229, 0.224, 0.225]]
_SQUARE_224 = {"height": 224, "width": 224}
_RESIZE_256_CROP_224 = dict(
    size={"height": 256, "width": 256},
    resample=3,
    do_center_crop=True,
    crop_size=_SQUARE_224,
    square=True,
)
#: What transformers' image processors do where their saved settings are silent (their
#: ``__init__`` defaults, transformers 4.57), for the classes ``from_processor`` knows. A
#: ``size`` saved as one number is a square for those marked ``square``, else the shorter
#: side (transformers' ``get_size_dict``).
PROCESSOR_DEFAULTS = {
    "ViTImageProcessor": dict(size={"height": 224, "width": 224}, resample=2, square=True),
    "DeiTImageProcessor": _RESIZE_256_CROP_224,
    "BeitImageProcessor": _RESIZE_256_CROP_224,
    "ConvNextImageProcessor": dict(size={"shortest_edge": 384}, crop_pct=0.875, resample=2),
    "CLIPImageProcessor": dict(
        size={"shortest_edge": 224},
        resample=3,
        do_center_crop=True,
        crop_size=_SQUARE_224,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    ),
    "MobileViTImageProcessor": dict(
        size={"shortest_edge": 224},
        resample=2,
        do_center_crop=True,
        crop_size={"height": 256, "width": 256},
        do_normalize=False,
        do_flip_channel_order=True,
        image_mean=None,
        image_std=None,
    ),
    "SegformerImageProcessor": dict(
        size={"height": 512, "width": 512},
        resample=2,
        image_mean=_IMAGENET[0],
        image_std=_IMAGENET[1],
        square=True,
    ),
    "EfficientFormerImageProcessor": dict(
        size=_SQUARE_224,
        resample=3,
        do_center_crop=True,
        crop_size=_SQUARE_224,
        image_mean=_IMAGENET[0],
        image_std=_IMAGENET[1],
        square=True,
    ),
}
#: Every class's defaults where its own entry says nothing.
_COMMON = dict(
    do_resize=True,
    do_rescale=True,
    rescale_factor=1 / 255,
    do_normalize=True,
    image_mean=_STANDARD,
    image_std=_STANDARD,
    do_center_crop=False,
)


def processor_settings(checkpoint: str, **hub_options) -> SimpleNamespace:
    """``checkpoint``'s image processor settings (its ``preprocessor_config.json``, a folder
    or a hub id) completed with its class's defaults, as attributes named as on
    transformers' processors; ``image_processor_type`` names the class (an older
    ``*FeatureExtractor`` as its ``*ImageProcessor``). Refused, with the fix, when the
    file is missing or names a class whose defaults are not known here."""
    from tpu_helpers.data.hub import resolve_file

    path = resolve_file(checkpoint, "preprocessor_config.json", hub_options)
    if path is None:
        raise InputError(
            f"{checkpoint} has no preprocessor_config.json, so its image preprocessing is"
            " unknown. Fix: an image checkpoint saved with its processor (save_pretrained"
            " of the processor writes it), or ImageSpec(height=..., mean=..., std=...)."
        )
    with open(path, encoding="utf-8") as file:
        saved = json.load(file)
    name = saved.get("image_processor_type") or saved.get("feature_extractor_type") or ""
    name = name.replace("FeatureExtractor", "ImageProcessor").removesuffix("Fast")
    if name not in PROCESSOR_DEFAULTS:
        raise InputError(
            f"{checkpoint}'s preprocessor_config.json names {name or 'no class'}, whose"
            f" defaults are not known here (known: {', '.join(PROCESSOR_DEFAULTS)})."
            " Fix: ImageSpec.from_processor(AutoImageProcessor.from_pretrained(...)) where"
            " transformers can build it, or an ImageSpec written out."
        )
    defaults = dict(PROCESSOR_DEFAULTS[name])
    square = defaults.pop("square", False)
    settings = {**_COMMON, **defaults}
    settings.update({k: v for k, v in saved.items() if v is not None})
    for key, is_square in (("size", square), ("crop_size", True)):
        value = settings.get(key)
        if isinstance(value, (int, float)):  # one number, as older processors saved it
            value = int(value)
            settings[key] = (
                {"height": value, "width": value} if is_square else {"shortest_edge": value}
            )
    settings["image_processor_type"] = name
    return SimpleNamespace(**settings)


def _resample_code(processor, name: str) -> int:
    """PIL's code of the processor's resize filter, after checking that every step the
    processor applies is one the pipeline reproduces."""
    on = sorted(k for k, v in vars(processor).items() if k.startswith("do_") and v is True)
    unknown = [k for k in on if k not in _STEPS]
    if unknown:
        raise InputError(
            f"{name} applies {unknown}, which the tf.data pipeline does not reproduce."
            " Fix: turn it off on the processor if the model does not need it, or"
            " preprocess with the processor itself (slower)."
        )
    if not getattr(processor, "do_resize", True):
        raise InputError(
            f"{name} does not resize (do_resize=False): images keep their own sizes,"
            " which a TPU batch cannot hold. Fix: processor.do_resize = True."
        )
    code = getattr(processor, "resample", 2)
    code = int(getattr(code, "value", code))
    if code not in _RESAMPLE:
        raise InputError(
            f"{name} resizes with PIL's {_RESAMPLE_NAMES.get(code, code)} filter, which"
            " tf.image.resize does not have. Fix: set processor.resample to BILINEAR or"
            " BICUBIC, or preprocess with the processor itself."
        )
    return code


def _geometry(processor, name: str):
    """``(height, width, resize, shortest_edge, crop)`` of the processor's resize and
    center crop: ``resize`` a fixed (height, width), or ``shortest_edge`` the shorter
    side's length keeping the aspect ratio."""
    size = dict(processor.size or {})
    crop = dict(getattr(processor, "crop_size", None) or {})
    do_crop = bool(getattr(processor, "do_center_crop", False))
    resize = shortest = None
    if name.startswith("ConvNext") and "shortest_edge" in size:
        edge = height = width = int(size["shortest_edge"])
        if edge < 384:  # shorter side to edge / crop_pct, then the center edge x edge
            shortest = int(edge / float(processor.crop_pct))
            do_crop, crop = True, {"height": edge, "width": edge}
        # else: warped to a square, no crop
    elif "height" in size and "width" in size:
        resize = (int(size["height"]), int(size["width"]))
        height, width = resize
    elif set(size) == {"shortest_edge"}:
        shortest = height = width = int(size["shortest_edge"])
        if not do_crop:
            raise InputError(
                f"{name} resizes the shorter side to {shortest} and keeps the aspect ratio"
                " without cropping: images of different shapes cannot share a batch."
                " Fix: processor.do_center_crop = True with a crop_size, or a size with"
                " height and width."
            )
    else:
        raise InputError(
            f"{name} has size {size}, which the pipeline does not reproduce (it takes"
            " height/width or shortest_edge)."
        )
    if do_crop:
        if "height" not in crop:
            raise InputError(f"{name} center-crops but has no crop_size height/width.")
        height, width = int(crop["height"]), int(crop.get("width", crop["height"]))
        before = (shortest, shortest) if shortest else resize or (height, width)
        if before[0] < height or before[1] < width:
            raise InputError(
                f"{name} crops {height}x{width} out of a {before[0]}x{before[1]} resize,"
                " which pads with zeros; the pipeline does not. Fix: a crop_size no"
                " larger than the resize size."
            )
    return height, width, resize, shortest, do_crop


def rebase_paths(paths: Sequence[str], base: str, keep: int = 2) -> list[str]:
    """Move file paths onto ``base`` keeping their last ``keep`` parts (class folder and
    file name): ``/data/train/rust/a.jpg`` -> ``gs://bucket/beans/rust/a.jpg``."""
    base = base.rstrip("/")
    return [f"{base}/{'/'.join(str(p).replace(chr(92), '/').split('/')[-keep:])}" for p in paths]


def write_image_files(
    split, folder: str, *, image_column: str = "image", label_column: str = "labels"
) -> list[str]:
    """Write the images a data set carries (its ``Image`` column, as the hub's ``beans``
    has) to ``folder`` (local or ``gs://``), one subfolder per label, and return their
    paths in the split's order: the file list ``image_batches`` streams when the paths the
    data set lists are not on this machine and no bucket holds the files. The bytes are
    written as stored (no decode, no re-encode); a file already there with the same size
    is kept, so a second call after an interruption finishes the rest."""
    import datasets
    import tensorflow as tf

    if image_column not in split.column_names:
        raise InputError(
            f"the split has no {image_column!r} column (it has {split.column_names}). Fix:"
            " image_column= the column of images, or a data set that carries them."
        )
    stored = split.cast_column(image_column, datasets.Image(decode=False))
    folder = folder.rstrip("/")
    paths = []
    for i, (image, label) in enumerate(
        zip(stored[image_column], stored[label_column], strict=True)
    ):
        data = image["bytes"]
        if data is None:  # stored as a path on this machine
            with tf.io.gfile.GFile(image["path"], "rb") as f:
                data = f.read()
        suffix = ".png" if data.startswith(_PNG) else ".jpg" if data.startswith(_JPEG) else ".img"
        path = f"{folder}/{label}/{i:06d}{suffix}"
        if not (tf.io.gfile.exists(path) and tf.io.gfile.stat(path).length == len(data)):
            tf.io.gfile.makedirs(f"{folder}/{label}")
            with tf.io.gfile.GFile(path, "wb") as f:
                f.write(data)
        paths.append(path)
    return paths


def files_of(
    split,
    base_path: str = "",
    folder: str | None = None,
    *,
    path_column: str = "image_file_path",
    image_column: str = "image",
    label_column: str = "labels",
) -> tuple[list[str], list[int]]:
    """The file list ``image_batches`` streams for ``split`` (a split of an image data set
    such as the hub's ``beans``), and its labels, from where the files are:

    * ``base_path`` given (a bucket or folder holding them in class folders): the paths the
      data set lists, moved onto it (``rebase_paths``);
    * else the listed paths, where this machine has every one of them;
    * else the images the data set carries (its ``image_column``) written to ``folder`` once
      (``write_image_files``; local or ``gs://``, kept for the next run).

    Nothing else is needed to read the hub's data set, bucket or not."""
    import tensorflow as tf

    columns = split.column_names
    if label_column not in columns:
        raise InputError(
            f"the split has no {label_column!r} column (it has {columns}). Fix:"
            " label_column= the column of class ids."
        )
    labels = [int(label) for label in split[label_column]]
    listed = [str(p) for p in split[path_column]] if path_column in columns else []
    if base_path:
        if not listed:
            raise InputError(
                f"base_path={base_path!r} moves the listed paths, and the split has no"
                f" {path_column!r} column (it has {columns}). Fix: path_column= the column of"
                " file paths, or base_path='' to use the images the data set carries."
            )
        return rebase_paths(listed, base_path), labels
    if listed and all(tf.io.gfile.exists(path) for path in listed):
        return listed, labels
    if image_column in columns:
        if not folder:
            raise InputError(
                "the listed image files are not on this machine; the data set carries the"
                " images, which need a folder to be written to. Fix: folder= a local folder"
                " or a gs:// one (written once, kept for the next run)."
            )
        return write_image_files(
            split, folder, image_column=image_column, label_column=label_column
        ), labels
    missing = next((p for p in listed if not tf.io.gfile.exists(p)), None)
    raise InputError(
        f"the split lists files this machine does not have ({missing}) and carries no"
        f" {image_column!r} column of images. Fix: base_path= the bucket or folder that"
        " holds the files in class folders."
    )


def check_classes(labels: Sequence[int], class_names: Sequence[str], model_config=None) -> None:
    """Refuse labels outside ``class_names`` and a model whose ``num_labels`` differs
    (``validate.check_labels`` checks the label values alone)."""
    try:
        check_labels(labels, len(class_names), "labels")
    except ValueError as err:
        raise InputError(f"{err} The classes: {list(class_names)}.") from None
    if model_config is not None and model_config.num_labels != len(class_names):
        raise InputError(
            f"The model has {model_config.num_labels} output labels, the data"
            f" {len(class_names)} classes {list(class_names)}. Fix: from_pretrained(...,"
            f" num_labels={len(class_names)}, id2label=..., label2id=...,"
            " ignore_mismatched_sizes=True)."
        )


# --- checking files ---------------------------------------------------------------------
#: Images claiming more pixels than this are refused before decoding (the limit Pillow uses
#: against decompression bombs): a forged header can otherwise ask for gigabytes, or a
#: JPEG whose data does not match its header decodes to a flat gray picture.
MAX_PIXELS = 89_478_485


def image_size(data: bytes) -> tuple[int, int] | None:
    """``(height, width)`` from the header of a JPEG, PNG, GIF or BMP file, without decoding
    it; ``None`` when the header does not say.

    >>> image_size(b"GIF89a" + (640).to_bytes(2, "little") + (480).to_bytes(2, "little"))
    (480, 640)
    """
    if data.startswith(_PNG) and len(data) >= 24:
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    if data.startswith(_OTHER[:2]) and len(data) >= 10:
        return int.from_bytes(data[8:10], "little"), int.from_bytes(data[6:8], "little")
    if data.startswith(b"BM") and len(data) >= 26:
        width = int.from_bytes(data[18:22], "little", signed=True)
        return abs(int.from_bytes(data[22:26], "little", signed=True)), abs(width)
    if data.startswith(_JPEG):
        at = 2
        while at + 9 <= len(data) and data[at] == 0xFF:
            marker, length = data[at + 1], int.from_bytes(data[at + 2 : at + 4], "big")
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # start of frame
                return (
                    int.from_bytes(data[at + 5 : at + 7], "big"),
                    int.from_bytes(data[at + 7 : at + 9], "big"),
                )
            at += 2 + length
    return None


def image_problem(data: bytes, max_pixels: int = MAX_PIXELS) -> str | None:
    """Why ``data`` is not a complete JPEG/PNG/GIF/BMP file of at most ``max_pixels``
    pixels, or None when it looks whole."""
    if data.startswith(_JPEG):
        if b"\xff\xd9" not in data[-64:]:
            return "truncated JPEG (no end-of-image marker)"
    elif data.startswith(_PNG):
        if b"IEND" not in data[-16:]:
            return "truncated PNG (no IEND chunk)"
    elif not data.startswith(_OTHER):
        return "not a JPEG, PNG, GIF or BMP file"
    size = image_size(data)
    if size and size[0] * size[1] > max_pixels:
        return f"claims {size[0]}x{size[1]} pixels, over the limit of {max_pixels:,}"
    return None


def scan_images(paths: Sequence[str], max_pixels: int = MAX_PIXELS) -> dict[str, str]:
    """Read every file once; return ``{path: problem}`` for the missing and broken ones."""
    import tensorflow as tf

    problems = {}
    for path in paths:
        try:
            with tf.io.gfile.GFile(path, "rb") as f:
                data = f.read()
        except tf.errors.NotFoundError:
            problems[path] = "missing"
            continue
        except tf.errors.OpError as err:  # a folder (.ipynb_checkpoints), no permission
            problems[path] = f"cannot be read ({first_line(err, 120)})"
            continue
        problem = image_problem(data, max_pixels)  # by content: a PNG named .jpg is read
        if problem:
            problems[path] = problem
    return problems


def missing_files(paths: Sequence[str]) -> list[str]:
    """The paths that do not exist, found by listing each folder once (one request per
    folder on a bucket, instead of one per file). Folders that cannot be listed are not
    checked (reading their files reports a missing one)."""
    import tensorflow as tf

    def split(path):  # a bare name is in the working folder
        folder, _, name = str(path).rpartition("/")
        return folder or ".", name

    folders: dict[str, set] = {}
    for path in paths:
        folders.setdefault(split(path)[0], set())
    unlisted = set()
    for folder, names in folders.items():
        try:
            names.update(tf.io.gfile.listdir(folder))
        except tf.errors.NotFoundError:
            pass  # no such folder: every file in it is missing
        except tf.errors.OpError:
            unlisted.add(folder)  # e.g. a public bucket that allows reading, not listing
    missing = []
    for path in paths:
        folder, name = split(path)
        if folder not in unlisted and name not in folders[folder]:
            missing.append(path)
    return missing


def _valid(data):
    """``image_problem`` as a handful of TensorFlow ops, without control flow (each
    ``tf.cond`` costs a function call per image): True when the bytes look whole, by
    their content (a PNG named as a JPEG is a whole PNG). Binary separators in
    ``tf.strings.split`` find the end markers."""
    import tensorflow as tf

    n = tf.strings.length(data)
    head = tf.strings.substr(data, 0, 8)
    tail = tf.strings.substr(data, tf.maximum(n - 64, 0), 64)

    def has(marker: bytes, text):
        return tf.size(tf.strings.split(text, sep=marker)) > 1

    jpeg = (tf.strings.substr(head, 0, 3) == _JPEG) & has(b"\xff\xd9", tail)
    last16 = tf.strings.substr(tail, tf.maximum(tf.strings.length(tail) - 16, 0), 16)
    png = (head == _PNG) & has(b"IEND", last16)
    gif = (tf.strings.substr(head, 0, 6) == _OTHER[0]) | (
        tf.strings.substr(head, 0, 6) == _OTHER[1]
    )
    return jpeg | png | gif | (tf.strings.substr(head, 0, 2) == _OTHER[2])


# --- decoding ---------------------------------------------------------------------------
JPEG_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif")


def _all_jpeg(paths: Sequence[str]) -> bool:
    return bool(paths) and all(str(p).lower().endswith(JPEG_SUFFIXES) for p in paths)


#: A JPEG is decoded at 1/2, 1/4 or 1/8 of its size only while that still leaves this many
#: times the target size for the resize: libjpeg's scaled decode filters differently from
#: the processor's resize, and on detailed textures a decode that lands on the target
#: itself is 10-13 (of 255) per pixel away from it; with twice the target left, the
#: antialiased resize that follows sets the result (within about 1.2, measured).
REDUCED_DECODE_MARGIN = 2


def decode_scale(size, height: int, width: int):
    """The JPEG decode scale (1, 2, 4 or 8, int64 tensor) for an image of ``size``
    ``[height, width]``: the largest that leaves ``REDUCED_DECODE_MARGIN`` times the
    target ``height x width``. Chosen per image, so a data set of mixed sizes decodes each
    as far down as it can be without leaving the processor's result."""
    import tensorflow as tf

    size = tf.cast(size, tf.int64)
    scale = tf.constant(1, tf.int64)
    for s in (2, 4, 8):
        fits = (size[0] // s >= REDUCED_DECODE_MARGIN * height) & (
            size[1] // s >= REDUCED_DECODE_MARGIN * width
        )
        scale = tf.where(fits, tf.constant(s, tf.int64), scale)
    return scale


def _decode_reduced(data, height: int, width: int):
    """A JPEG decoded at its ``decode_scale`` (``tf.io.decode_jpeg`` takes the ratio as a
    constant, so one branch per ratio)."""
    import tensorflow as tf

    scale = decode_scale(tf.io.extract_jpeg_shape(data)[:2], height, width)
    branches = [lambda r=r: tf.io.decode_jpeg(data, 3, ratio=r) for r in (1, 2, 4, 8)]
    index = tf.gather(tf.constant([0, 0, 1, 0, 2, 0, 0, 0, 3], tf.int32), scale)  # log2
    return tf.switch_case(index, branches)


def _header_size(data, jpeg_only: bool):
    """``[height, width]`` (int64) from the header, as TensorFlow ops, before decoding."""
    import tensorflow as tf

    def jpeg():
        return tf.cast(tf.io.extract_jpeg_shape(data)[:2], tf.int64)

    if jpeg_only:
        return jpeg()
    raw = tf.io.decode_raw(tf.strings.substr(data, 0, 26), tf.uint8)
    b = tf.cast(tf.pad(raw, [[0, 26 - tf.size(raw)]]), tf.int64)

    def number(first, count, big_endian):
        places = range(count - 1, -1, -1) if big_endian else range(count)
        return sum(b[first + i] * (256**p) for i, p in zip(range(count), places, strict=True))

    head = tf.strings.substr(data, 0, 8)
    png = tf.stack([number(20, 4, True), number(16, 4, True)])
    gif = tf.stack([number(8, 2, False), number(6, 2, False)])
    bmp = tf.abs(tf.stack([number(22, 4, False), number(18, 4, False)]))
    bmp = tf.where(bmp >= 2**31, 2**32 - bmp, bmp)  # signed (a negative height is top-down)
    other = tf.where(head == _PNG, png, tf.where(tf.strings.substr(head, 0, 2) == b"BM", bmp, gif))
    return tf.cond(tf.strings.substr(head, 0, 3) == _JPEG, jpeg, lambda: other)


def _size_checks(data, path, max_pixels: int, jpeg_only: bool):
    """An assertion, naming ``path``, that the image is within ``max_pixels``."""
    import tensorflow as tf

    size = _header_size(data, jpeg_only=jpeg_only)
    # int32 and strings only in the message: then tf.debugging.Assert is one op, without
    # the tf.cond (a function call per image) it builds around other dtypes
    shown = tf.cast(tf.minimum(size, 2**31 - 1), tf.int32)
    return [
        tf.debugging.Assert(
            size[0] * size[1] <= max_pixels,
            [
                path,
                "claims height, width",
                shown,
                f"over {max_pixels:,} pixels. Fix: remove or shrink the file, or on_error='skip'.",
            ],
        )
    ]


def decode_image(data, spec: ImageSpec, reduced: bool = False, seed=None):
    """Decode image bytes to the RGB uint8 image of ``spec.height x spec.width`` that the
    processor ``spec`` came from would make.

    ``reduced=True``: the bytes are a JPEG, decoded at its ``decode_scale`` (libjpeg's DCT
    scaling: far less work for a large photo). Otherwise any of JPEG, PNG, GIF, BMP,
    decoded in full. Then, as the processor: the resize rule (to a size, or the shorter
    side to an edge keeping the aspect ratio), its filter with antialiasing as PIL does it,
    the center crop, the channel order; the result rounded to uint8 as PIL's is. With a
    stateless ``seed`` pair the decoded image is first randomly cropped and flipped
    (``crop_and_flip``), so augmenting costs no second resize.
    """
    import tensorflow as tf

    if reduced:
        image = _decode_reduced(data, *spec.decode_size)
    else:
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
    if seed is not None:
        image = crop_and_flip(image, seed)
    return resize_like_processor(image, spec)


def resize_like_processor(image, spec: ImageSpec, antialias: bool = True):
    """A decoded uint8 image ``[h, w, 3]`` resized, cropped and channel-ordered as the
    processor of ``spec`` does it; uint8 ``[spec.height, spec.width, 3]``."""
    import tensorflow as tf

    if spec.shortest_edge:
        # transformers' get_resize_output_image_size: the shorter side becomes the edge,
        # the longer one int(edge * long / short) (truncated)
        hw = tf.cast(tf.shape(image)[:2], tf.float64)
        short, long = tf.reduce_min(hw), tf.reduce_max(hw)
        edge = tf.constant(spec.shortest_edge, tf.float64)
        other = tf.floor(edge * long / short)
        size = tf.cast(tf.where(hw[0] <= hw[1], [edge, other], [other, edge]), tf.int32)
    else:
        size = spec.resize or (spec.height, spec.width)
    resized = tf.image.resize(image, size, method=spec.resample, antialias=antialias) + 0.5
    if spec.resample in ("bicubic", "lanczos3"):  # these overshoot; bilinear stays in 0-255
        resized = tf.clip_by_value(resized, 0.0, 255.0)
    resized = tf.cast(resized, tf.uint8)
    if spec.crop:  # transformers' center_crop: top = (h - crop_h) // 2, likewise left
        shape = tf.shape(resized)
        top, left = (shape[0] - spec.height) // 2, (shape[1] - spec.width) // 2
        resized = resized[top : top + spec.height, left : left + spec.width]
    if spec.flip_channels:
        resized = resized[..., ::-1]
    return tf.ensure_shape(resized, [spec.height, spec.width, 3])


def load_image(path: str, spec: ImageSpec | None = None):
    """One image file as a uint8 array (for showing samples), as ``spec`` sizes it."""
    import tensorflow as tf

    data = tf.io.read_file(path)
    if spec is None:
        return tf.io.decode_image(data, channels=3, expand_animations=False).numpy()
    return decode_image(data, spec).numpy()


def _to_uint8(image):
    """Round a resized float image to uint8 (bilinear resizes of uint8 images stay within
    0-255, so no clipping), keeping its static shape."""
    import tensorflow as tf

    return tf.ensure_shape(tf.cast(image + 0.5, tf.uint8), [*image.shape[:2], 3])


def _augmentation_seed(seed: int, epoch: int, position):
    """The stateless crop-and-flip seed of the image at ``position`` of ``epoch``."""
    from tpu_helpers.core.pipeline import STREAMS, seed_pair

    return seed_pair(seed, epoch, position, STREAMS["augment"])


def _batches(ds, spec: ImageSpec, batch_size: int):
    """``(uint8 image, label, weight)`` rows -> full batches of ``({"pixel_values"},
    labels, weights)``, normalized per batch, prefetched."""
    import tensorflow as tf

    def finish(image, label, weight):
        return {"pixel_values": normalize(image, spec)}, label, weight

    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(finish, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def _epoch_rows(n: int, batch_size: int, order, skip_steps: int):
    """``(rows, weights, positions)`` of an epoch from step ``skip_steps`` on: ``order``
    (a permutation of ``n``) completed to full batches with weight-0 copies of its first
    rows."""
    steps = -(-n // batch_size)
    fill = order[np.arange(steps * batch_size - n) % n]
    first = skip_steps * batch_size
    rows = np.concatenate([order, fill])[first:]
    weights = (np.arange(steps * batch_size) < n).astype(np.float32)[first:]
    return rows, weights, np.arange(first, steps * batch_size)


def crop_and_flip(image, seed):
    """A random crop of 80-100 % of each side and a random horizontal flip, from a
    stateless ``seed`` pair (so runs repeat and epochs differ); any image size."""
    import tensorflow as tf

    shape = tf.shape(image)
    side = tf.random.stateless_uniform([], seed + 1, 0.8, 1.0)
    crop = [  # at least one pixel: a 1x1 image stays an image
        tf.maximum(tf.cast(side * tf.cast(shape[0], tf.float32), tf.int32), 1),
        tf.maximum(tf.cast(side * tf.cast(shape[1], tf.float32), tf.int32), 1),
        3,
    ]
    image = tf.image.stateless_random_crop(image, crop, seed + 2)
    return tf.image.stateless_random_flip_left_right(image, seed)


def augment(image, seed):
    """``crop_and_flip`` a uint8 image and resize it back to its size (for images
    already decoded and resized, such as cached ones)."""
    import tensorflow as tf

    height, width = image.shape[0], image.shape[1]
    return _to_uint8(tf.image.resize(crop_and_flip(image, seed), [height, width]))


def normalize(images, spec: ImageSpec):
    """uint8 images ``[..., H, W, 3]`` -> float32 ``pixel_values`` ``[..., 3, H, W]``:
    channels first (moved while still uint8: a quarter of the bytes), then rescale and
    normalize with the processor's mean and std as one multiply-add. Applied to whole
    batches."""
    import tensorflow as tf

    images = tf.convert_to_tensor(images)  # a NumPy batch too
    rank = images.shape.rank
    images = tf.transpose(images, [*range(rank - 3), rank - 1, rank - 3, rank - 2])
    images = tf.cast(images, tf.float32)
    if not spec.do_normalize:
        return images * spec.rescale_factor
    scale = tf.constant([spec.rescale_factor / s for s in spec.std], shape=[3, 1, 1])
    shift = tf.constant([-m / s for m, s in zip(spec.mean, spec.std, strict=True)], shape=[3, 1, 1])
    return images * scale + shift


def pixels_of(pixel_values, spec: ImageSpec) -> np.ndarray:
    """``pixel_values`` ``[..., 3, H, W]`` (ours or a processor's) back in 0-255 pixel units,
    channels last: compare pipelines there, where the processor's std does not scale the
    difference (ImageNet's std makes one pixel look 2.2x larger than ViT's 0.5)."""
    x = np.moveaxis(np.asarray(pixel_values, np.float64), -3, -1)
    if spec.do_normalize:
        x = x * np.asarray(spec.std) + np.asarray(spec.mean)
    return x / spec.rescale_factor


# --- the pipeline -----------------------------------------------------------------------
def image_batches(
    paths: Sequence[str],
    labels: Sequence[int],
    spec: ImageSpec,
    *,
    global_batch: int,
    training: bool = False,
    seed: int = 0,
    cache: bool = False,
    on_error: str = "raise",
    reduced_decode: bool = True,
    max_pixels: int = MAX_PIXELS,
    num_labels: int | None = None,
    log=say,
):
    """The ``pipeline.Batches`` of image files: ``({"pixel_values": [B, 3, H, W]},
    labels, weights)``.

    Labels are checked before any file is read: missing, fractional or negative ones, and
    with ``num_labels`` (the model's) those it has no output for, are named with their row.

    ``training=True``: each epoch in the order of ``pipeline.rng(seed, epoch)`` and
    augmented (``augment``) with seeds of ``(seed, epoch, position)``, so a run resumed in
    the middle of an epoch sees the batches an uninterrupted one would (the files skipped
    are not read); fewer images than one batch are refused. ``training=False``: in order,
    not augmented. Either way the last batch is completed with copies weighted 0: every
    image counts once per epoch.

    When all files are JPEGs by name, each JPEG is decoded at the reduced scale its own
    size allows (``decode_scale``; ``reduced_decode=False`` turns it off); a file of
    another format so named is decoded in full. Before decoding, each image's header is
    read: more than ``max_pixels`` pixels stops the pipeline naming the file.

    ``cache=True`` keeps the decoded, resized images (uint8) in memory after the first
    epoch, before augmentation (the order then comes from a shuffle seeded by ``(seed,
    epoch)``). ``on_error="skip"`` checks every file first and leaves out the missing and
    broken ones, saying how many to ``log``; the default raises naming the file.
    """
    from tpu_helpers.core.pipeline import Batches

    paths, labels = _checked_files(
        paths, labels, global_batch, training, on_error, max_pixels, num_labels, log
    )
    load = _loader(spec, reduced_decode and _all_jpeg(paths), max_pixels)
    epochs = _ImageEpochs(np.asarray(paths), labels, load, spec, global_batch, training, seed)
    if cache:  # built once: every epoch's dataset reads the same cache
        epochs = dataclasses.replace(epochs, cached=epochs.decoded())
    return Batches(
        epochs.build,
        -(-len(paths) // global_batch),
        global_batch,
        examples=len(paths),
        max_label=int(np.max(labels)) if len(labels) else None,
        name=f"{'training' if training else 'evaluation'} images",
    )


@dataclass(frozen=True, eq=False)
class _ImageEpochs:
    """The epochs of ``image_batches``: from the files, or from the cache of their decoded
    images (``cached``), shuffled and augmented by ``(seed, epoch)``."""

    paths: np.ndarray
    labels: np.ndarray
    load: object
    spec: ImageSpec
    global_batch: int
    training: bool
    seed: int
    cached: object = None

    def decoded(self):
        import tensorflow as tf

        weights = np.ones(len(self.paths), np.float32)
        files = tf.data.Dataset.from_tensor_slices((self.paths, self.labels, weights))
        return files.map(self.load, num_parallel_calls=tf.data.AUTOTUNE).cache()

    def build(self, epoch: int, skip_steps: int, input_context):
        ds = (
            self._from_cache(epoch, skip_steps)
            if self.cached
            else self._from_files(epoch, skip_steps)
        )
        return _batches(ds, self.spec, self.global_batch)

    def _from_files(self, epoch, skip_steps):
        import tensorflow as tf

        from tpu_helpers.core.pipeline import STREAMS, rng

        n = len(self.paths)
        order = rng(self.seed, epoch, STREAMS["order"]).permutation(n)
        rows, weights, positions = _epoch_rows(
            n, self.global_batch, order if self.training else np.arange(n), skip_steps
        )
        ds = tf.data.Dataset.from_tensor_slices(
            (self.paths[rows], self.labels[rows], weights, positions)
        )

        def load(path, label, weight, position):  # crop and flip before the one resize
            seed = _augmentation_seed(self.seed, epoch, position) if self.training else None
            return self.load(path, label, weight, seed=seed)

        return ds.map(load, num_parallel_calls=tf.data.AUTOTUNE)

    def _from_cache(self, epoch, skip_steps):
        import tensorflow as tf

        from tpu_helpers.core.pipeline import seed_pair, seeded_shuffle

        n, ds = len(self.paths), self.cached
        if self.training:
            ds = seeded_shuffle(ds, n, seed_pair(self.seed, tf.constant(epoch, tf.int64), 0))
        pad = -(-n // self.global_batch) * self.global_batch - n
        fillers = self.cached.repeat().take(pad).map(lambda x, y, w: (x, y, tf.zeros_like(w)))
        ds = ds.concatenate(fillers)
        if not self.training:
            return ds.skip(skip_steps * self.global_batch)
        ds = tf.data.Dataset.zip((ds, tf.data.Dataset.range(n + pad)))

        def augmented(item, position):
            return augment(item[0], _augmentation_seed(self.seed, epoch, position)), *item[1:]

        ds = ds.skip(skip_steps * self.global_batch)
        return ds.map(augmented, num_parallel_calls=tf.data.AUTOTUNE)


def _checked_files(paths, labels, global_batch, training, on_error, max_pixels, num_labels, log):
    """The arguments checked, and the files that can be read (see ``on_error``):
    ``(paths, labels)``."""
    if on_error not in ("raise", "skip"):
        raise InputError(f"on_error={on_error!r}: use 'raise' or 'skip'.")
    check_positive(global_batch=global_batch)
    paths = [str(p) for p in paths]
    labels = check_labels(labels, num_labels, "labels").astype(np.int32)
    if len(paths) != len(labels):
        raise InputError(f"{len(paths)} paths but {len(labels)} labels.")
    paths, labels = _usable_files(paths, labels, on_error, max_pixels, log)
    if not paths or (training and len(paths) < global_batch):
        raise InputError(
            f"{len(paths)} images make no full training batch of {global_batch} (one step needs"
            " a full batch on every replica). Fix: a smaller per-replica batch, or more images."
        )
    return paths, labels


def _usable_files(paths: list[str], labels: np.ndarray, on_error: str, max_pixels: int, log):
    """``(paths, labels)``: with ``on_error="raise"`` all of them, after checking that the
    files exist; with ``"skip"`` those that are complete images, the others logged."""
    if on_error == "raise":
        missing = missing_files(paths)
        if missing:
            raise MissingFileError(
                f"{len(missing)} of {len(paths)} image files do not exist, e.g. {missing[:3]}."
                " Fix: check the base path (rebase_paths), or on_error='skip'."
            )
        return paths, labels
    problems = scan_images(paths, max_pixels)
    if not problems:
        return paths, labels
    listed = "\n  ".join(f"{p}: {why}" for p, why in list(problems.items())[:10])
    log(f"images: skipped {len(problems)} of {len(paths)} files:\n  {listed}")
    keep = [i for i, p in enumerate(paths) if p not in problems]
    return [paths[i] for i in keep], labels[keep]


def _loader(spec: ImageSpec, jpeg: bool, max_pixels: int):
    """``load(path, label, weight, seed=None)``: the file read, checked (complete, not
    over ``max_pixels``) and decoded to ``spec`` (augmented with a seed). ``jpeg``: the
    names say JPEG, so JPEGs take the reduced decode (a file of another format so named
    is decoded in full all the same)."""
    import tensorflow as tf

    broken = "Fix: replace the file, or on_error='skip'."
    kind = "Not a complete JPEG/PNG/GIF/BMP image:"

    def decoded(data, path, seed, as_jpeg: bool):
        with tf.control_dependencies(_size_checks(data, path, max_pixels, jpeg_only=as_jpeg)):
            return decode_image(data, spec, as_jpeg, seed)

    def load(path, label, weight, seed=None):
        data = tf.io.read_file(path)
        check = tf.debugging.Assert(_valid(data), [kind, path, broken])
        with tf.control_dependencies([check]):
            if not jpeg:
                return decoded(data, path, seed, False), label, weight
            # one branch per image: the JPEG fast path, or a full decode of a file of
            # another format that is named as a JPEG
            image = tf.cond(
                tf.strings.substr(data, 0, 3) == _JPEG,
                lambda: decoded(data, path, seed, True),
                lambda: decoded(data, path, seed, False),
            )
        return image, label, weight

    return load


# --- images as TFRecords ----------------------------------------------------------------
def write_image_records(
    paths: Sequence[str], labels: Sequence[int], output_dir: str, split: str = "train", **kwargs
) -> dict:
    """Store the encoded image files (not decoded pixels) and labels as TFRecord shards,
    for data sets of many small files; decoding and augmentation stay in the reader, so
    every epoch still sees new augmentations. Keyword arguments go to
    ``records.write_records``."""
    import tensorflow as tf

    from tpu_helpers.data.records import write_records

    def rows():
        for path, label in zip(paths, labels, strict=True):
            with tf.io.gfile.GFile(str(path), "rb") as f:
                yield {"image": f.read(), "label": int(label), "name": str(path).rsplit("/", 1)[-1]}

    kwargs.setdefault("source", {"images": len(paths)})
    return write_records(rows(), output_dir, split=split, total=len(paths), **kwargs)


def _enough_records(n: int, source: str, global_batch: int, training: bool) -> int:
    """``n``, or the refusal of record files that make no batch (no full one to train)."""
    if not n or (training and n < global_batch):
        raise InputError(
            f"{source} holds {n} image record(s), which make no full training batch of"
            f" {global_batch} (one step needs a full batch on every replica). Fix: a smaller"
            " per-replica batch, or more images."
        )
    return n


def _record_loader(spec: ImageSpec, source: str, seed: int, training: bool, max_pixels: int):
    """``load(record, weight, position, epoch)``: an image record parsed, its image checked
    (complete, not over ``max_pixels``) and decoded to ``spec`` (augmented from ``(seed,
    epoch, position)`` when ``training``), with its label and ``weight``."""
    import tensorflow as tf

    features = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    where = f"an image record of {source}"

    def load(record, weight, position, epoch):
        ex = tf.io.parse_single_example(record, features)
        checks = _size_checks(ex["image"], tf.constant(where), max_pixels, jpeg_only=False)
        augment_seed = _augmentation_seed(seed, epoch, position) if training else None
        with tf.control_dependencies(checks):
            image = decode_image(ex["image"], spec, seed=augment_seed)
        return image, tf.cast(ex["label"], tf.int32), weight

    return load


def _epoch_records(opened, epoch: int, training: bool, seed: int, shuffle_buffer: int):
    """The records of ``opened`` shards for ``epoch``, each shard's count checked: in shard
    order, or with ``training`` the shard order and a buffer of ``shuffle_buffer`` records
    shuffled from ``(seed, epoch)``."""
    import tensorflow as tf

    from tpu_helpers.core.pipeline import seed_pair, seeded_shuffle
    from tpu_helpers.data.records.read import checked_records

    files = [s.path for s in opened.shards]
    order = tf.range(len(files))
    if training:
        at = tf.constant(epoch, tf.int64)
        order = tf.random.experimental.stateless_shuffle(order, seed_pair(seed, at, 0))
    counts = tf.constant([s.num_records for s in opened.shards], tf.int64)
    ds = checked_records(
        tf.gather(files, order), tf.gather(counts, order), opened.compression or ""
    )
    if training:
        ds = seeded_shuffle(ds, shuffle_buffer, seed_pair(seed, at, 1))
    return ds


def image_record_batches(
    source: str,
    spec: ImageSpec,
    *,
    global_batch: int,
    training: bool = False,
    seed: int = 0,
    max_pixels: int = MAX_PIXELS,
    shuffle_buffer: int = 2048,
):
    """The ``pipeline.Batches`` of ``write_image_records`` shards, as ``image_batches``
    makes them from files: ``({"pixel_values"}, labels, weights)``, the last batch
    completed with weight-0 copies. ``training=True``: the shard order and a buffer of
    ``shuffle_buffer`` records shuffled, and the images augmented, from ``(seed, epoch)``
    alone, so a resumed epoch has the batches of an uninterrupted one; fewer records than
    one batch are refused."""
    import tensorflow as tf

    from tpu_helpers.core.pipeline import Batches
    from tpu_helpers.data.records import open_records
    from tpu_helpers.data.records.read import with_counts

    check_positive(global_batch=global_batch)
    opened = with_counts(open_records(source))
    n = _enough_records(opened.num_records, source, global_batch, training)
    files = [s.path for s in opened.shards]
    compression = opened.compression or ""
    steps = -(-n // global_batch)
    load = _record_loader(spec, source, seed, training, max_pixels)

    def build(epoch, skip_steps, input_context):
        ds = _epoch_records(opened, epoch, training, seed, shuffle_buffer)
        real = ds.map(lambda r: (r, tf.constant(1.0)))
        fillers = tf.data.TFRecordDataset(files[0], compression_type=compression).repeat()
        fillers = fillers.take(steps * global_batch - n).map(lambda r: (r, tf.constant(0.0)))
        ds = tf.data.Dataset.zip(
            (real.concatenate(fillers), tf.data.Dataset.range(steps * global_batch))
        )
        ds = ds.skip(skip_steps * global_batch).map(
            lambda item, i: load(*item, i, epoch), num_parallel_calls=tf.data.AUTOTUNE
        )
        return _batches(ds, spec, global_batch)

    return Batches(
        build,
        steps,
        global_batch,
        examples=n,
        name=f"{'training' if training else 'evaluation'} image records of {source}",
    )
