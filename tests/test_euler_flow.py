"""The video samplers' one Euler loop (:func:`dspzoo.domains.video.sampling.euler_flow`): its
steps and guidance against closed forms, and the video Mamba DiT's sampler on it equal to the
loop it ran before (written out here), bit for bit."""

from __future__ import annotations

import torch

import dspzoo.domains.mamba  # noqa: F401  (registers the family)
from dspzoo.core import SeqParallel
from dspzoo.domains.mamba.sampling import sample_video
from dspzoo.domains.video.diffusion import TIMESTEP_SCALE
from dspzoo.domains.video.sampling import euler_flow
from dspzoo.zoo import create_model


def test_euler_steps_of_a_linear_flow() -> None:
    """``v = −x`` from t = 1 to 0 in ``n`` steps of ``dt = −1/n``: ``x·(1 + 1/n)^n``; the
    velocity sees ``t = 1, 1 − 1/n, …``."""
    x = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    seen: list[float] = []

    def velocity(state: torch.Tensor, t: float) -> torch.Tensor:
        seen.append(t)
        return -state

    out = euler_flow(x, velocity, 4, progress=False)
    torch.testing.assert_close(out, x * (1 + 1 / 4) ** 4, rtol=1e-12, atol=0)
    assert seen == [1.0, 0.75, 0.5, 0.25]


def test_guidance_combines_the_doubled_batch() -> None:
    """With guidance the velocity gets ``[x; x]`` and the step takes ``u + g·(c − u)``."""
    x = torch.ones(2, 3, dtype=torch.float64)
    cond, uncond = torch.full((2, 3), 2.0), torch.full((2, 3), -1.0)

    def velocity(state: torch.Tensor, t: float) -> torch.Tensor:
        assert state.shape == (4, 3) and torch.equal(state[:2], state[2:])
        return torch.cat([cond, uncond]).to(state)

    out = euler_flow(x, velocity, 1, guidance=3.0, use_cfg=True, progress=False)
    torch.testing.assert_close(out, x - (uncond + 3.0 * (cond - uncond)).double())


def _old_mamba_loop(model, shape, steps, labels, guidance, seed) -> torch.Tensor:
    """The loop ``domains/mamba/sampling.py`` ran before it took the video domain's."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    null = torch.full_like(labels, model.config.num_classes)
    labels_in = torch.cat([labels, null])
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        t, dt = float(ts[i]), float(ts[i + 1] - ts[i])
        x_in = torch.cat([x, x])
        tvec = torch.full((x_in.shape[0],), t * TIMESTEP_SCALE)
        v = model(x_in, tvec, labels_in, sp=SeqParallel())[:, : shape[1]]
        v_cond, v_uncond = v.float().chunk(2)
        x = x + dt * (v_uncond + guidance * (v_cond - v_uncond)).float()
    return x


@torch.no_grad()
def test_the_mamba_sampler_on_the_shared_loop_is_its_old_loop() -> None:
    torch.manual_seed(0)
    model = create_model("videomamba-tiny", num_classes=3, hidden=96, learn_sigma=True).eval()
    for p in model.parameters():  # leave adaLN-Zero's identity start
        p.add_(torch.randn_like(p) * 0.05)
    shape, labels = (2, 12, 2, 4, 4), torch.tensor([0, 2])
    got = sample_video(
        model, SeqParallel(), shape, steps=3, labels=labels, guidance=2.5, seed=7, progress=False
    ).latents
    assert torch.equal(got, _old_mamba_loop(model, shape, 3, labels, 2.5, 7))
