"""Capture on tiny GPT-2, Llama and Mamba models: batched = one at a time = output_hidden_states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from updatelens.capture import capture, capture_batches, kept_mask
from updatelens.models import ADAPTERS, largest_module_list, locate_blocks

SLUGS = ["tiny-gpt2", "tiny-llama", "tiny-neox", "tiny-mamba"]


def ids(n: int = 4, t: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, 500, size=(n, t))


@pytest.mark.parametrize("slug", SLUGS)
def test_batched_capture_equals_one_sequence_at_a_time(tiny_models: dict, slug: str) -> None:
    lm = tiny_models[slug]
    x = ids()
    mask = np.ones_like(x)
    batched = capture(lm, x, mask, batch_size=4)
    single = capture(lm, x, mask, batch_size=1)
    assert batched.states.shape == (lm.n_layers + 1, 4, 12, lm.d_model)
    np.testing.assert_allclose(batched.states, single.states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slug", SLUGS)
def test_capture_streams_batches_and_stops_after_the_last_needed_block(tiny_models: dict, slug: str) -> None:
    lm = tiny_models[slug]
    x = ids(n=5)
    full = capture(lm, x, np.ones_like(x), batch_size=5).states
    batches = list(capture_batches(lm, x, np.ones_like(x), batch_size=2, last_block=0))
    assert [b.start for b in batches] == [0, 2, 4]
    early = np.concatenate([b.states for b in batches], axis=1)
    assert early.shape == (2, 5, 12, lm.d_model)  # h_0 and h_1: transition 0 only
    np.testing.assert_allclose(early, full[:2], rtol=1e-5, atol=1e-5)
    again = capture(lm, x, np.ones_like(x), batch_size=5).states  # no hook left behind
    np.testing.assert_array_equal(again, full)


@pytest.mark.parametrize("slug", SLUGS)
def test_captured_states_equal_raw_output_hidden_states(tiny_models: dict, slug: str) -> None:
    lm = tiny_models[slug]
    x = ids(2, 10, 1)
    cap = capture(lm, x, np.ones_like(x), batch_size=2)
    with torch.inference_mode():
        out = lm.model(input_ids=torch.as_tensor(x), output_hidden_states=True)
    hs = out.hidden_states
    offset = lm.hidden_states_offset  # hs[i] is h_{i + offset}
    assert len(hs) == lm.n_layers + 1
    for i in range(len(hs) - 1):  # all but the last, which has the final norm applied
        np.testing.assert_allclose(cap.states[i + offset], hs[i].numpy(), rtol=1e-5, atol=1e-5)
    assert not np.allclose(cap.states[-1], hs[-1].numpy(), atol=1e-3)  # the raw last block output


def test_adapters_and_fallback_find_the_same_blocks(tiny_models: dict) -> None:
    for slug in SLUGS:
        lm = tiny_models[slug]
        name, blocks, _ = locate_blocks(lm.model)
        assert name in ADAPTERS
        path, fallback = largest_module_list(lm.model)
        assert fallback is blocks, f"{slug}: fallback found {path}"


def test_mamba_is_never_padded(tiny_models: dict) -> None:
    lm = tiny_models["tiny-mamba"]
    x = ids(2, 8)
    mask = np.ones_like(x)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="unpadded"):
        capture(lm, x, mask)


def test_kept_mask_drops_position_zero_and_padding() -> None:
    mask = np.array([[1, 1, 1, 0]])
    assert kept_mask(mask, True).tolist() == [[False, True, True, False]]
    assert kept_mask(mask, False).tolist() == [[True, True, True, False]]
