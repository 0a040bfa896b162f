"""TREAD token routing (``train.token_routing``): during training, a random share of the image tokens skips a span of
transformer blocks and rejoins, unchanged, after it; the others go through the span, so the LoRA inside it trains.

Nothing of diffusers' transformer is rewritten. Hooks on the span's blocks change what the transformer's own block
loop hands them: the span's first block gets the kept image tokens (gathered) and every block in the span the rotary
embedding rows of those tokens; the span's last block's output is scattered back among the skipped tokens, which
still hold their values from before the span. The family names the block lists and which take text and image as one
joint stream (:attr:`rayflux.families.base.Family.routed_blocks`). One set of kept tokens serves the whole batch (a
batch holds one bucket, so every sample has the same token count), which keeps the rotary embedding unbatched, as
the blocks expect it.

Routing is active only for a forward that builds a graph on a module in training mode: eval loss (no gradients) and
validation renders (their own transformer) run the whole model. A forward's kept tokens stay fixed until the next
forward, so gradient checkpointing's recomputation in the backward pass gathers the same ones.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass

import torch

from rayflux.config.token_routing import TokenRouting, check_depth, keep_count


def kept_indices(tokens: int, ratio: float, generator: torch.Generator) -> torch.Tensor:
    """A random, sorted set of :func:`keep_count` token positions out of ``tokens``."""
    chosen = torch.randperm(tokens, generator=generator)[: keep_count(tokens, ratio)]
    return chosen.sort().values


def rotary_rows(text: int, kept: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[text + image, D]`` rotary embedding for the text tokens and the kept image tokens."""
    return torch.cat([torch.arange(text, device=kept.device), kept + text])


@dataclass
class Route:
    """One forward's routing: which image tokens go through the span, and the image stream from before it."""

    kept: torch.Tensor
    """Sorted positions, in the image stream, of the tokens that go through the span."""
    image_tokens: int
    """Image tokens of the forward (the transformer's ``hidden_states`` length)."""
    rotary: tuple | None = None
    """The rotary embedding's rows of the text and kept tokens, gathered at the span's first block."""
    before: torch.Tensor | None = None
    """The whole image stream as it entered the span: the skipped tokens' values after it."""


class Router:
    """The hooks of one transformer; :meth:`seed` before each training forward, :meth:`remove` to detach them."""

    def __init__(self, transformer, routing: TokenRouting, lists: tuple[tuple[str, bool], ...]):
        blocks = [(block, joint) for name, joint in lists for block in getattr(transformer, name)]
        check_depth(routing, len(blocks))
        self.routing, self.transformer = routing, transformer
        self.route: Route | None = None
        self.generator = torch.Generator()
        self.calls = 0  # routed forwards so far
        self.handles = [transformer.register_forward_pre_hook(self._start, with_kwargs=True)]
        span = blocks[routing.first : routing.last + 1]
        for i, (block, joint) in enumerate(span):
            entry = i == 0
            self.handles.append(block.register_forward_pre_hook(self._block_input(joint, entry), with_kwargs=True))
        last, joint = span[-1]
        self.handles.append(last.register_forward_hook(self._block_output(joint), with_kwargs=True))

    def seed(self, seed: int) -> None:
        """Draw the next forward's kept tokens from ``seed`` (a batch's planned seed: reruns route alike), through
        a hash, so that they are not drawn from the same stream as the batch's noise."""
        digest = hashlib.sha256(f"{seed}:token_routing".encode()).digest()
        self.generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.route = [], None

    def _start(self, module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if not (module.training and torch.is_grad_enabled()):
            self.route = None
            return None
        n = hidden.shape[1]
        self.route = Route(kept_indices(n, self.routing.ratio, self.generator).to(hidden.device), n)
        self.calls += 1
        return None

    def _block_input(self, joint: bool, entry: bool):
        def hook(block, args, kwargs):
            route = self.route
            if route is None:
                return None
            bound = _signature(block).bind(*args, **kwargs)
            rotary = bound.arguments["image_rotary_emb"]
            text = rotary[0].shape[0] - route.image_tokens
            if route.rotary is None:
                rows = rotary_rows(text, route.kept)
                route.rotary = tuple(r.index_select(0, rows.to(r.device)) for r in rotary)
            bound.arguments["image_rotary_emb"] = route.rotary
            if entry:
                hidden = bound.arguments["hidden_states"]
                image = hidden[:, text:] if joint else hidden
                if route.before is None:  # a checkpoint's recomputation gathers again, from the same stream
                    route.before = image
                kept = image.index_select(1, route.kept)
                bound.arguments["hidden_states"] = torch.cat([hidden[:, :text], kept], 1) if joint else kept
            return bound.args, bound.kwargs

        return hook

    def _block_output(self, joint: bool):
        def hook(block, args, kwargs, output):
            route = self.route
            if route is None:
                return None
            if joint:
                text = output.shape[1] - route.kept.numel()
                rejoined = route.before.index_copy(1, route.kept, output[:, text:])
                return torch.cat([output[:, :text], rejoined], 1)
            context, image = output
            return context, route.before.index_copy(1, route.kept, image)

        return hook


_SIGNATURES: dict[type, inspect.Signature] = {}


def _signature(block) -> inspect.Signature:
    cls = type(block)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward).replace(
            parameters=list(inspect.signature(cls.forward).parameters.values())[1:]
        )
    return _SIGNATURES[cls]


def attach(transformer, routing: TokenRouting | None, family) -> Router | None:
    """Route ``transformer``'s training forwards as ``routing`` says (None: nothing attached)."""
    if routing is None:
        return None
    return Router(transformer, routing, family.routed_blocks)
