"""One encoder process for both cache passes (:mod:`rayflux.cache.host`): the memory rule inside one host.

Run in this process (the host's methods are plain Python; the Ray side runs in ``tests/test_cache_fit.py``): the
host loads its text encoders on the first caption batch, drops them at the end of the text pass, before any VAE,
and refuses a caption batch after that.
"""

from __future__ import annotations

import pytest

from rayflux import config, memory, models
from rayflux.cache.host import EncoderHost


def _text_encoders_alive() -> int:
    counts = memory.live_encoders()
    return sum(n for name, n in counts.items() if not name.startswith("Autoencoder"))  # the VAE classes


def test_a_host_drops_its_text_encoders_at_the_end_of_the_text_pass(tiny_model):
    cfg = config.load(None, [f"model.path={tiny_model}"])
    common = {"model": cfg.model, "store_dtype": "float32", "encode_id": "host-test"}
    host = EncoderHost(text={**common, "facts": models.model_facts(cfg.model)}, vae=common)
    before = _text_encoders_alive()
    out = host.encode_text({"caption_id": ["c0", "c1"], "caption": ["a red cube", "a blue ball"]})
    assert len(out["t5"]) == 2 and _text_encoders_alive() > before
    host.end_text()
    assert _text_encoders_alive() == before and host.vae is None  # gone, and the VAE not loaded yet
    with pytest.raises(RuntimeError, match="after the text pass ended"):
        host.encode_text({"caption_id": ["c2"], "caption": ["late"]})
