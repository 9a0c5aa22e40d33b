"""The region head: ROI pooling, dilated res5, mean-pooled 2048-d features, classifier and attribute head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import roi_pool

from retr.extractors.butd.backbone import RESNET101_BLOCKS, make_stage

NUM_OBJECT_CLASSES = 1601      # index 0 = background, 1..1600 = Visual Genome objects
NUM_ATTRIBUTE_CLASSES = 401    # index 0 = no attribute, 1..400 = Visual Genome attributes
FEATURE_DIM = 2048


class BoxPredictor(nn.Module):
    """Classifier, (unused) box regression and attribute head on the pooled features.

    ``cls_score`` Linear(2048→1601) + softmax; ``bbox_pred`` Linear(2048→6404) (kept so checkpoints load; the
    released boxes are proposals, not regressed boxes); attributes: class = argmax over all 1601 scores (background
    included) → ``cls_embed`` Embedding(1601→256) → concat after the feature → ``attr_linear1`` (2304→512) → ReLU →
    ``attr_linear2`` (512→401) → softmax."""

    def __init__(self, in_features: int = FEATURE_DIM, num_classes: int = NUM_OBJECT_CLASSES,
                 num_attributes: int = NUM_ATTRIBUTE_CLASSES, embed_dim: int = 256, hidden_dim: int = 512):
        super().__init__()
        self.cls_score = nn.Linear(in_features, num_classes)
        self.bbox_pred = nn.Linear(in_features, 4 * num_classes)
        self.cls_embed = nn.Embedding(num_classes, embed_dim)
        self.attr_linear1 = nn.Linear(in_features + embed_dim, hidden_dim)
        self.attr_linear2 = nn.Linear(hidden_dim, num_attributes)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, 2048]`` → (class probabilities ``[R, 1601]``, attribute probabilities ``[R, 401]``)."""
        logits = self.cls_score(features)
        classes = logits.argmax(dim=1)
        hidden = F.relu(self.attr_linear1(torch.cat([features, self.cls_embed(classes)], dim=1)))
        return torch.softmax(logits, dim=1), torch.softmax(self.attr_linear2(hidden), dim=1)


class RegionHead(nn.Module):
    """ROI-pool proposals from res4, run res5 (stride 1, dilation 2) and classify.

    Args:
        pooled_size: ROI pool output side (14 in the original; smaller is a documented speed option).
        roi_chunk: proposals run through res5 at once (bounds memory; does not change results).
    """

    def __init__(self, pooled_size: int = 14, roi_chunk: int = 100):
        super().__init__()
        self.pooled_size, self.roi_chunk = pooled_size, roi_chunk
        self.res5 = make_stage(RESNET101_BLOCKS["res5"], 1024, 512, 2048, first_stride=1, dilation=2)
        self.box_predictor = BoxPredictor()

    def pooled_features(self, res4: torch.Tensor, proposals: torch.Tensor, image_index: int = 0) -> torch.Tensor:
        """Mean over space of res5 on ``roi_pool(res4, proposals, 14×14, 1/16)``: ``[P, 4]`` → ``[P, 2048]``.

        ``res4`` is ``[B, 1024, h, w]``; the proposals are image ``image_index``'s (a padded batch's res4 is zero
        outside each image, which leaves its ROI maxima unchanged: see :mod:`…butd.batching`)."""
        rois = torch.cat([proposals.new_full((len(proposals), 1), float(image_index)),
                          proposals.to(res4.dtype)], dim=1)
        out = []
        for start in range(0, len(rois), self.roi_chunk):
            pooled = roi_pool(res4, rois[start:start + self.roi_chunk], self.pooled_size, 1.0 / 16)
            out.append(self.res5(pooled).mean(dim=(2, 3)))
        return torch.cat(out) if out else res4.new_zeros(0, FEATURE_DIM)

    def forward(self, res4: torch.Tensor, proposals: torch.Tensor, image_index: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features ``[P, 2048]``, class probabilities ``[P, 1601]``, attribute probabilities ``[P, 401]``).

        One image's proposals (``image_index`` of a batch ``res4``), in chunks of ``roi_chunk`` as for an image
        alone, so that res5 and the classifier see the one-image shapes."""
        features = self.pooled_features(res4, proposals, image_index)
        cls_prob, attr_prob = self.box_predictor(features)
        return features, cls_prob, attr_prob
