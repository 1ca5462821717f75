"""A small GAN of Cherenkov ring images: the example of training several
networks with several optimizers (``configs/rings/gan.py``, GANTrainer).

The model holds the two networks as the submodules the optimizer config
names, ``gen`` and ``disc``, and computes each one's loss on request::

    model(batch, part="disc")  # D loss on real vs generated (G under no_grad)
    model(batch, part="gen")   # G loss: the non-saturating -log D(G(z))
    model(batch)               # evaluation: generated images and D's logits on both

The loss is the standard non-saturating GAN loss (Goodfellow et al. 2014,
written with softplus for stability). The generator is DCGAN-like (linear
projection, then stride-2 transposed conv + BatchNorm + ReLU stages); its last
activation is a ReLU, so images are non-negative and may be exactly zero
like the mostly empty real ones (``log1p`` of the charge), followed by a soft
ceiling (``max_value``). The
discriminator is strided convs with LeakyReLU and no normalisation, so
real and generated batches never share batch statistics. Latent vectors are
drawn from torch's global generator, which the trainer checkpoints, so a
resumed run draws the same noise as an uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import UserError
from pimm.utils.domains import Int, Key, Positive, Seq, Size

__all__ = ["RingGAN", "RingGenerator", "RingDiscriminator"]


def _stages(image_size: tuple[int, int], depth: int) -> tuple[int, int]:
    height, width = (int(s) for s in image_size)
    if height % 2 ** depth or width % 2 ** depth:
        raise UserError(f"RingGAN: image_size {tuple(image_size)} must be divisible by 2**depth = {2 ** depth}")
    return height // 2 ** depth, width // 2 ** depth


class RingGenerator(nn.Module):
    """Latent ``(B, latent_dim)`` -> image ``(B, channels, H, W)`` in ``[0, max_value)``."""

    def __init__(self, latent_dim: int, image_size: tuple[int, int], channels: int, width: int, depth: int,
                 max_value: float = 6.0):
        super().__init__()
        self.latent_dim = latent_dim
        self.base = _stages(image_size, depth)
        top = width * 2 ** (depth - 1)
        self.project = nn.Sequential(nn.Linear(latent_dim, top * self.base[0] * self.base[1]),
                                     nn.BatchNorm1d(top * self.base[0] * self.base[1]), nn.ReLU())
        self.top = top
        layers = []
        ch = top
        for _ in range(depth):
            out = max(width // 2, ch // 2)
            layers += [nn.ConvTranspose2d(ch, out, 4, stride=2, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU()]
            ch = out
        layers += [nn.Conv2d(ch, channels, 3, padding=1), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.max_value = float(max_value)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.body(self.project(z).view(z.shape[0], self.top, *self.base))
        # Zero stays zero; large values saturate smoothly at max_value (an unbounded
        # log-charge would let a few pixels carry an absurd charge).
        return self.max_value * torch.tanh(x / self.max_value)


class RingDiscriminator(nn.Module):
    """Image ``(B, channels, H, W)`` -> one logit per image (real > 0)."""

    def __init__(self, image_size: tuple[int, int], channels: int, width: int, depth: int):
        super().__init__()
        base = _stages(image_size, depth)
        layers, ch = [], channels
        for i in range(depth):
            out = width * 2 ** i
            layers += [nn.Conv2d(ch, out, 4, stride=2, padding=1), nn.LeakyReLU(0.2)]
            ch = out
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(ch * base[0] * base[1], 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(img).flatten(1)).squeeze(1)


@MODELS.register_module()
class RingGAN(nn.Module):
    """Generator ``gen`` against discriminator ``disc`` on ring images.

    Args:
        image_size: ``(H, W)`` of the data set's images.
        channels: image channels (1: the charge; use ``with_time=False`` on the data set).
        latent_dim: size of the generator's noise vector.
        width: channels of the discriminator's first stage (doubling per stage);
            the generator mirrors it.
        depth: up/down-sampling stages (H and W must be divisible by ``2**depth``).
        max_value: the generator's output saturates (tanh) at this value; real
            ``log1p`` charge images of ``CherenkovRingDataset`` peak around 5.6.
        image_key: the batch key of the real images.
    """

    domains = dict(image_size=Seq(Int(4, 4096), length=2), channels=Int(1, 64), latent_dim=Size, width=Size,
                   depth=Int(1, 16), max_value=Positive, image_key=Key)

    def __init__(self, image_size=(32, 64), channels: int = 1, latent_dim: int = 32, width: int = 16,
                 depth: int = 3, max_value: float = 6.0, image_key: str = "img"):
        super().__init__()
        self.latent_dim, self.image_key = int(latent_dim), image_key
        if isinstance(max_value, bool) or not isinstance(max_value, (int, float)) or not max_value > 0:
            raise UserError(f"RingGAN: max_value must be a positive number, got {max_value!r}")
        self.gen = RingGenerator(self.latent_dim, image_size, channels, width, depth, max_value)
        self.disc = RingDiscriminator(image_size, channels, width, depth)

    def sample(self, n: int, device=None) -> torch.Tensor:
        """``n`` generated images (noise from torch's global generator)."""
        device = device if device is not None else next(self.parameters()).device
        return self.gen(torch.randn(n, self.latent_dim, device=device))

    def forward(self, input_dict: dict, part: str | None = None) -> dict:
        real = input_dict.get(self.image_key)
        if not isinstance(real, torch.Tensor) or real.dim() != 4:
            raise UserError(f"RingGAN needs {self.image_key!r} images (B, C, H, W) in the batch, "
                            f"got keys {sorted(input_dict)}")
        if part == "disc":
            with torch.no_grad():
                fake = self.sample(real.shape[0], real.device)
            logits_real, logits_fake = self.disc(real), self.disc(fake)
            loss = F.softplus(-logits_real).mean() + F.softplus(logits_fake).mean()
            acc = ((logits_real > 0).float().mean() + (logits_fake < 0).float().mean()) / 2
            return dict(loss=loss, disc_acc=acc.detach(), d_real=torch.sigmoid(logits_real).mean().detach(),
                        d_fake=torch.sigmoid(logits_fake).mean().detach())
        if part == "gen":
            logits_fake = self.disc(self.sample(real.shape[0], real.device))
            return dict(loss=F.softplus(-logits_fake).mean())
        if part is not None:
            raise UserError(f"RingGAN has parts 'gen' and 'disc', not {part!r}")
        fake = self.sample(real.shape[0], real.device)
        return dict(fake=fake, logits_real=self.disc(real), logits_fake=self.disc(fake))
