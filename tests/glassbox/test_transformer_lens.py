"""The glass box checked against the field's tool: TransformerLens 4 (``TransformerBridge``) on the same GPT-2
weights, nothing downloaded.

A random ``GPT2LMHeadModel`` (biases and norms made non-trivial) is exported by ``decoderlab.hf.to_hf`` with a
BPE tokenizer into a temporary directory and booted offline by ``TransformerBridge.boot_transformers``;
``decoderlab.hf.from_hf`` loads the same weights. Every cached activation, the logit lens, the logit
attributions, the head detectors, the composition scores and two patching tables agree within 1e-5.
"""

import copy
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402

from decoderlab import glassbox as gb  # noqa: E402
from decoderlab.hf import from_hf, to_hf  # noqa: E402
from decoderlab.hooks import hook_names  # noqa: E402
from decoderlab.tokenizers import BPETokenizer  # noqa: E402

TOL = 1e-5
CORPUS = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
          "arrows of outrageous fortune, or to take arms against a sea of troubles.\n") * 4
TEXT = "To be, or not to be, that is the question: To be, or not to be"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, bridge, folded bridge, processed bridge): the same random GPT-2 in decoderlab and in
    TransformerLens; "folded" is in compatibility mode folding the layernorms and nothing else (the numerics
    TransformerLens's attribution assumes), "processed" has compatibility mode's default weight processing."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from transformer_lens.model_bridge import TransformerBridge

        bpe = BPETokenizer.train(CORPUS, 300)
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=bpe.vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                        bos_token_id=bpe.eos_id, eos_token_id=bpe.eos_id)).eval()
        with torch.no_grad():  # Hugging Face initialises biases and norms to 0/1: make every tensor matter
            for name, p in hf.named_parameters():
                if name.endswith("bias") or ".ln_" in name:
                    p.add_(0.1 * torch.randn_like(p))
        ours = from_hf(hf)
        directory = tmp_path_factory.mktemp("tl") / "gpt2"
        to_hf(ours, directory, tokenizer=bpe)
        tok = AutoTokenizer.from_pretrained(directory)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bridge = TransformerBridge.boot_transformers(str(directory), hf_model=copy.deepcopy(hf), tokenizer=tok,
                                                         device="cpu")
            folded = TransformerBridge.boot_transformers(str(directory), hf_model=copy.deepcopy(hf), tokenizer=tok,
                                                         device="cpu")
            folded.enable_compatibility_mode(disable_warnings=True, fold_ln=True, center_writing_weights=False,
                                             center_unembed=False, fold_value_biases=False)
            processed = TransformerBridge.boot_transformers(str(directory), hf_model=copy.deepcopy(hf), tokenizer=tok,
                                                            device="cpu")
            processed.enable_compatibility_mode(disable_warnings=True)
    return ours, bridge, folded, processed


@pytest.fixture(scope="module")
def ids(pair):
    _, bridge, _, _ = pair
    return bridge.to_tokens(TEXT)  # TransformerLens's tokens (its start token first), used on both sides


def test_every_activation_agrees_with_transformer_lens(pair, ids):
    ours, bridge, _, _ = pair
    tl_logits, tl_cache = bridge.run_with_cache(ids)
    logits, cache = gb.run_with_cache(ours, ids)
    assert (tl_logits - logits).abs().max().item() < TOL
    names = hook_names(ours)
    assert len(names) == len(cache) == 38 and set(names) <= set(tl_cache.keys())  # every name is TransformerLens's
    for name in names:
        a, b = cache[name], tl_cache[name]
        assert a.shape == b.shape, name
        if name.endswith("hook_attn_scores"):  # masked: ours -inf, the bridge's float32's lowest
            seen = torch.isfinite(a)
            assert bool((b[~seen] < -1e38).all()), name
            a, b = a[seen], b[seen]
        assert (a - b).abs().max().item() < TOL, name


def test_logit_lens_agrees_with_transformer_lens(pair, ids):
    from transformer_lens.tools.analysis.logit_lens import logit_lens as tl_logit_lens

    ours, bridge, _, _ = pair
    _, tl_cache = bridge.run_with_cache(ids)
    tl = tl_logit_lens(bridge, cache=tl_cache, positions=None)
    lens = gb.logit_lens(gb.run_with_cache(ours, ids)[1])
    assert lens.labels == list(tl.labels) == ["0_pre", "1_pre", "final_post"]
    assert lens.logits.shape == tl.values.shape == (3, 1, ids.size(1), 300)
    assert (lens.logits - tl.values).abs().max().item() < TOL
    assert lens.logits[:-1].std() > 0.01  # the earlier layers' readings are not the final one's
    assert not torch.allclose(lens.logits[0], lens.logits[-1], atol=1e-3)


