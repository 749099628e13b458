"""The 1-D convolutional autoencoder of LGC (Abrahamyan et al., TNNLS, Sec. IV-C, Tables I and
II, with this library's choices where the tables leave gaps).

The encoder downsamples by 16 into 4 channels, so an input of length L (a multiple of 16)
becomes a latent of 4 x L/16 = L/4 values. The decoder upsamples back to L; its first
transposed convolution has stride 1 (the paper's Table II would upsample by 32). In the
parameter-server form (`innovation=True`) the innovation vector is concatenated as a 33rd
channel before the last layer, whose weight on it starts at 1 (a pass-through) and bias at 0;
its other weights keep PyTorch's initialisation, so the reconstruction loss reaches the
encoder from the first step (with them at zero the similarity loss alone would collapse the
codes to a constant before the decoder learns to read them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

DOWNSAMPLING = 16  # the encoder's four stride-2 convolutions
LATENT_CHANNELS = 4


def padded_length(mu: int) -> int:
    """mu_pad = 16 * ceil(mu / 16): the autoencoder's input length for a top-k vector of mu."""
    return DOWNSAMPLING * math.ceil(mu / DOWNSAMPLING)


def pad(vectors: torch.Tensor, length: int) -> torch.Tensor:
    """(B, mu) -> (B, 1, length), zero-padded at the end."""
    return nn.functional.pad(vectors, (0, length - vectors.shape[-1])).unsqueeze(1)


class Encoder(nn.Module):
    """Table I: conv1-conv4 (kernel 3, stride 2, padding 1; 1->64->128->256->64 channels),
    conv5 (kernel 1; 64->4). LeakyReLU after every layer but conv5. 172,996 parameters."""

    def __init__(self, leaky_slope: float = 0.01) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for c_in, c_out in ((1, 64), (64, 128), (128, 256), (256, 64)):
            layers += [nn.Conv1d(c_in, c_out, 3, stride=2, padding=1), nn.LeakyReLU(leaky_slope)]
        layers.append(nn.Conv1d(64, LATENT_CHANNELS, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, L) -> (B, 4, L/16)."""
        return self.net(x)


class Decoder(nn.Module):
    """Table II: deconv1 (4->4, stride 1), deconv2-deconv5 (kernel 3, stride 2, padding 1,
    output padding 1; 4->32->64->128->32 channels), LeakyReLU after each, then the linear
    1x1 convolution `out` (32->1, or 33->1 with the innovation channel). 43,733 parameters,
    43,734 with the innovation channel."""

    def __init__(self, leaky_slope: float = 0.01, innovation: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.ConvTranspose1d(LATENT_CHANNELS, 4, 3, stride=1, padding=1),
                                   nn.LeakyReLU(leaky_slope)]
        for c_in, c_out in ((4, 32), (32, 64), (64, 128), (128, 32)):
            layers += [nn.ConvTranspose1d(c_in, c_out, 3, stride=2, padding=1, output_padding=1),
                       nn.LeakyReLU(leaky_slope)]
        self.net = nn.Sequential(*layers)
        self.innovation = innovation
        self.out = nn.Conv1d(32 + int(innovation), 1, 1)
        if innovation:  # this library's choice: the innovation starts as a pass-through
            with torch.no_grad():
                self.out.weight[0, -1, 0] = 1.0
                self.out.bias.zero_()

    def forward(self, z: torch.Tensor, innovation: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 4, L/16) [and the innovation (B, 1, L)] -> (B, 1, L)."""
        h = self.net(z)
        if self.innovation:
            if innovation is None:
                raise ValueError("this decoder was built with an innovation channel; pass the "
                                 "innovation vector")
            h = torch.cat([h, innovation], dim=1)
        return self.out(h)
