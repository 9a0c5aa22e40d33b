"""Bottom-up-attention region extractor: the Caffe ResNet-101 C4 Faster R-CNN of Anderson et al. (2018).

Written on torchvision's detection operators (``roi_pool``, ``nms``, ``FrozenBatchNorm2d``) so that it runs on
CPU and CUDA without detectron2, reproduces the original Caffe arithmetic (see ``docs/butd.md``) and loads the
converted checkpoints users have (MILVLG ``.pth``, airsplay ``.pkl``).

Modules, in the order data flows through them: :mod:`preprocess` (Caffe BGR/mean/scale), :mod:`backbone`
(ResNet-101 C4), :mod:`anchors` + :mod:`boxes` + :mod:`rpn` (proposals), :mod:`heads` (ROI pool, dilated res5,
classifier, attributes), :mod:`selection` (generate_tsv's box choice), :mod:`batching` (several images per
forward, exactly), :mod:`model` (the whole detector), :mod:`checkpoint`, :mod:`vocab`, :mod:`extractor` (the
registered ``butd-regions`` extractor).
"""
