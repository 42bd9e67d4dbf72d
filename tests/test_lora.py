"""LoRA through PEFT: the adapted model's logits equal the merged model's, the trainable count is the formula's,
the merged model is an ordinary checkpoint, the adapter saves alone, and bad ranks/targets are refused. QLoRA-style
over GGUF blocks: the same loss curve as over the float model of the dequantized weights, the same adapter keys, a
float merge."""

import pytest
import torch
from safetensors.torch import load_file

from decoderlab.checkpoint import load_checkpoint, save_checkpoint
from decoderlab.generation import generate
from decoderlab.lora import (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, BLOCK_MERGE, adapter_state_dict, apply_lora,
                             has_lora, load_adapter, lora_parameter_count, lora_target_names, merge_lora,
                             save_adapter, trainable_parameters)
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.quant import dequantized_state_dict, is_block_layer, quantize_model
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import LitModel, TrainConfig, make_trainer

D, FF = 16, 40


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def base(seed=0, **over):
    torch.manual_seed(seed)
    cfg = dict(num_tokens=12, d_model=D, n_layer=2, n_head=2, max_len=16, d_ff=FF)
    return DecoderOnlyTransformer(preset("baby-shakespeare", **{**cfg, **over}))


@pytest.mark.parametrize("targets", ["attn", "mlp", "attn,mlp"])
@pytest.mark.parametrize("rank", [1, 4])
def test_trainable_parameter_count_is_the_formula(targets, rank):
    model = apply_lora(base(), rank, targets=targets)
    per_block = {"attn": rank * (D + 3 * D) + rank * (D + D),  # qkv: 16 -> 48, proj: 16 -> 16
                 "mlp": rank * (D + FF) + rank * (FF + D)}  # fc: 16 -> 40, proj: 40 -> 16
    want = 2 * sum(per_block[t] for t in targets.split(","))
    assert trainable_parameters(model) == want == lora_parameter_count(base(), rank, targets)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert isinstance(model, DecoderOnlyTransformer) and has_lora(model)


def test_lora_logits_equal_the_merged_models_and_the_merged_model_is_ordinary(tmp_path):
    model = apply_lora(base(), 4, alpha=8, targets="attn,mlp", init=False).eval()  # random A and B: not a no-op
    x = torch.randint(0, 12, (3, 10))
    plain = base().eval()
    assert (model(x) - plain(x)).abs().max() > 1e-2
    merged = merge_lora(model)
    assert type(merged) is DecoderOnlyTransformer and not has_lora(merged) and has_lora(model)
    assert (model(x) - merged(x)).abs().max() < 1e-6
    assert list(merged.state_dict()) == list(plain.state_dict())
    assert trainable_parameters(merged) == merged.num_parameters()
    tok = CharTokenizer.from_text("abcdefghij")
    save_checkpoint(tmp_path / "merged", merged, tok)
    loaded, _ = load_checkpoint(tmp_path / "merged")
    assert (loaded(x) - model(x)).abs().max() < 1e-6
    # the KV-cache engine runs on the adapted model and gives the merged model's tokens
    assert generate(model, [3, 4], 6, temperature=0) == generate(merged, [3, 4], 6, temperature=0)


def test_the_adapter_saves_alone_and_loads_onto_the_base(tmp_path):
    model = apply_lora(base(), 2, targets="attn", init=False).eval()
    out = save_adapter(tmp_path / "adapter", model)
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]
    weights = load_file(str(out / ADAPTER_WEIGHTS_FILE))
    assert sum(t.numel() for t in weights.values()) == trainable_parameters(model)
    again = load_adapter(out, base()).eval()
    x = torch.randint(0, 12, (2, 8))
    assert torch.equal(again(x), model(x))


@pytest.mark.parametrize("rank, match", [
    (0, "LoRA rank must be an integer >= 1, got 0"),
    (-2, "LoRA rank must be an integer >= 1"),
    (2.5, "LoRA rank must be an integer >= 1"),
    (17, r"LoRA rank 17 is larger than layer blocks\.0\.attention\.qkv \(16 -> 48 features\) allows; the rank "
         r"must be at most 16"),
])
def test_a_rank_of_zero_or_larger_than_the_layer_is_refused(rank, match):
    with pytest.raises(ValueError, match=match):
        apply_lora(base(), rank)


