"""``train.token_routing``: TREAD's ratio and block span, written ``"RATIO:FIRST-LAST"`` (``"0.5:2-8"``).

The text form is parsed here, without torch, so that a bad value stops the job before any worker starts; the
routing itself is :mod:`rayflux.train.token_routing`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayflux.config.values import ConfigError

FORMAT = "RATIO:FIRST-LAST, e.g. 0.5:2-8 (half the image tokens skip blocks 2 to 8)"


@dataclass(frozen=True)
class TokenRouting:
    """A parsed ``train.token_routing``: ``ratio`` of the image tokens skip blocks ``first`` to ``last``."""

    ratio: float
    """Share of the image tokens that skip the span, in (0, 1)."""
    first: int
    """First block of the span (0-based; double-stream blocks first, then single-stream ones)."""
    last: int
    """Last block of the span, included."""

    @property
    def blocks(self) -> int:
        """Blocks in the span."""
        return self.last - self.first + 1


def parse(text: str) -> TokenRouting | None:
    """``train.token_routing`` as a :class:`TokenRouting`, or None when empty (routing off)."""
    text = str(text).strip()
    if not text:
        return None
    try:
        ratio_text, span = text.split(":")
        first_text, last_text = span.split("-")
        ratio, first, last = float(ratio_text), int(first_text), int(last_text)
    except ValueError:
        raise ConfigError(f"train.token_routing={text!r}: expected {FORMAT}") from None
    if not 0.0 < ratio < 1.0:
        raise ConfigError(f"train.token_routing={text!r}: the ratio must be in (0, 1), got {ratio}")
    if not 0 <= first <= last:
        raise ConfigError(f"train.token_routing={text!r}: the span needs 0 <= FIRST <= LAST, got {first}-{last}")
    return TokenRouting(ratio, first, last)


def check_depth(routing: TokenRouting, depth: int) -> None:
    """Refuse a span that reaches past the model's ``depth`` blocks."""
    if routing.last >= depth:
        raise ConfigError(
            f"train.token_routing: the span {routing.first}-{routing.last} reaches past the model's {depth} blocks "
            f"(numbered 0-{depth - 1}, double-stream first)"
        )


def keep_count(tokens: int, ratio: float) -> int:
    """Image tokens that go through the span when ``ratio`` of ``tokens`` skip it (at least one)."""
    return max(1, tokens - round(tokens * ratio))


def block_share(routing: TokenRouting, depth: int, image_tokens: int, text_tokens: int) -> float:
    """The tokens a routed step runs through the ``depth`` blocks, over a plain step's: about its share of the
    blocks' activations and matmuls (attention's quadratic term, which shrinks more, left out)."""
    kept = keep_count(image_tokens, routing.ratio) + text_tokens
    whole = image_tokens + text_tokens
    return (depth - routing.blocks + routing.blocks * kept / whole) / depth
