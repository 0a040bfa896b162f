"""Each sample's planned text locators with output preservation (issue 45): its caption's, and its class
prompt's, found in the generation's caption index (:mod:`rayflux.preservation` says what the prompts are)."""

from __future__ import annotations

from rayflux.cache.layout import encode_texts
from rayflux.discovery.caption_hash import caption_id as id_of
from rayflux.preservation import class_caption


class SampleTexts:
    """Each sample's planned ``text`` (:func:`rayflux.cache.layout.encode_texts`) from the generation's caption
    index: its caption's locator, and with ``train.flow.preservation=class`` its class prompt's too (one string object
    per caption and dataset, as the planner shares its strings).

    ``words``: :func:`words`; ``locators``: ``{caption_id: TextLocator JSON}``; ``captions``: ``{caption_id:
    caption}`` (needed only with words)."""

    def __init__(self, words: dict[str, tuple[str, str]], locators: dict[str, str], captions: dict[str, str]):
        self.words, self.locators, self.captions = words, locators, captions
        self.memo: dict[tuple[str, str], str] = {}
        self.unchanged: set[str] = set()
        """Captions whose class prompt is the caption itself: their dataset's trigger word is not in them."""

    def __call__(self, caption_id: str, dataset: str) -> str:
        if dataset not in self.words:
            return self.locators[caption_id]
        key = (caption_id, dataset)
        if key not in self.memo:
            caption = self.captions[caption_id]
            prompt = class_caption(caption, *self.words[dataset])
            if prompt == caption:
                self.unchanged.add(caption)
            found = self.locators.get(id_of(prompt))
            if found is None:
                raise ValueError(
                    f"the cache generation holds no embedding of the preservation prompt {prompt!r} (caption "
                    f"{caption!r}): it was built without train.flow.preservation=class and these words; rerun the job, "
                    "which builds a generation that encodes them"
                )
            self.memo[key] = encode_texts({"caption": self.locators[caption_id], "preservation": found})
        return self.memo[key]