def test_targets_naming_no_layer_are_refused():
    with pytest.raises(ValueError, match="unknown LoRA target 'head'; allowed: attn, mlp"):
        apply_lora(base(), 2, targets="attn,head")
    with pytest.raises(ValueError, match="LoRA target 'mlp' names no layer of this model"):
        apply_lora(base(mlp="none"), 2, targets="mlp")
    with pytest.raises(ValueError, match="must name at least one"):
        apply_lora(base(), 2, targets=" , ")
    assert lora_target_names(base(attn_out_proj=False), "attn") == ["blocks.0.attention.qkv", "blocks.1.attention.qkv"]
    model = apply_lora(base(), 2)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, 2)
    with pytest.raises(ValueError, match="dropout must be in"):
        apply_lora(base(), 2, dropout=1.0)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_a_lora_model_changes_only_the_adapters(optimizer):
    model = apply_lora(base(), 4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(0)
    batches = [(x[:, :-1], x[:, 1:]) for x in [torch.randint(0, 12, (4, 9), generator=g)] * 8]
    cfg = TrainConfig(max_steps=8, batch_size=4, lr=1e-2, warmup=0, log_every=1, eval_every=100, optimizer=optimizer)
    trainer = make_trainer(cfg, None, accelerator="cpu", progress_bar=False, logger=False, checkpointing=False)
    trainer.fit(LitModel(model, cfg), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
        else:
            assert not torch.equal(p, adapters[n]), n


LLAMA = dict(position="rope", rope_layout="rotate_half", norm="rmsnorm", mlp="swiglu", n_head=4, n_kv_head=2,
             head_dim=6, qkv_bias=True, qk_norm=True, qk_norm_gain=True)


def test_the_llama_familys_layers_are_targets_and_merge_back():
    """A Llama-shaped model (grouped-query attention with heads of 6, SwiGLU): "attn" adapts the one qkv
    projection (16 -> (4 + 2 x 2) x 6 = 48) and proj (24 -> 16), "mlp" the gate beside up (fc) and down (proj);
    the count is the formula's, the merged model is an ordinary one with the adapted logits, and the KV-cache
    engine gives its tokens."""
    names = lora_target_names(base(**LLAMA), "attn,mlp")
    assert [n for n in names if n.startswith("blocks.0.")] == [
        "blocks.0.attention.qkv", "blocks.0.attention.proj", "blocks.0.mlp.fc", "blocks.0.mlp.gate", "blocks.0.mlp.proj"]
    rank = 2
    per_block = rank * (D + 48) + rank * (24 + D) + 2 * rank * (D + FF) + rank * (FF + D)
    assert lora_parameter_count(base(**LLAMA), rank, "attn,mlp") == 2 * per_block
    model = apply_lora(base(**LLAMA), rank, targets="attn,mlp", init=False).eval()
    assert trainable_parameters(model) == 2 * per_block
    x = torch.randint(0, 12, (3, 10))
    plain = base(**LLAMA).eval()
    assert (model(x) - plain(x)).abs().max() > 1e-2
    merged = merge_lora(model)
    assert list(merged.state_dict()) == list(plain.state_dict())
    assert (model(x) - merged(x)).abs().max() < 1e-5
    assert generate(model, [3, 4], 8, temperature=0) == generate(merged, [3, 4], 8, temperature=0)


# ---------------------------------------------------------------------------------------------------------
# QLoRA-style: adapters over a base held in GGUF blocks
# ---------------------------------------------------------------------------------------------------------

V = 64  # (every width a multiple of 32, the blocks' size: d_model 64, d_ff 128, the tied output layer's 64)


def bases():
    """The same tiny model twice: its linear layers (and the tied output layer) in q8_0 blocks, and the float model
    holding exactly their dequantized weights."""
    torch.manual_seed(0)
    cfg = preset("baby-shakespeare", num_tokens=V, d_model=64, n_layer=2, n_head=2, max_len=32, d_ff=128)
    blocks = quantize_model(DecoderOnlyTransformer(cfg), "q8_0")
    flt = DecoderOnlyTransformer(cfg)
    flt.load_state_dict(dequantized_state_dict(blocks))
    return blocks, flt


def block_and_float(seed=1, **lora):
    """:func:`bases` with the same adapters on both (A -- and B with ``init=False`` -- drawn from ``seed``)."""
    lora = {"rank": 4, "alpha": 8, "targets": "attn,mlp", **lora}
    out = []
    for model in bases():
        torch.manual_seed(seed)
        out.append(apply_lora(model, **lora).train())
    return out


def arithmetic_rows(n=64, length=17):
    """Rows of ``(k * i + s) mod V``: a pattern the adapters can learn (the loss falls), seeded."""
    g = torch.Generator().manual_seed(0)
    return torch.stack([(torch.arange(length) * k + s) % V for k, s in torch.randint(1, 7, (n, 2), generator=g).tolist()])


def train(model, steps=40, lr=1e-2):
    """AdamW on the adapters over the same batches of 4 rows: the loss of every step."""
    rows = arithmetic_rows()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for i in range(steps):
        b = rows[i * 4 % len(rows):][:4]
        loss = model.compute_loss((b[:, :-1], b[:, 1:]))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if i == 0:  # only the adapters take gradients (the blocks are buffers; the norms and embedding frozen)
            assert {n for n, p in model.named_parameters() if p.grad is not None} == \
                {n for n, p in model.named_parameters() if "lora_" in n}
        opt.step()
    return torch.tensor(losses)


def test_the_sft_loss_in_row_slices_over_a_tied_block_vocabulary_equals_the_whole_loss(monkeypatch):
    """SFT's supervised_ce over a q8_0 tied embedding and output layer: slices of 2 rows of logits (the output
    layer's product through the kernels, its gradient through the dequantized slices, recomputed in the backward
    pass) give the loss, the correct count and the adapters' gradients of all the rows at once, to float32
    rounding (the slices' sums in another order)."""
    from decoderlab.finetuning.sft import supervised_ce
    from decoderlab.training import rows as rows_module

    model, _ = block_and_float(init=False)
    batch = arithmetic_rows(n=3, length=9)
    x, y = batch[:, :-1], batch[:, 1:].clone()
    y[:, :3] = -100  # (a prompt: not scored)
    trained = [p for p in model.parameters() if p.requires_grad]
    results = []
    for chunk_bytes in (1 << 30, 2 * 4 * V):  # (one slice of all 15 rows; slices of 2 rows)
        monkeypatch.setattr(rows_module, "HEAD_CHUNK_BYTES", chunk_bytes)
        ce, correct = supervised_ce(model, x, y, accuracy=True)
        results.append((ce, correct, torch.autograd.grad(ce, trained)))
    (whole, right, grads), (ce, correct, chunked) = results
    torch.testing.assert_close(ce, whole, rtol=1e-6, atol=0)
    assert int(correct) == int(right)
    for g, h in zip(chunked, grads):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6 * float(h.abs().max()))


def test_lora_over_blocks_trains_as_over_the_float_model_of_its_dequantized_weights():
    """The kernels quantize the activations to 8 bits (q8_0's products; the gradient goes through the dequantized
    weight, exactly the float model's): the first loss agrees to 1e-3 (measured 8e-6), and after 40 AdamW steps
    the curves stay within 0.05 nats of each other step by step (measured 0.040) -- under the spread of the float
    model's own curves for two other draws of A (0.07-0.11 measured, 2026-12-06) --, their last 10 steps' means
    within 0.5% (measured 0.19%); the loss fell by more than 0.2 nats on both."""
    blocks, flt = block_and_float()
    assert sum(is_block_layer(m.get_base_layer()) for m in blocks.modules() if hasattr(m, "lora_A")) == 8
    packed = {n: b.clone() for n, b in blocks.named_buffers() if "packed" in n}
    a, b = train(blocks), train(flt)
    assert abs(a[0] - b[0]) < 1e-3
    assert (a - b).abs().max() < 0.05, (a - b).abs().max()
    assert abs(a[-10:].mean() / b[-10:].mean() - 1) < 0.005
    assert a[-10:].mean() < a[0] - 0.2 and b[-10:].mean() < b[0] - 0.2
    assert all(torch.equal(b, packed[n]) for n, b in blocks.named_buffers() if "packed" in n)  # the base untouched


def test_an_adapter_trained_over_blocks_loads_onto_the_float_base_and_back(tmp_path):
    """The adapter keys are the float base's: saved from the block model, loaded onto the float base (and one saved
    from the float model onto the blocks) it is the same adapter; the block model merges into a float32 model
    whose logits are the float base's with the adapter; merging into the blocks in place is refused, saying what
    to do instead."""
    blocks, flt = block_and_float(init=False)  # random A and B: no no-op adapter
    save_adapter(tmp_path / "from_blocks", blocks)
    save_adapter(tmp_path / "from_float", flt)
    assert (tmp_path / "from_blocks" / ADAPTER_CONFIG_FILE).read_text() == \
        (tmp_path / "from_float" / ADAPTER_CONFIG_FILE).read_text()
    block_base, float_base = bases()
    float_loaded = load_adapter(tmp_path / "from_blocks", float_base).eval()
    block_loaded = load_adapter(tmp_path / "from_float", block_base).eval()
    for loaded in (float_loaded, block_loaded):
        got, want = adapter_state_dict(loaded), adapter_state_dict(blocks)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert any(is_block_layer(m) for m in block_loaded.modules())
    x = arithmetic_rows(3)[:, :16]
    merged = merge_lora(blocks.eval())
    assert type(merged) is DecoderOnlyTransformer and not any(is_block_layer(m) for m in merged.modules())
    assert list(merged.state_dict()) == list(bases()[1].state_dict())
    torch.testing.assert_close(merged(x), float_loaded(x), atol=1e-5, rtol=0)
    # (the blocks' own product quantizes the activations to 8 bits: close to the float logits, not equal)
    assert 0 < (blocks(x) - merged(x)).abs().max() < 0.05
    layer = blocks.get_submodule("blocks.0.attention.qkv")
    with pytest.raises(ValueError, match="not merged into them in place: the sum would be requantized") as e:
        layer.merge()
    assert str(e.value) == BLOCK_MERGE and "merge_lora returns the merged model in float32" in BLOCK_MERGE
