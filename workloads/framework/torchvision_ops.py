"""Stand-ins for torchvision's compiled operators, where PyPI's torchvision (a CUDA build on x86_64) cannot load
them beside a CPU torch of the same release: declaring the two operators its import registers fake kernels for lets
its Python code (and timm's, and transformers') import; calling them still fails, and membench never does."""

from __future__ import annotations

import torch


def torchvision_stand_ins() -> torch.library.Library:
    """The library declaring `torchvision::nms` and `torchvision::qnms`; the caller keeps it alive (a Library's
    definitions die with it)."""
    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return library
