"""Several datasets in one job: config, discovery, per-dataset buckets, repeats and weights in the epoch plan."""

import json

import numpy as np
import pytest
from PIL import Image

from rayflux.cache.layout import decode_planned
from rayflux import buckets, config, datasets, storage
from rayflux.cache import generations, shards
from rayflux.cache.keys import bucket_spec
from rayflux.models import ModelFacts
from rayflux.discovery.in_process import discover
from rayflux.train.data import batching

FACTS = ModelFacts(8, 4, 0.0, 1.0, False, 8, "test")


def _images(root, sizes):
    root.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (20 * i, 90, 160)).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(f"caption {i}")


def _load(tmp_path, yaml_text: str, *overrides) -> config.JobConfig:
    f = tmp_path / "job.yaml"
    f.write_text(yaml_text)
    return config.load(str(f), list(overrides))


def test_listed_datasets_inherit_data_keys_and_override_their_own(tmp_path):
    cfg = _load(
        tmp_path,
        """
data:
  resolution: 256
  crop: random
  datasets:
    - {images_dir: s3://bucket/people, repeats: 3}
    - {name: reg, images_dir: /data/reg, resolution: 512, regularisation: true, max_samples: "10"}
""",
    )
    a, b = datasets.datasets_of(cfg.data)
    assert (a.name, a.resolution, a.crop, a.repeats, a.regularisation) == ("people", 256, "random", 3, False)
    assert (b.name, b.resolution, b.crop, b.max_samples, b.regularisation) == ("reg", 512, "random", 10, True)


def test_single_images_dir_is_one_unprefixed_dataset():
    cfg = config.load(None, ["data.images_dir=/data/x", "data.repeats=2"])
    (only,) = datasets.datasets_of(cfg.data)
    assert only.images_dir == "/data/x" and only.repeats == 2
    assert not datasets.prefixes_paths(cfg.data) and datasets.key(cfg.data, only) == ""


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("data:\n  datasets:\n    - {images_dir: /a, crop: diagonal}\n", r"data.datasets\[0\].crop must be one of"),
        ("data:\n  crop: diagonal\n  datasets:\n    - {images_dir: /a}\n", r"^data.crop must be one of"),
        ("data:\n  datasets:\n    - {images_dir: /a, colour: red}\n", r"unknown dataset key data.datasets\[0\].colour"),
        ("data:\n  datasets:\n    - {images_dir: /a, repeats: two}\n", r"data.datasets\[0\].repeats: expected int"),
        ("data:\n  datasets:\n    - {images_dir: /a, repeats: 0}\n", r"data.datasets\[0\].repeats must be positive"),
        ("data:\n  datasets:\n    - {name: x}\n", r"data.datasets\[0\].images_dir is required"),
        ("data:\n  datasets:\n    - /a\n", r"data.datasets\[0\] must be a mapping"),
        ("data:\n  datasets: /a\n", r"data.datasets must be a YAML list of mappings"),
        ("data:\n  images_dir: /b\n  datasets:\n    - {images_dir: /a}\n", "are exclusive"),
        ("data:\n  datasets:\n    - {images_dir: /x/a}\n    - {images_dir: /y/a}\n", "name 'a' is used 2 times"),
        ("data:\n  datasets:\n    - {images_dir: /a, name: 'a/b'}\n", r"data.datasets\[0\].name 'a/b' may only"),
        ("data:\n  datasets:\n    - {images_dir: /a, caption_strategy: instance}\n", "instance_prompt is empty"),
        ("data:\n  datasets:\n    - {images_dir: /a, max_samples: -1}\n", "max_samples must be >= 0"),
        ("data:\n  reg_loss_weight: -1\n", "data.reg_loss_weight must be >= 0"),
    ],
)
def test_bad_dataset_config_names_the_key(tmp_path, yaml_text, message):
    with pytest.raises(config.ConfigError, match=message):
        _load(tmp_path, yaml_text)


def test_help_documents_the_dataset_keys():
    text = config.help_text()
    keys = [
        "data.images_dir",
        "data.datasets = []",
        "data.caption_strategy",
        "data.metadata_file",
        "data.repeats = 1",
        "data.max_samples = 0",
        "data.regularisation = False",
        "data.reg_loss_weight",
    ]
    for key in keys:
        assert key in text
    docs = config.field_docs(config.DatasetConfig)
    assert all(docs.get(f) for f in config.DatasetConfig.__dataclass_fields__)


