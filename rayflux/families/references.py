"""Reference-image conditioning shared by FLUX.1 Kontext and FLUX.2: the edit's reference tokens ride after the
noisy target's in the transformer's image stream, with their own position ids, and only the target's part of the
prediction is kept (the references are context, never denoised)."""

from __future__ import annotations

import torch


def with_references(
    tokens: torch.Tensor, ids: torch.Tensor, ref_tokens: torch.Tensor, ref_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states, img_ids)`` for the transformer: target tokens ``[B, N, C]`` then reference tokens
    ``[B, M, C]``, and their ids ``[N, k]`` then ``[M, k]`` (``[B, N, k]``/``[B, M, k]`` also work)."""
    if tokens.shape[0] != ref_tokens.shape[0] or tokens.shape[2] != ref_tokens.shape[2]:
        raise ValueError(f"reference tokens {tuple(ref_tokens.shape)} do not match target tokens {tuple(tokens.shape)}")
    if ref_ids.shape[-2] != ref_tokens.shape[1]:
        raise ValueError(f"{ref_tokens.shape[1]} reference tokens but {ref_ids.shape[-2]} reference ids")
    return torch.cat([tokens, ref_tokens.to(tokens.dtype)], dim=1), torch.cat([ids, ref_ids.to(ids.dtype)], dim=-2)


def target_prediction(prediction: torch.Tensor, num_target_tokens: int) -> torch.Tensor:
    """The transformer's output for the target tokens only: ``[B, N + M, C] -> [B, N, C]``."""
    return prediction[:, :num_target_tokens]
