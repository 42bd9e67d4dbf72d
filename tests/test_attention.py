"""decoderlab.attention's KV cache: rows kept out of a batch step on as they would in the whole batch."""

import pytest
import torch
from tiny_models import make_model, one_thread  # noqa: F401 -- one_thread: autouse

from decoderlab.attention import KVCache


@pytest.mark.parametrize("family", ["llama-gqa", "gemma-sliding"])
def test_rows_kept_out_of_a_cache_step_on_as_in_the_whole_batch(family):
    """Three prompts prefilled together; rows 0 and 2 kept: their next step's logits are the whole batch's rows
    0 and 2 (full attention and gemma's sliding rings), and only the written columns were copied."""
    model = make_model(family, "sdpa", seed=4).eval()
    n = model.config.n_layer
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 1, 2, 3], [4, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        whole, kept = KVCache.for_model(model), KVCache.for_model(model)
        model(tokens, cache=whole)
        model(tokens, cache=kept)
        kept.keep_rows(torch.tensor([0, 2]))
        assert [layer.k.size(0) for layer in kept.layers] == [2] * n
        nxt = torch.tensor([[3], [5], [9]])
        want = model(nxt, cache=whole)[[0, 2]]
        got = model(nxt[[0, 2]], cache=kept)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="static KV cache keeps its batch rows"):
        KVCache(n, 16, static=True).keep_rows(torch.tensor([0]))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("masked", [False, True])
def test_a_wide_one_token_step_is_two_products_equal_to_sdpa(heads, kv_heads, masked):
    """From MATMUL_DECODE_ROWS rows a one-token step's attention is two batched products: the same as
    ``F.scaled_dot_product_attention`` (float32, 1e-5; float64, 1e-12) -- grouped-query heads, a padding
    mask, a row whose keys are all masked (zeros), a given scale -- and fewer rows keep the fused kernel."""
    import torch.nn.functional as F

    from decoderlab import attention
    from decoderlab.attention import MATMUL_DECODE_ROWS, sdpa_attention

    gen = torch.Generator().manual_seed(0)
    b, t, d = MATMUL_DECODE_ROWS + 3, 17, 8
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        q = torch.randn(b, heads, 1, d, generator=gen, dtype=dtype)
        k, v = (torch.randn(b, kv_heads, t, d, generator=gen, dtype=dtype) for _ in range(2))
        mask = None
        if masked:
            mask = torch.arange(t).view(1, 1, 1, t) < torch.randint(0, 5, (b, 1, 1, 1), generator=gen)
            mask[3] = True  # row 3 sees no key
        kk, vv = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        for scale in (None, 0.3):
            want = F.scaled_dot_product_attention(q, kk, vv, attn_mask=None if mask is None else ~mask, scale=scale)
            if mask is not None:
                want[3] = 0
            assert attention._matmul_decode(q, mask, 0.0, False)
            got = sdpa_attention(q, k, v, mask, enable_gqa=True, scale=scale)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not attention._matmul_decode(q[: MATMUL_DECODE_ROWS - 1], mask, 0.0, False)
    assert not attention._matmul_decode(q.float().bfloat16(), mask, 0.0, False)
