"""Synthetic data with a real learning signal, generated on the fly from a seed.

Nothing is downloaded or bundled: each source draws a fixed random "world" (a Markov
chain, a set of image classes, an embedding of spirals) from its seed at construction,
then samples examples from that world with the generator each call is given.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["GaborImages", "MarkovLanguage", "PythonDocsText", "Spirals"]


class MarkovLanguage:
    """Token sequences from a fixed, sparse, first-order Markov chain.

    Each token has ``branching`` distinct successors, drawn at random from the
    vocabulary, taken with the probabilities ``profile`` (most likely first). The
    best possible next-token accuracy is therefore ``profile[0]``, against a chance
    level of ``1 / vocab_size``; a model learns it by learning the successor table.

    ``sample(n)`` returns ``inputs`` and ``targets`` of shape ``(n, seq_len)``,
    ``targets`` being ``inputs`` shifted left by one token.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        *,
        seed: int,
        profile: tuple[float, ...] = (0.6, 0.2, 0.12, 0.08),
    ) -> None:
        """Draw the successor table of a chain over ``vocab_size`` tokens from ``seed``."""
        if len(profile) > vocab_size:
            raise ValueError(
                f"MarkovLanguage: {len(profile)} successors per token need a vocabulary of at "
                f"least that size, got vocab_size={vocab_size}"
            )
        if not math.isclose(sum(profile), 1.0, abs_tol=1e-6):
            raise ValueError(f"MarkovLanguage: profile must sum to 1, got {profile!r}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.profile = torch.tensor(profile, dtype=torch.float32)
        world = torch.Generator().manual_seed(seed)
        scores = torch.rand(vocab_size, vocab_size, generator=world)
        # Successors: the `branching` highest-scoring tokens, distinct per row.
        self.successors = scores.topk(len(profile), dim=1).indices

    @property
    def best_accuracy(self) -> float:
        """Next-token accuracy of the true chain (a model cannot beat it on average)."""
        return float(self.profile.max())

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` sequences of ``seq_len + 1`` tokens, split into (inputs, targets)."""
        tokens = torch.empty(n, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (n,), generator=generator)
        ranks = torch.multinomial(
            self.profile, n * self.seq_len, replacement=True, generator=generator
        ).view(n, self.seq_len)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], ranks[:, t]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class PythonDocsText:
    """Real English text, characters as tokens: the topic help that ships with every CPython
    (``pydoc_data.topics``: the language reference's sections, about 465,000 characters),
    read from disk, never downloaded.

    The ``vocab_size - 1`` most frequent characters get their own token (ids 1, 2, ... in
    order of frequency); the rest share token 0. The text's last 10% is held out:
    :meth:`sample` draws windows from the first 90%, :meth:`sample_heldout` from the rest.
    ``inputs`` and ``targets`` are ``(n, seq_len)``, ``targets`` shifted left by one.
    The text is the running Python's, so figures on it are per Python version.
    """

    heldout_fraction = 0.1

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        import pydoc_data.topics

        text = "".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
        counts: dict[str, int] = {}
        for ch in text:
            counts[ch] = counts.get(ch, 0) + 1
        ranked = sorted(counts, key=lambda ch: (-counts[ch], ch))[: vocab_size - 1]
        ids = {ch: i + 1 for i, ch in enumerate(ranked)}
        tokens = torch.tensor([ids.get(ch, 0) for ch in text], dtype=torch.long)
        cut = int(len(tokens) * (1 - self.heldout_fraction))
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.chars = "".join(ranked)
        self.train, self.heldout = tokens[:cut], tokens[cut:]

    def _windows(self, tokens: Tensor, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        starts = torch.randint(0, len(tokens) - self.seq_len - 1, (n,), generator=generator)
        rows = tokens[starts.unsqueeze(1) + torch.arange(self.seq_len + 1)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` training windows of ``seq_len + 1`` characters, split into (inputs, targets)."""
        return self._windows(self.train, n, generator)

    def sample_heldout(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` windows from the held-out last 10% of the text."""
        return self._windows(self.heldout, n, generator)


class GaborImages:
    """RGB images of Gabor patches: the class sets orientation and spatial frequency.

    Ten classes = five orientations (36 degrees apart) x two frequencies. Nuisance
    factors vary per image: the patch centre (a random shift), phase, colour tint,
    contrast, small jitter of angle and frequency, and Gaussian pixel noise. Pixels
    are roughly zero-mean, unit-variance. ``sample(n)`` returns images
    ``(n, 3, size, size)`` float32 and labels ``(n,)`` int64.
    """

    num_classes = 10

    def __init__(self, *, seed: int, size: int = 32, noise: float = 0.8) -> None:
        """Fix the class parameters (a seeded permutation of angle x frequency) from ``seed``."""
        self.size = size
        self.noise = noise
        world = torch.Generator().manual_seed(seed)
        angles = torch.arange(5, dtype=torch.float32) * (math.pi / 5)
        freqs = torch.tensor([2.5, 5.0]) / size  # cycles per pixel
        order = torch.randperm(self.num_classes, generator=world)
        self.angle = angles.repeat(2)[order]
        self.freq = freqs.repeat_interleave(5)[order]
        coords = torch.arange(size, dtype=torch.float32)
        self._ys, self._xs = torch.meshgrid(coords, coords, indexing="ij")

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` labelled images drawn with ``generator``."""
        g = generator
        labels = torch.randint(0, self.num_classes, (n,), generator=g)
        angle = self.angle[labels] + 0.08 * torch.randn(n, generator=g)
        freq = self.freq[labels] * (1.0 + 0.08 * torch.randn(n, generator=g))
        phase = 2 * math.pi * torch.rand(n, generator=g)
        centre = self.size * (0.3 + 0.4 * torch.rand(n, 2, generator=g))
        width = self.size * (0.22 + 0.1 * torch.rand(n, generator=g))
        contrast = 1.5 + torch.rand(n, generator=g)
        tint = 0.4 + 0.6 * torch.rand(n, 3, generator=g)

        def per_image(v: Tensor) -> Tensor:
            return v.view(n, 1, 1)

        dx = self._xs - per_image(centre[:, 0])
        dy = self._ys - per_image(centre[:, 1])
        along = dx * per_image(angle.cos()) + dy * per_image(angle.sin())
        carrier = torch.cos(2 * math.pi * per_image(freq) * along + per_image(phase))
        envelope = torch.exp(-(dx.square() + dy.square()) / (2 * per_image(width).square()))
        patch = per_image(contrast) * envelope * carrier  # (n, H, W)
        images = tint.view(n, 3, 1, 1) * patch.unsqueeze(1)
        images = images + self.noise * torch.randn(images.shape, generator=g)
        return images, labels


class Spirals:
    """Points on interleaved 2-D spiral arms, embedded in ``dim`` dimensions.

    Arm ``k`` is the class. The 2-D points are mapped into ``dim`` dimensions by a
    fixed random orthonormal embedding, then isotropic noise is added in all
    dimensions, so the signal lives in a random 2-D plane of the input space.
    ``sample(n)`` returns points ``(n, dim)`` float32 and labels ``(n,)`` int64.
    """

    def __init__(
        self,
        *,
        seed: int,
        num_classes: int = 5,
        dim: int = 32,
        turns: float = 1.0,
        noise: float = 0.05,
    ) -> None:
        """Fix the embedding of the spiral plane into ``dim`` dimensions from ``seed``."""
        if dim < 2:
            raise ValueError(f"Spirals: dim must be at least 2, got {dim}")
        self.num_classes = num_classes
        self.dim = dim
        self.turns = turns
        self.noise = noise
        world = torch.Generator().manual_seed(seed)
        basis, _ = torch.linalg.qr(torch.randn(dim, 2, generator=world))
        self.embedding = basis.T.contiguous()  # (2, dim), orthonormal rows

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` labelled points drawn with ``generator``."""
        g = generator
        labels = torch.randint(0, self.num_classes, (n,), generator=g)
        t = torch.rand(n, generator=g).sqrt()  # denser towards the rim, where arms are long
        angle = 2 * math.pi * (labels / self.num_classes + self.turns * t)
        radius = 2.0 * t
        plane = torch.stack((radius * angle.cos(), radius * angle.sin()), dim=1)
        points = plane @ self.embedding
        points = points + self.noise * torch.randn(n, self.dim, generator=g)
        return points, labels
