"""The whole job through the fault-injecting proxy (tests/fault_proxy.py): cache build, rerun, training and resume
on a bucket that answers 5% of requests 503 SlowDown and cuts one GET body and one upload off per phase, against
the same phases on the same bucket with no faults (less the rerun, which there only finds what its build committed).
The faulted run must end exactly where the clean one does: the same committed rows and, for the same seed, the same
LoRA, bit for bit.

The Ray workers (preparation, encoders, writers, training) reach S3 at the endpoint of the environment they inherit
from the process that starts Ray, so the proxy is that endpoint before this module's Ray starts, and clean phases run
through it too, with its faults off.
"""

import os

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load as load_safetensors

from rayflux import config, job, storage
from rayflux.cache import generations

from s3server import FaultProxy


@pytest.fixture(scope="module")
def proxy(s3_server):
    """The fault proxy, as the endpoint of this process and of every Ray worker it starts."""
    started = FaultProxy(s3_server.url)
    before = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = started.url
    yield started
    os.environ["AWS_ENDPOINT_URL"] = before
    started.stop()


@pytest.fixture(scope="module")
def ray_via_proxy(proxy, ray_session):
    """This module's Ray, started after ``proxy`` (its workers inherit the proxy's endpoint)."""
    return ray_session


# Each phase: which GET body and which upload the proxy cuts off once (a path part), besides 5% 503s.
PHASES = [
    ("build", "/photos/", "/cache/"),  # an image read; a shard, text or index upload
    ("rerun", "/cache/", "/faulted/"),  # the committed manifest or index; the run's first write (its lease)
    ("train", "/cache/", "/checkpoints/"),  # a training range read; a checkpoint upload
    ("resume", "/checkpoints/", "/checkpoints/"),  # the checkpoint read back; the next one's upload
]


def _phases(cfg, proxy=None) -> tuple[dict, dict]:
    """Each phase's summary, and with ``proxy`` the requests each phase sent (the proxy's log). The clean run skips
    the rerun: with nothing faulted it only finds the generation its build committed (the build's ``cache_dir``)."""
    out, sent = {}, {}
    for name, get_match, put_match in PHASES:
        if proxy is None and name == "rerun":
            continue
        start = len(proxy.fault_log()) if proxy is not None else 0
        if proxy is not None:
            proxy.faults(
                rate=0.05, seed=len(out) + 1, get_resets=1, put_resets=1, get_match=get_match, put_match=put_match
            )
        phase = config.from_dict(cfg.to_dict())
        phase.train.epochs = 2 if name == "resume" else 1
        out[name] = job.run(phase, only="cache" if name in ("build", "rerun") else "")
        if proxy is not None:
            sent[name] = proxy.fault_log()[start:]
    if proxy is not None:
        proxy.faults(rate=0.0, get_resets=0, put_resets=0)
    return out, sent


def _rows(cache_dir: str) -> list[tuple]:
    """The committed generation's sample and text rows, without the columns that name the run's own folder or its
    build (``encode_id``: which build's encoders made the row)."""
    manifest = generations.load_manifest(cache_dir)
    out = []
    for path in generations.sample_files(manifest) + generations.text_files(manifest):
        fs, inner = storage.resolve(path)
        for row in pq.read_table(inner, filesystem=fs).to_pylist():
            out.append(
                tuple(
                    sorted(
                        (k, repr(v))
                        for k, v in row.items()
                        if k != "encode_id" and ("path" not in k or k == "rel_path")
                    )
                )
            )
    return sorted(out)


def _lora(summary) -> dict:
    return load_safetensors(storage.read_bytes(summary.lora_path))


def test_the_whole_job_through_503s_and_resets_ends_as_the_clean_run(
    ray_via_proxy, proxy, s3_server, tiny_model, demo_images
):
    bucket = f"s3://rayflux-faults-{os.urandom(3).hex()}"
    fs, _ = storage.resolve(bucket)
    fs.create_dir(bucket[5:])
    for p in sorted(demo_images.iterdir()):
        if p.suffix in (".png", ".txt"):
            storage.write_bytes_atomic(f"{bucket}/photos/{p.name}", p.read_bytes())
    settings = [
        f"model.path={tiny_model}",
        f"data.images_dir={bucket}/photos",
        "data.resolution=64",
        "train.workers.num_workers=1",
        "train.checkpoint.every=4",
        "cache.batch_size=4",
    ]
    clean, _ = _phases(config.load(None, settings + [f"run.output_dir={bucket}/clean"]))
    faulted, sent = _phases(config.load(None, settings + [f"run.output_dir={bucket}/faulted"]), proxy)

    # Every phase met its faults: the GET body and the upload cut off where the phase sends them, and 503s.
    outcomes = [o for name in sent for *_, o in sent[name]]
    assert outcomes.count("503") >= 10 and "error" not in outcomes
    for name, get_match, put_match in PHASES:
        resets = [(m, p) for m, p, _, _, o in sent[name] if o == "reset"]
        assert any(m == "GET" and get_match in p for m, p in resets), (name, resets)
        assert any(m in ("PUT", "POST") and put_match in p for m, p in resets), (name, resets)
    # ... and ended where the clean run did.
    assert faulted["rerun"].cache_dir.rsplit("/cache/", 1)[1] == clean["build"].cache_dir.rsplit("/cache/", 1)[1]
    rows, clean_rows = _rows(faulted["rerun"].cache_dir), _rows(clean["build"].cache_dir)
    assert len(rows) == len(clean_rows) and [set(a) ^ set(b) for a, b in zip(rows, clean_rows)] == [set()] * len(rows)
    assert faulted["resume"].losses == clean["resume"].losses
    assert faulted["resume"].steps == clean["resume"].steps == 2 * clean["train"].steps
    a, b = _lora(faulted["resume"]), _lora(clean["resume"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
