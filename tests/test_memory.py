"""Encoders live only in the cache stage's actors: gone when it ends, never in a training worker."""

import pytest

import cache_sets

from rayflux import config, job, memory
from rayflux.cache import generations


@pytest.fixture(scope="module")
def heavy_t5_model(tmp_path_factory):
    """The tiny model with 256 MiB of extra T5 embedding rows: heavy in memory, not in compute."""
    from rayflux.testing.tiny import TinySpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("heavy") / "model", TinySpec(t5_extra_mb=256))


def _encoder_actors(dashboard: str) -> dict[str, set]:
    """State of every encoder actor Ray knows of, by kind: Ray Data names the pools' ``MapWorker(MapBatches(<class>))``;
    an ``EncoderHost`` runs both passes where the pools would take the same resources in turn."""
    from ray.util.state import list_actors

    states: dict[str, set] = {"VaeEncoder": set(), "TextEncoder": set(), "EncoderHost": set()}
    for a in list_actors(address=dashboard, limit=10_000, raise_on_missing_output=False):
        for kind in states:
            if kind in (a.class_name or ""):
                states[kind].add(a.state)
    return states


def test_encoders_are_gone_after_the_cache_stage_and_never_in_training(
    ray_session, ray_dashboard, heavy_t5_model, demo_images, tmp_path
):
    t5_bytes_mb = 256
    cfg = config.load(
        None,
        [
            f"model.path={heavy_t5_model}",
            f"data.images_dir={demo_images}",
            f"run.output_dir={tmp_path / 'run'}",
            "data.resolution=64",
            "train.epochs=1",
            "train.workers.num_workers=2",
            "train.checkpoint.every=2",
            # Validation on: its prompts are encoded by the render actor, never by a training worker.
            'train.validation.prompts=["a red circle"]',
            "train.validation.every=2",
            "train.validation.inference_steps=1",
            # Output preservation's class prompts (issue 45) are encoded by the cache stage too, never by a worker.
            "train.flow.preservation=class",
            "data.trigger_word=background",
            "data.class_word=scene",
        ],
    )
    summary = job.run(cfg)
    # The state API saw the text and VAE actors (so the check below can fail), and none is alive now.
    assert summary.cached == 8
    states = _encoder_actors(ray_dashboard)
    one_process = generations.load_manifest(summary.cache_dir)["passes"]["one_process"]
    kinds = ["EncoderHost"] if one_process else ["VaeEncoder", "TextEncoder"]
    assert all(states[k] for k in kinds), f"the state API never saw the encoder actors: {states}"
    assert "ALIVE" not in set().union(*states.values()), states

    records = [h for h in summary.history if "encoders_alive" in h]
    assert records, "no checkpoint record carried memory facts"
    for r in records:
        assert r["encoders_alive"] == 0
        # Loading the text encoders would add at least their weights (256 MiB of T5 alone) to a worker's RSS.
        assert r["rss_growth_mb"] < t5_bytes_mb, r
        assert r["peak_rss_mb"] - (r["rss_mb"] - r["rss_growth_mb"]) < t5_bytes_mb, r  # not even for a moment
    assert [h["step"] for h in summary.history if "validation_image" in h] == [2, 4]
    captions = {r["caption"] for r in cache_sets.generation_text(generations.load_manifest(summary.cache_dir))}
    kept = {c.replace("background", "scene") for c in captions if "background" in c}  # each class prompt
    assert kept and kept <= captions


def test_live_encoders_sees_a_loaded_text_encoder():
    """The check above can fail: in a process that holds a text encoder, it is counted."""
    from transformers import T5Config, T5EncoderModel

    before = memory.live_encoders().get("T5EncoderModel", 0)
    model = T5EncoderModel(T5Config(vocab_size=10, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    assert memory.live_encoders()["T5EncoderModel"] == before + 1
    del model
    assert memory.live_encoders()["T5EncoderModel"] == before


def test_live_encoders_sees_every_familys_text_encoder():
    """FLUX.2's encoders count too: a worker holding [klein]'s Qwen3 is seen, as one holding FLUX.1's T5 is."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    before = memory.live_encoders().get("Qwen3ForCausalLM", 0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=10,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
        )
    )
    assert memory.live_encoders()["Qwen3ForCausalLM"] == before + 1
    del model
    assert memory.live_encoders()["Qwen3ForCausalLM"] == before


def test_every_declared_encoder_class_exists():
    """A misspelt class name would never be counted: each family's encoder classes are real ones."""
    import importlib

    from rayflux import families

    for family in {f.name: f for f in families.FAMILIES.values()}.values():
        for package, names in family.encoder_classes.items():
            module = importlib.import_module(package)
            assert all(hasattr(module, n) for n in names), (family.name, package, names)


def test_rss_and_peak_are_plausible():
    import numpy as np

    start = memory.rss_mb()
    block = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB, touched
    grown = memory.rss_mb() - start
    assert grown > 48
    assert memory.peak_rss_mb() >= memory.rss_mb() - 1
    del block


def test_memory_facts_follow_an_allocation():
    """rss and peak in MiB, from psutil/getrusage (no /proc): a 256 MiB buffer shows in both."""
    import numpy as np

    before = memory.rss_mb()
    buf = np.ones(256 * 2**20, dtype=np.uint8)  # touched pages, so resident
    during = memory.rss_mb()
    assert 200 < during - before < 400
    assert memory.peak_rss_mb() >= during - 1
    del buf