def test_same_file_names_in_two_datasets_never_collide(tmp_path):
    _images(tmp_path / "a", [(96, 64), (64, 64)])
    _images(tmp_path / "b", [(96, 64)])
    cfg = config.load(None, [f"data.datasets=[{{images_dir: {tmp_path / 'a'}}}, {{images_dir: {tmp_path / 'b'}}}]"])
    found = discover(cfg.data)
    assert sorted(s.rel_path for s in found.sources) == ["a/img0.png", "a/img1.png", "b/img0.png"]
    assert {s.rel_path.split("/")[0] for s in found.sources} == {s.dataset for s in found.sources}


def test_max_samples_keeps_a_stable_subset(tmp_path):
    _images(tmp_path / "many", [(64, 64)] * 7)
    cfg = config.load(None, [f"data.images_dir={tmp_path / 'many'}", "data.max_samples=3"])
    first, second = discover(cfg.data, seed=1), discover(cfg.data, seed=2)
    assert len(first.sources) == 3 and first.discovered == 3 and first.unsampled == {"many": 4}
    assert [s.rel_path for s in first.sources] == [s.rel_path for s in second.sources]


def test_each_dataset_buckets_at_its_own_resolution_and_no_bucket_mixes_latent_shapes(tmp_path):
    sizes = [(640, 384), (384, 640), (512, 512), (600, 400), (1000, 300)]
    _images(tmp_path / "lo", sizes)
    _images(tmp_path / "hi", sizes)
    cfg = config.load(
        None,
        [
            f"data.datasets=[{{images_dir: {tmp_path / 'lo'}, resolution: 64}}, "
            f"{{images_dir: {tmp_path / 'hi'}, resolution: 128, resolution_type: shorter_edge}}]"
        ],
    )
    specs = {datasets.key(cfg.data, d): bucket_spec(d, FACTS) for d in datasets.datasets_of(cfg.data)}
    assert specs["lo"].resolution == 64 and specs["hi"].resolution_type == "shorter_edge"
    shapes, keys = {}, {"lo": set(), "hi": set()}
    for s in discover(cfg.data).sources:
        with Image.open(s.uri) as img:
            p = buckets.plan(*img.size, specs[s.dataset], salt=s.rel_path)
        shapes.setdefault(p.key, set()).add(p.latent_shape)
        keys[s.dataset].add(p.key)
    assert all(len(v) == 1 for v in shapes.values())
    assert not keys["lo"] & keys["hi"]


def test_fsspec_filesystems_work_for_discovery():
    import fsspec

    mem = fsspec.filesystem("memory")
    for name in ("x/a.png", "x/b.png"):
        with mem.open(f"/rayflux-test/{name}", "wb") as f:
            Image.new("RGB", (64, 64)).save(f, format="PNG")
    mem.pipe("/rayflux-test/x/a.txt", b"from memory")
    cfg = config.load(None, ["data.images_dir=memory://rayflux-test/x"])
    found = discover(cfg.data)
    assert {s.rel_path: s.caption for s in found.sources} == {"a.png": "from memory", "b.png": "b"}
    assert storage.read_bytes(found.sources[0].uri)[:4] == b"\x89PNG"
    mem.rm("/rayflux-test", recursive=True)


def _generation(gen_dir, parts) -> dict:
    """A committed generation written by the cache stage's own write tasks (no Ray needed to call them), holding
    ``parts``: (sample ids, dataset, latent fill value) each. Latent 1 x 2 x 2 for bucket 16x16 means a VAE downscale
    of 8; t5 rows of length 1."""
    import dataclasses

    from rayflux.cache import index, writer
    from rayflux.families.flux1 import text_tensors
    from rayflux.discovery.caption_hash import caption_id

    zeros = lambda n: np.zeros(n, np.float32).tobytes()  # noqa: E731
    layout = shards.ShardLayout("samples", "float32", latent_channels=1, vae_scale_factor=8, text=text_tensors(1))
    cid = caption_id("")
    text = {
        "caption_id": [cid],
        "caption": [""],
        "t5_len": [1],
        "t5_dim": [2],
        "clip_dim": [2],
        "text_dtype": ["float32"],
        "t5": [zeros(2)],
        "clip_pooled": [zeros(2)],
        "encode_id": ["e"],
    }
    tmeta = writer.write_text(text, str(gen_dir), dataclasses.replace(layout, kind="text"), 0)
    samples, captions = index.Sink("samples"), index.Sink("captions", layout.text)
    captions.add(index.from_ipc(tmeta["index"][0]))
    files = []
    for ids, dataset, fill in parts:
        n = len(ids)
        batch = {
            "sample_id": ids,
            "uri": [f"/src/{s}" for s in ids],
            "rel_path": ids,
            "dataset": [dataset] * n,
            "bucket": ["16x16"] * n,
            "caption": [""] * n,
            "caption_id": [cid] * n,
            "source_sha256": ["0"] * n,
            "size": [1] * n,
            "mtime_ns": [1] * n,
            "orig_w": [16] * n,
            "orig_h": [16] * n,
            "latent_c": [1] * n,
            "latent_h": [2] * n,
            "latent_w": [2] * n,
            "latent_dtype": ["float32"] * n,
            "latent": [np.full(4, fill, np.float32).tobytes()] * n,
            "encode_id": ["e"] * n,
            "skip_reason": [""] * n,
            "reuse": [False] * n,
            "ref_count": [0] * n,
            "ref_sha256": [""] * n,
            "ref_latent": [b""] * n,
        }
        meta = writer.write_samples(batch, str(gen_dir), layout, 0)
        assert not meta["error"][0], meta["error"]
        samples.add(index.from_ipc(meta["index"][0]))
        files.append({"path": meta["path"][0], "rows": n, "bytes": meta["bytes"][0]})
    manifest = {
        "files": files,
        "text_files": [{"path": tmeta["path"][0], "rows": 1, "bytes": tmeta["bytes"][0]}],
        "layout": layout.to_json(),
        "empty_caption": captions.empty,
    }
    manifest["index"] = {"samples": samples.commit(str(gen_dir)), "captions": captions.commit(str(gen_dir))}
    generations.commit(str(gen_dir), manifest, [], "0123456789abcdef")
    return generations.load_manifest(str(gen_dir))


