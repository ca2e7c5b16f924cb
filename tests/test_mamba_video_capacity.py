"""A video Mamba DiT's residual stream must be as wide as a patch.

``videomamba-tiny-shapes`` (first shipping) plateaued at flow loss ~0.55: ``videomamba-tiny`` had
width 32 while a patch of the video trainer's latents holds 48 values (12 pixel-unshuffled
channels × 1·2·2), so its final layer could reach only a 32-dim subspace of each output patch —
a third of the (isotropic) noise in the target velocity was out of reach whatever the weights.
"""

from __future__ import annotations

import pytest
import torch

from dspzoo.domains.mamba import VIDEO_CONFIGS, VideoMamba, VideoMambaConfig
from dspzoo.zoo import create_model

#: What the video trainer gives a model on its built-in data: 3 colours × 2×2 pixel-unshuffle.
TRAINER_CHANNELS = 12


def _output_rank(model: VideoMamba, seed: int = 0) -> int:
    """Rank of the output tokens ``[N, out_patch_dim]`` of ``model`` with every weight random
    (zero-initialised gates and final layer included): how many directions of a patch the model
    can predict at all."""
    gen = torch.Generator().manual_seed(seed)
    model = model.double()  # float64 throughout: float32 rounding would look like extra rank
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
        c = model.config
        x = torch.randn(2, c.in_channels, 2, 8, 8, generator=gen, dtype=torch.float64)
        t = torch.tensor([100.0, 700.0], dtype=torch.float64)
        tokens = model.patchify(model(x, t, y=torch.tensor([0, 1])))
    return int(torch.linalg.matrix_rank(tokens.reshape(-1, tokens.shape[-1])))


@pytest.mark.parametrize("name", sorted(VIDEO_CONFIGS))
def test_video_mamba_predicts_every_value_of_a_patch(name):
    model = create_model(
        f"videomamba-{name}", in_channels=TRAINER_CHANNELS, num_classes=4, input_size=(8, 8)
    )
    assert _output_rank(model) == model.out_patch_dim == TRAINER_CHANNELS * 4


@pytest.mark.parametrize("learn_sigma", [False, True])
def test_a_residual_stream_narrower_than_a_patch_is_refused(learn_sigma):
    # 12 channels × 1·2·2 = 48 values per patch (96 out with learn_sigma) through width 32
    narrow = VideoMambaConfig(in_channels=12, hidden=32, learn_sigma=learn_sigma)
    with pytest.raises(ValueError, match=r"hidden 32 .* 48 .*patch \(1, 2, 2\)"):
        VideoMamba(narrow)
    wide_enough = 96 if learn_sigma else 48
    model = VideoMamba(
        VideoMambaConfig(in_channels=12, hidden=wide_enough, learn_sigma=learn_sigma)
    )
    assert model.config.hidden >= model.out_patch_dim >= model.patch_dim
