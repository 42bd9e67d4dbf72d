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
