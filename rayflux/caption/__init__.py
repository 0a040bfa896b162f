"""Captions made by a vision-language model before the cache stage (``data.caption_strategy=vlm`` or
``data.missing_caption=vlm``): the captioner's identity, its Ray Data stage, the captions table it commits in the
cache directory, and the export of that table as sidecar files or a metadata table."""