def test_logit_attributions_agree_with_transformer_lens(pair, ids):
    ours, _, folded, _ = pair
    _, tl_cache = folded.run_with_cache(ids)
    cache = gb.run_with_cache(ours, ids)[1]
    labels, parts = gb.residual_parts(cache)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the next token of every position
    for tokens in (5, targets):
        ours_attr = gb.logit_attrs(cache, parts, tokens)  # (n_parts, B, T)
        heads, head_labels = tl_cache.stack_head_results(return_labels=True)
        tl_heads = tl_cache.logit_attrs(heads, tokens)
        assert head_labels == [s for s in labels if "H" in s]
        assert (tl_heads - ours_attr[[labels.index(s) for s in head_labels]]).abs().max().item() < TOL
        resid, resid_labels = tl_cache.decompose_resid(return_labels=True)
        tl_resid = dict(zip(resid_labels, tl_cache.logit_attrs(resid, tokens)))
        for i in range(2):
            attn = sum(ours_attr[labels.index(f"L{i}H{h}")] for h in range(4)) + ours_attr[labels.index(f"L{i} attn bias")]
            assert (tl_resid[f"{i}_attn_out"] - attn).abs().max().item() < TOL
            assert (tl_resid[f"{i}_mlp_out"] - ours_attr[labels.index(f"L{i} mlp")]).abs().max().item() < TOL
        for name in ("embed", "pos_embed"):
            assert (tl_resid[name] - ours_attr[labels.index(name)]).abs().max().item() < TOL
    # and the whole decomposition adds up to the model's logit, the final norm's bias being TransformerLens's b_U
    d = gb.decompose(cache, -1, 5)
    assert abs(float(d.total()) - float(d.logit)) < TOL
    assert abs(d.as_dict()["final norm bias"] - float(folded.b_U[5])) < TOL


@pytest.mark.parametrize("error_measure", ["mul", "abs"])
@pytest.mark.parametrize("kind", list(gb.KINDS))
def test_head_detectors_agree_with_transformer_lens(pair, ids, kind, error_measure):
    from transformer_lens.head_detector import detect_head

    ours, bridge, _, _ = pair
    for exclude in (False, True):
        tl = detect_head(bridge, TEXT, f"{kind}_head", error_measure=error_measure, exclude_bos=exclude,
                         exclude_current_token=exclude)
        got = gb.head_scores(ours, ids, kind, error_measure=error_measure, exclude_bos=exclude,
                             exclude_current_token=exclude)
        assert got.shape == (2, 4)
        assert (tl.double() - got).abs().max().item() < TOL, exclude
    assert got.abs().max() > 0.01


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_agree_with_transformer_lens(pair, mode):
    ours, _, _, processed = pair
    tl = processed.all_composition_scores(mode).scores.double()
    got = gb.composition_scores(ours, mode)
    assert got.shape == tl.shape == (2, 4, 2, 4)
    assert (tl - got).abs().max().item() < TOL
    assert got[0, :, 1].min() > 0 and got[1].abs().max() == 0  # only earlier layers compose into later ones


def test_patching_tables_agree_with_transformer_lens(pair):
    from transformer_lens import patching

    ours, bridge, _, _ = pair
    clean = bridge.to_tokens("To be, or not")
    corrupt = clean.clone()
    corrupt[0, 2] = 7
    _, clean_cache = bridge.run_with_cache(clean)
    metric = gb.logit_difference(5, 6)
    os.environ.setdefault("TQDM_DISABLE", "1")
    tl = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, clean_cache, metric)
    got = gb.activation_patching(ours, clean, corrupt, metric, over="attn_head", by="layer,head")
    assert (tl.double() - got).abs().max().item() < TOL
    tl = patching.get_act_patch_resid_pre(bridge, corrupt, clean_cache, metric)
    got = gb.activation_patching(ours, clean, corrupt, metric, over="resid_pre", by="layer,pos")
    assert got.shape == (2, clean.size(1)) and (tl.double() - got).abs().max().item() < TOL
    assert got.abs().max() > 1e-3


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_llama_familys_activations_agree_with_transformer_lens(tmp_path, name):
    """Grouped-query attention, SwiGLU, rotate-half rope (and Qwen3's QK-norm gains, heads of 16 beside d_model
    32): a random ``transformers`` model of the family booted offline by ``TransformerBridge`` and the same
    weights in decoderlab (tests/support/hf_llama.py) -- every hook point decoderlab has is one of TransformerLens's
    names, with its shape (``hook_k`` / ``hook_v`` with the n_kv_head heads) and its numbers to 1e-5."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformer_lens.model_bridge import TransformerBridge

    from support.hf_llama import VOCAB, hf_model, ours_of

    hf = hf_model(name)
    ours = ours_of(hf)
    hf.save_pretrained(tmp_path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(tmp_path)
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("HF_HUB_OFFLINE", "1")
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(str(tmp_path), hf_model=copy.deepcopy(hf), device="cpu",
                                                     tokenizer=AutoTokenizer.from_pretrained(tmp_path))
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tl_logits, tl_cache = bridge.run_with_cache(ids)
    logits, cache = gb.run_with_cache(ours, ids)
    assert (tl_logits - logits).abs().max().item() < TOL
    names = hook_names(ours)
    assert "blocks.0.mlp.hook_pre_linear" in names and set(names) <= set(tl_cache.keys())
    assert cache["blocks.0.attn.hook_k"].shape == (2, 10, ours.config.kv_heads, ours.config.d_head)
    for hook in names:
        a, b = cache[hook], tl_cache[hook]
        if hook.endswith(("hook_q_normed", "hook_k_normed")):  # the bridge's Qwen3 keeps these two as (B, H, T,
            b = b.transpose(1, 2)  # d_head); decoderlab's are (B, T, H, d_head) as every per-head point of both
        assert a.shape == b.shape, hook
        seen = torch.isfinite(a)  # (masked scores: ours -inf, the bridge's float32's lowest)
        assert (a[seen] - b[seen]).abs().max().item() < TOL * max(1.0, b[seen].abs().max().item()), hook
