"""Imports every extractor module so that each registers itself (one line per module)."""
import retr.extractors.butd.extractor  # noqa: E402,F401  butd-regions
import retr.extractors.clip  # noqa: E402,F401  clip-vit-b-32, clip-vit-b-16, clip-vit-l-14, clip-vit-l-14-336
import retr.extractors.resnet_grid  # noqa: E402,F401  resnet152-grid
import retr.extractors.tencrop  # noqa: E402,F401  tencrop-vgg19, tencrop-resnet152, tencrop-irv2
import retr.extractors.vgg_maps  # noqa: E402,F401  vgg16-maps
