"""Output preservation without a regularisation set (``train.flow.preservation``): which prompt each sample's
preservation forward uses, and what that asks of the cache.

On every step the noisy latent of each sample also goes through the base model (the adapter switched off) on a
*preservation prompt*; that prediction is the target of the LoRA model on the same prompt (the loss term is
:func:`rayflux.train.preserve.preservation_loss`). The prompt is, per ``train.flow.preservation``:

- ``class``: the sample's caption with its dataset's ``trigger_word`` replaced by its ``class_word`` ("sks woman"
  -> "woman" with trigger ``sks`` and no class word, or "photo of sks" -> "photo of woman"), as ai-toolkit's
  differential output preservation;
- ``blank``: the empty prompt, which every cache generation already holds (caption dropout trains on it).

The class prompts are captions like any other: the cache's text pass encodes each distinct one once, beside the
real captions (:func:`extra_captions`), so the training workers still load no text encoder. Which class prompts a
generation holds is part of its inputs signature (:func:`rule`), so a generation built without them is never reused
for a run that needs them: a new one is built that encodes only the missing prompts and references everything else.

This module imports no torch: the cache stage and the driver's planning use it.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.compute as pc


_SPACES = re.compile(r"\s+")


def class_caption(caption: str, trigger: str, class_word: str) -> str:
    """``caption`` with every whole-word occurrence of ``trigger`` replaced by ``class_word``, spaces collapsed
    (an empty class word drops the trigger). Whole words only: the trigger ``sks`` leaves ``asks`` alone."""
    if not trigger:
        return caption
    pattern = re.compile(rf"(?<!\w){re.escape(trigger)}(?!\w)")
    return _SPACES.sub(" ", pattern.sub(class_word, caption)).strip()


def words(cfg) -> dict[str, tuple[str, str]]:
    """``{dataset key: (trigger_word, class_word)}`` of a job with ``train.flow.preservation=class`` (the key is the
    shards' ``dataset`` column, :func:`rayflux.datasets.key`); empty for any other mode."""
    from rayflux import datasets

    if cfg.train.flow.preservation != "class":
        return {}
    return {datasets.key(cfg.data, ds): (ds.trigger_word, ds.class_word) for ds in datasets.datasets_of(cfg.data)}


def rule(cfg) -> str:
    """What decides a generation's preservation captions, for its inputs signature: "" when it needs none (so a
    job without preservation keeps the signature it had before preservation existed)."""
    w = words(cfg)
    return json.dumps(sorted(w.items())) if w else ""


def extra_captions(table: pa.Table, by_dataset: dict[str, tuple[str, str]]) -> pa.Array:
    """The class prompts of ``table``'s rows (``dataset`` and ``caption`` columns): one per distinct caption of a
    dataset that has words, as strings. They join the generation's captions to encode."""
    found: set[str] = set()
    for key, (trigger, class_word) in by_dataset.items():
        mine = table.filter(pc.equal(table["dataset"], key))["caption"].unique()
        found.update(class_caption(c, trigger, class_word) for c in mine.to_pylist())
    return pa.array(sorted(found), pa.string())


def graphs(mode: str) -> int:
    """Autograd graphs a batch's step holds at once: the concept forward's, and with preservation the LoRA forward
    on the preservation prompts' too (the base's forward runs without gradients and holds none). Activation memory
    scales with it as with the batch size."""
    return 1 if mode == "none" else 2


def cost(mode: str) -> str:
    """What preservation adds to a step, for ``rayflux plan``."""
    if mode == "none":
        return "train.flow.preservation=none: 1 transformer forward and 1 backward a batch"
    return (
        f"train.flow.preservation={mode}: 3 transformer forwards a batch (1 of them the base's, without gradients) and "
        "2 backwards, against 1 and 1 without it; activations of 2 graphs at once, as a batch twice the size"
    )
