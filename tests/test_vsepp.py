"""VSE++'s image side: the masked mean of the feature vectors, or the centre crop of a ten-crop set."""
from __future__ import annotations

import pytest
import torch

from retr.store.features import TENCROP_ORDER
from retr.trainers.models import create_model
from retr.trainers.models.layers import l2norm


def test_centre_crop_is_row_four_of_ten_and_mean_is_the_masked_mean():
    torch.manual_seed(0)
    features, mask = torch.randn(3, 10, 12), torch.ones(3, 10, dtype=torch.bool)
    centre = create_model("vsepp", vocab_size=20, img_dim=12, embed_size=8, crops="centre").eval()
    fc = centre.img_enc.fc
    expected = l2norm(fc(features[:, TENCROP_ORDER.index("centre")]))
    torch.testing.assert_close(centre.encode_images(features, mask)["vector"], expected)
    assert TENCROP_ORDER.index("centre") == 4
    mean = create_model("vsepp", vocab_size=20, img_dim=12, embed_size=8).eval()
    mean.load_state_dict(centre.state_dict())
    torch.testing.assert_close(mean.encode_images(features, mask)["vector"], l2norm(fc(features.mean(1))))
    with pytest.raises(ValueError, match="ten-crop"):
        centre.encode_images(torch.randn(2, 36, 12), torch.ones(2, 36, dtype=torch.bool))
