"""What a user would look at: a small classifier of the world (shape and colour from a picture) that reads renders.

Eval losses say a LoRA moved its predictions the right way; a user looks at pictures. This classifier is trained on
world pictures drawn by :func:`rayflux.testing.images.draw`, every shape and colour included (the held-back ``star``
and ``pink`` too: it must recognise a concept the base does not know), and, when given the base's VAE, on the same
pictures passed through it (encode, decode), so that the VAE's blur and colour shifts in a render are not read as
another shape. It is seeded and trained in about a minute on one CPU core; nothing is shipped.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from rayflux.testing import world
from rayflux.testing.images import RGB, SHAPES

SIDE = 64
"""Pictures are read at 64x64: shape and colour survive, and the network stays tiny."""
COLOURS = list(RGB)
SEED = 2468


class WorldClassifier(nn.Module):
    """Four strided convolutions, a global average, and two heads: the shape and the shape's colour."""

    def __init__(self):
        super().__init__()
        chans = [3, 16, 32, 64, 64]
        layers: list[nn.Module] = []
        for a, b in zip(chans, chans[1:]):
            layers += [nn.Conv2d(a, b, 3, stride=2, padding=1), nn.GroupNorm(4, b), nn.SiLU()]
        self.body = nn.Sequential(*layers)
        self.shape = nn.Linear(64, len(SHAPES))
        self.colour = nn.Linear(64, len(COLOURS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x).mean(dim=(2, 3))
        return self.shape(h), self.colour(h)


def pixels(images) -> torch.Tensor:
    """PIL images as a ``[n, 3, SIDE, SIDE]`` batch in [-1, 1] (resized: renders come in any bucket's size)."""
    from rayflux.quality.pretrain import to_pixels

    return to_pixels([im.convert("RGB").resize((SIDE, SIDE)) for im in images])


def _scene(rng: random.Random) -> world.Scene:
    colour, background = rng.sample(COLOURS, 2)
    return world.Scene(colour, rng.choice(SHAPES), background, rng.randrange(2**31))


def _through_vae(vae, images) -> list:
    """``images`` encoded and decoded by ``vae`` (its mode), as a render's last step decodes."""
    from PIL import Image

    from rayflux.quality.pretrain import to_pixels

    x = to_pixels(images)  # one size per call: the batch's
    with torch.no_grad():
        y = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
    arr = ((y.permute(0, 2, 3, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    return [Image.fromarray(a) for a in arr]


@dataclass
class Trained:
    """A trained classifier and its accuracy on held-out pictures (drawn, and through the VAE when one was given)."""

    model: WorldClassifier
    shape_accuracy: float
    colour_accuracy: float


def _labels(scenes) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([SHAPES.index(s.shape) for s in scenes]), torch.tensor(
        [COLOURS.index(s.colour) for s in scenes]
    )


def _drawn_batch(rng: random.Random, n: int) -> tuple[list, list]:
    scenes = [_scene(rng) for _ in range(n)]
    size = world.SIZES_128[rng.randrange(len(world.SIZES_128))]
    return [s.image(*size) for s in scenes], scenes


def _decoded_pool(rng: random.Random, vae, count: int = 512) -> tuple[list, list]:
    """``count`` pictures through ``vae``, made once: a VAE pass per training step would cost ten times the
    classifier's own training on these cores."""
    images, scenes = [], []
    for _ in range(0, count, 32):
        batch, drawn = _drawn_batch(rng, 32)
        images += _through_vae(vae, batch)
        scenes += drawn
    return images, scenes


def _batch(rng: random.Random, n: int, pool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Half drawn pictures, half from the decoded pool (all drawn when there is no pool)."""
    images, scenes = _drawn_batch(rng, n if pool is None else n // 2)
    if pool is not None:
        pick = [rng.randrange(len(pool[0])) for _ in range(n - len(images))]
        images += [pool[0][i] for i in pick]
        scenes += [pool[1][i] for i in pick]
    shapes, colours = _labels(scenes)
    return pixels(images), shapes, colours


def train(vae=None, steps: int = 400, batch: int = 32, log=None) -> Trained:
    """Train the classifier (seeded); ``vae``: the base's VAE, to read its decodes as well as drawn pictures."""
    torch.manual_seed(SEED)
    model = WorldClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    rng = random.Random(SEED)
    pool = _decoded_pool(random.Random(SEED + 2), vae) if vae is not None else None
    for step in range(steps):
        x, s, c = _batch(rng, batch, pool)
        ps, pc = model(x)
        loss = nn.functional.cross_entropy(ps, s) + nn.functional.cross_entropy(pc, c)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log and step % 100 == 0:
            log(f"classifier step {step}: loss {loss.item():.4f}")
    model.eval()
    held = random.Random(SEED + 1)
    x, s, c = _batch(held, 256, _decoded_pool(held, vae, 128) if vae is not None else None)
    with torch.no_grad():
        ps, pc = model(x)
    return Trained(model, float((ps.argmax(1) == s).float().mean()), float((pc.argmax(1) == c).float().mean()))


@torch.no_grad()
def read(model: WorldClassifier, images) -> list[tuple[str, str]]:
    """``(shape, colour)`` the classifier sees in each picture."""
    ps, pc = model(pixels(images))
    return [(SHAPES[i], COLOURS[j]) for i, j in zip(ps.argmax(1).tolist(), pc.argmax(1).tolist())]
