"""Bottom-up-attention region extractor: the Caffe ResNet-101 C4 Faster R-CNN of Anderson et al. (2018) on
torchvision's operators, without detectron2 (docs/butd.md)."""
