"""Gemma 3's options of the one model (decoderlab.model, attention, config): a sliding layer's KV cache keeps its
last W keys only (a ring) and still gives the full forward's logits -- one token at a time, in chunks that wrap the
ring, left-padded; the window masks exactly the keys W or more positions back; the embedding scale is rounded to the
embedding's dtype as transformers rounds it; bad layer settings are refused naming the field. (Parity with
transformers: tests/hf; the float64 reference: tests/glassbox; the engine, batches and the compiled step:
tests/generation.)"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, make_model

import decoderlab as dl
from decoderlab.attention import KVCache, window_mask
from decoderlab.model import embed_scale


def gemma(seed: int = 0) -> dl.DecoderOnlyTransformer:
    return make_model("gemma-sliding", "sdpa", seed=seed)  # float64, window 3 of max_len 12


def test_a_sliding_layer_s_cache_keeps_its_window_only_and_decoding_equals_the_forward():
    model = gemma()
    ids = torch.randint(0, model.config.num_tokens, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model)
        steps = torch.cat([model(ids[:, i:i + 1], cache=cache) for i in range(12)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-9)  # (the ring sums its keys in another order)
    widths = [layer.k.size(2) for layer in cache.layers]
    assert widths == [3, 12, 3]  # the sliding layers hold W = 3 columns, the full one the whole context
    assert cache.layers[0].key_start is None  # (wrapped: read as a ring)


@pytest.mark.parametrize("chunks", [(5, 7), (2, 2, 8), (1, 4, 3, 4), (3, 9)])
def test_prefills_in_chunks_over_a_wrapped_ring_equal_the_forward(chunks):
    """A chunk after the ring wrapped reads the held keys in order, then its own, and keeps the last W."""
    model = gemma(1)
    ids = torch.randint(0, model.config.num_tokens, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache, out, at = KVCache.for_model(model), [], 0
        for n in chunks:
            out.append(model(ids[:, at:at + n], cache=cache))
            at += n
    # (the ring sums its keys in another order)
    torch.testing.assert_close(torch.cat(out, dim=1), full, rtol=1e-9, atol=1e-9)


def test_left_padded_rows_decode_over_the_ring_as_each_alone():
    model = gemma(2)
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, model.config.num_tokens, (n,), generator=gen).tolist() for n in (2, 6)]
    batch = dl.generate_batch(model, rows, 9, temperature=0)
    assert batch == [dl.generate(model, r, 9, temperature=0, use_cache=False) for r in rows]


def test_the_window_is_what_makes_the_logits():
    """Without the window (every key seen) the logits past W positions differ; within W they do not."""
    model = gemma(3)
    ids = torch.randint(0, model.config.num_tokens, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with_window = model(ids)
        for block in model.blocks:
            block.attention.sliding_window = None
        without = model(ids)
    assert torch.equal(with_window[:, :3], without[:, :3]) and (with_window[:, 3:] - without[:, 3:]).abs().max() > 1e-6


def test_the_window_mask_hides_the_keys_w_or_more_positions_back():
    mask = window_mask(4, 6, 3)  # the last 4 queries (positions 2..5) over keys 0..5
    want = torch.tensor([[j <= i - 3 for j in range(6)] for i in range(2, 6)])
    assert torch.equal(mask, want) and window_mask(6, 3, 3) is None and window_mask(6, 6, None) is None


def test_the_embedding_scale_is_rounded_to_the_embedding_s_dtype():
    assert float(embed_scale(640, torch.zeros(1, dtype=torch.bfloat16))) == 25.25  # sqrt(640) = 25.298...
    assert float(embed_scale(640, torch.zeros(1))) == float(torch.tensor(640 ** 0.5, dtype=torch.float32))


def test_each_layer_has_its_window_and_rope_base():
    cfg = make_model("gemma-sliding", "sdpa").config
    assert [cfg.window_of(i) for i in range(3)] == [3, None, 3]
    assert [cfg.rope_theta_of(i) for i in range(3)] == [50.0, 500.0, 50.0]
    mistral = dl.preset("baby-shakespeare", **{**FAMILIES["llama-gqa"], "sliding_window": 4})
    assert [mistral.window_of(i) for i in range(2)] == [4, 4]  # no layer_types: every layer slides


@pytest.mark.parametrize("fields,words", [
    (dict(layer_types=("sliding_attention",)), "layer_types must be empty or one of"),
    (dict(layer_types=("sliding_attention", "chunked", "full_attention")), "layer_types must be empty or one of"),
    (dict(sliding_window=0), "'sliding_attention' layers but sliding_window is 0"),
    (dict(sliding_window=-1), "sliding_window must be an integer >= 0"),
    (dict(norm="layernorm"), "sandwich_norm=True puts an RMSNorm after attention and the MLP"),
    (dict(query_pre_attn_scalar=-1.0), "query_pre_attn_scalar must be a finite number >= 0"),
    (dict(rope_local_theta=float("inf")), "rope_local_theta must be a finite number >= 0"),
    (dict(embed_scale=1), "embed_scale must be True or False"),
])
def test_bad_layer_settings_are_refused_naming_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        dl.preset("baby-shakespeare", **{**FAMILIES["gemma-sliding"], **fields})
