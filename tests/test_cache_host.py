"""One encoder process for both cache passes (:mod:`rayflux.cache.host`): the memory rule inside one host, and a
host that dies.

The memory rule runs in this process (the host's methods are plain Python): the host loads its text encoders on the
first caption batch, drops them at the end of the text pass, before any VAE, and refuses a caption batch after that.
The deaths run the real cache stage on the module's 2-CPU Ray, where one host runs both passes: its real process is
killed (SIGKILL, the pid the host reports), once in the VAE pass (Ray restarts it and the build equals one that
was never interrupted) and at every start (the build ends with an error that says why).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import cache_sets
import pytest

from rayflux import config, memory, models
from rayflux.cache import generations, host, verify
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


def _hosts() -> list[dict]:
    """Every encoder host Ray's actor table holds, from the GCS."""
    from ray._private.state import actors

    return [a for a in actors().values() if a["ActorClassName"] == "EncoderHost"]


def _report(killed: list[int]) -> dict | None:
    """A running host's own report (its pid and the batches it encoded), asked of the actor by its name; None while
    no host runs that has not been killed yet."""
    import ray

    for a in _hosts():
        if a["State"] == "ALIVE" and a["Name"].startswith(host.NAME):
            try:
                report = ray.get(
                    ray.get_actor(a["Name"]).report.options(concurrency_group="lifeline").remote(), timeout=5
                )
            except (ValueError, ray.exceptions.RayError, TimeoutError):  # it died, or was killed, meanwhile
                continue
            if report["pid"] not in killed:
                return report
    return None


def _comparable(manifest: dict) -> tuple[dict, dict]:
    """A generation's sample rows (with their caption's embeddings) and caption rows by id, without what names
    the build (its encode id, generation, files and places in them)."""
    build_names = {"encode_id", "generation", "file", "file_bytes", "row", "offset", "t5_offset", "clip_offset"}

    def keep(row: dict) -> dict:
        return {k: v for k, v in row.items() if k not in build_names}

    samples = {r["sample_id"]: keep(r) for r in cache_sets.generation_rows(manifest)}
    return samples, {r["caption_id"]: keep(r) for r in cache_sets.generation_text(manifest)}


def test_a_host_killed_in_the_vae_pass_comes_back_and_the_build_is_unchanged(ray_session, tiny_model, tmp_path):
    """32 images, one a VAE call: the host is killed once it has encoded two image batches. Ray restarts it, the
    batches it held go to the new process (which loads the VAE again), and the generation holds the same rows,
    latents and embeddings as a build nobody interrupted."""
    images = cache_sets.captioned_pictures(tmp_path, 32)
    # A restarted host left waiting for an end of the text pass it was never told of would stall the build: 60 s, not
    # the default 600, until it fails.
    sets = ("data.resolution=64", "cache.batch_size=1", "cache.rows_per_shard=4", "cache.stall_seconds=60")
    _, quiet = cache_sets.build(cache_sets.job_config(tiny_model, images, tmp_path / "quiet", *sets))
    killed: list[int] = []
    at_kill: list[dict] = []

    def kill_in_the_vae_pass() -> None:
        for _ in range(3000):
            report = _report(killed)
            if report and report["images"] >= 2:
                os.kill(report["pid"], signal.SIGKILL)
                killed.append(report["pid"])
                at_kill.append(report)
                return
            time.sleep(0.01 if report and report["captions"] else 0.1)  # asks often only once the VAE pass is near

    killer = threading.Thread(target=kill_in_the_vae_pass, daemon=True)
    killer.start()
    gen_dir, manifest = cache_sets.build(cache_sets.job_config(tiny_model, images, tmp_path / "killed", *sets))
    killer.join()
    # Killed in the VAE pass: the process had run the text pass and encoded some images, not all; the restarted one
    # (told that the text pass had ended) did the rest.
    assert at_kill and at_kill[0]["captions"] > 0 and 2 <= at_kill[0]["images"] < 32, at_kill
    assert sorted(a["NumRestarts"] for a in _hosts()) == [0, 1]  # the quiet build's host, and this one's
    assert manifest["cached"] == quiet["cached"] == 32 and manifest["buckets"] == quiet["buckets"]
    assert manifest["encoded"] == quiet["encoded"] and manifest["skipped_inputs"] == quiet["skipped_inputs"] == []
    assert _comparable(manifest) == _comparable(quiet)
    assert set(generations.files_in(gen_dir)) == generations.listed(manifest)
    assert verify.main([gen_dir]) == 0


def test_a_host_that_dies_at_every_start_ends_the_build_with_the_cause(ray_session, tiny_model, tmp_path):
    """Each time Ray (re)starts the host, its process is killed (as an encoder too big for memory would have it
    killed): after :data:`rayflux.cache.host.RESTARTS` restarts the build fails, names the cause, commits nothing
    and leaves no host alive."""
    images = cache_sets.captioned_pictures(tmp_path, 8)
    cfg = cache_sets.job_config(tiny_model, images, tmp_path, "data.resolution=64")
    killed: list[int] = []
    done = threading.Event()

    def kill_every_start() -> None:
        while not done.is_set():
            report = _report(killed)
            if report:
                os.kill(report["pid"], signal.SIGKILL)
                killed.append(report["pid"])
            time.sleep(0.02)

    killer = threading.Thread(target=kill_every_start, daemon=True)
    killer.start()
    try:
        with pytest.raises(host.EncoderHostsGone) as err:  # itself, not Ray Data's wrapper of the task's error
            cache_sets.build(cfg)
    finally:
        done.set()
        killer.join()
    assert len(killed) == host.RESTARTS + 1, killed
    message = str(err.value)
    assert f"every encoder host (1) is gone: each died again after Ray restarted it {host.RESTARTS} times" in message
    assert "Worker exit type: SYSTEM_ERROR" in message and "\n" not in message  # Ray's cause, in one line
    assert not list((tmp_path / "cache").rglob(generations.MANIFEST))
    assert not [a for a in _hosts() if a["State"] != "DEAD"]
