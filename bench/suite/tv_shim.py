"""Lets torchvision's Python half import where its C++ half cannot load.

PyPI's Linux torchvision wheels are CUDA builds: next to a CPU-only torch their ``_C``
library fails to load, and ``torchvision/_meta_registrations.py`` then raises at import
because the ``torchvision::`` ops it registers fake kernels for were never defined. timm
imports ``torchvision.ops`` at import time, so without torchvision it cannot be used at all.

``ensure_torchvision()`` defines the schemas of those ops (with no kernel) before
torchvision is imported, only when its ``_C`` cannot load. Models that call the ops
(detection's NMS and RoIAlign) then fail when run, loudly; every other model (classifiers,
segmentation, timm) runs on torchvision's and timm's pure-Python code. On a host whose
torchvision loads, this does nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The schemas of torchvision's C++ ops (torchvision/csrc/ops/*.cpp, TORCH_LIBRARY_FRAGMENT).
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
    "float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
    "float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, "
    "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
    "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
    "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, "
    "bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_LIBRARIES: list[object] = []  # a Library unregisters its ops when collected


def native_ops_load() -> bool:
    """Whether torchvision's ``_C`` library loads next to this torch."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        for lib in Path(folder).glob("_C*.so"):
            try:
                torch.ops.load_library(str(lib))
                return True
            except (OSError, RuntimeError):
                return False
    return False


def ensure_torchvision() -> bool:
    """Make ``import torchvision`` work; True if its native ops run, False if only its
    Python half does (see the module docstring). Raises ImportError with no torchvision."""
    import sys

    import torch

    if "torchvision" not in sys.modules and not native_ops_load() and not _LIBRARIES:
        lib = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            lib.define(schema)
        _LIBRARIES.append(lib)
    import torchvision  # noqa: F401

    return not _LIBRARIES
