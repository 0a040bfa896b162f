"""Where weights live: a local ``model.path`` missing on the driver says so; an ``s3://`` one is copied to local disk
once per node, however many processes ask at the same time (through the loopback S3 server)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from rayflux import models, storage
from rayflux.config import ModelConfig


def test_a_missing_local_model_path_names_the_driver(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="no such directory on this machine; the job reads the model's configs on the driver"
    ):
        models.model_facts(ModelConfig(path=str(tmp_path / "not-here")))


def _resolve(uri: str) -> tuple[str, int]:
    path = models.resolve_path(ModelConfig(path=uri))
    return path, os.stat(Path(path) / "vae" / "diffusion_pytorch_model.safetensors").st_ino


def test_an_s3_model_path_is_copied_once_per_node(s3_bucket, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFLUX_MODEL_CACHE", str(tmp_path / "models"))
    fs, inner = storage.resolve(f"{s3_bucket}/flux")
    pafs.copy_files(str(tiny_model), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    uri = f"{s3_bucket}/flux"

    facts = models.model_facts(ModelConfig(path=uri))  # configs only: the driver never pulls the weights
    local = models.model_facts(ModelConfig(path=str(tiny_model)))
    assert (facts.vae_scale_factor, facts.latent_channels, facts.text_length) == (
        local.vae_scale_factor,
        local.latent_channels,
        local.text_length,
    )
    assert facts.identity != local.identity  # a different source is a different cache identity
    [copy_dir] = (tmp_path / "models").glob("*/")
    assert not list(copy_dir.rglob("*.safetensors"))

    with mp.get_context("spawn").Pool(3) as pool:
        results = pool.map(_resolve, [uri] * 3)
    assert len({r for r in results}) == 1  # one directory, one copy of the weights (same inode everywhere)
    vae = models.load_vae(ModelConfig(path=uri), "cpu", torch.float32)
    reference = models.load_vae(ModelConfig(path=str(tiny_model)), "cpu", torch.float32)
    for (name, a), (_, b) in zip(vae.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