def test_repeats_and_regularisation_weights_reach_the_batches(tmp_path):
    cfg = config.load(
        None,
        [
            "data.reg_loss_weight=0.25",
            "data.datasets=[{name: main, images_dir: /m, repeats: 3}, {name: reg, images_dir: /r, regularisation: true}]",
        ],
    )
    # The latent's value tells the datasets apart inside a stacked batch: main rows hold 1.0, the reg row 5.0.
    gen = _generation(tmp_path / "key" / "g00000-abc", [(["m0", "m1"], "main", 1.0), (["r0"], "reg", 5.0)])
    refs = datasets.mix(batching.index_samples(gen), datasets.sample_weights(cfg.data))
    assert sorted((r.sample_id, r.weight) for r in refs) == [("m0", 1.0)] * 3 + [("m1", 1.0)] * 3 + [("r0", 0.25)]
    planned, dropped = batching.plan_epoch(refs, batch_size=7, seed=1, epoch=0, world_size=1)
    assert dropped == 0 and len(planned) == 1
    # Seed 1 puts the reg sample mid-batch, in another file than its neighbours: weights must follow it.
    assert [r.sample_id for r in decode_planned(planned[0]["refs"])].index("r0") < 6
    batch = batching.load_batch({**planned[0], "step": 1, "total_steps": 1})
    latents = np.frombuffer(batch["latent"], np.float32).reshape(json.loads(batch["latent_shape"]))
    weights = json.loads(batch["weights"])
    assert batch["size"] == 7 and len(weights) == 7
    assert [float(x) for x in latents[:, 0, 0, 0]].count(1.0) == 6
    assert [0.25 if x == 5.0 else 1.0 for x in latents[:, 0, 0, 0]] == weights


def test_samples_of_an_unlisted_dataset_are_refused(tmp_path):
    cfg = config.load(None, ["data.datasets=[{name: main, images_dir: /m}]"])
    refs = batching.index_samples(_generation(tmp_path / "key" / "g00000-abc", [(["x0"], "gone", 0.0)]))
    with pytest.raises(ValueError, match="dataset 'gone', which the config does not list"):
        datasets.mix(refs, datasets.sample_weights(cfg.data))


def test_sidecars_match_extensions_in_any_case(tmp_path):
    """IMG_0001.PNG takes IMG_0001.TXT (cameras write upper case); a lone .TXT is reported as an orphan."""
    root = tmp_path / "photos"
    root.mkdir()
    Image.new("RGB", (64, 64)).save(root / "IMG_0001.PNG")
    (root / "IMG_0001.TXT").write_text("a red barn")
    (root / "IMG_0002.TXT").write_text("no image for this one")
    found = discover(config.load(None, [f"data.images_dir={root}"]).data)
    assert [s.caption for s in found.sources] == ["a red barn"]
    assert [p for p in found.problems if "caption file without an image" in p] == [
        "dataset photos: caption file without an image: IMG_0002.TXT"
    ]


def test_files_differing_only_by_case_are_refused(tmp_path):
    from rayflux.discovery.captions import CaptionError

    root = tmp_path / "photos"
    root.mkdir()
    for name in ("cat.png", "Cat.png"):
        Image.new("RGB", (64, 64)).save(root / name)
    with pytest.raises(CaptionError, match="Cat.png and cat.png differ only by case"):
        discover(config.load(None, [f"data.images_dir={root}"]).data)
