"""No float64 on the model's device: Apple's MPS has none, a GPU runs it slowly. A float64 guard (a
``TorchDispatchMode`` recording every float64 op with the Python frame that issued it) runs over a training
step, a validation, the final full evaluation and a fine-tuning (SFT) step; float64 is allowed only inside
the named functions that add up CPU copies. Decoding has its check here too, for the sampler."""

import pytest
import torch
from support.float64 import Float64Guard

from decoderlab.training import TrainConfig, train_lm

#: the functions that may use float64: they add up host (CPU) copies of the device's float32 and int64 parts
HOST_SUMS = ("decoderlab.training.sums.host_column_sums", "decoderlab.training.sums.sum_over_ranks")
SHAPE = dict(d_model=16, n_layer=1, n_head=2, max_len=16)


def _text(shared_dir, n=12000):
    return (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:n]


def test_the_guard_names_float64_outside_the_allowed_functions():
    def allowed_sum(x):
        return x.cpu().double().sum()

    def on_the_device(x):
        return x.double() * 2

    with Float64Guard(allowed=[f"{__name__}.{allowed_sum.__qualname__}"]) as guard:
        x = torch.ones(3)
        allowed_sum(x)
        on_the_device(x)
        x.float().sum()  # float32: not recorded
    assert {op.allowed_by for op in guard.ops} == {f"{__name__}.{allowed_sum.__qualname__}", None}
    assert [op.op for op in guard.violations] == ["_to_copy", "mul"]
    assert all(op.where.function.endswith("on_the_device") for op in guard.violations)
    assert "on_the_device" in guard.report()


def test_training_validation_and_the_final_evaluation_use_no_float64_outside_host_sums(shared_dir, tmp_path):
    """Training steps, validations on a subset (LMMetrics), the full evaluation at the end
    (``evaluation_sums``) and the checkpoints: float64 only where host copies are added."""
    torch.set_num_threads(1)
    cfg = TrainConfig(max_steps=2, batch_size=4, warmup=1, eval_every=1, val_batches=1, val_batch_size=8,
                      log_every=1, full_val_at_end=True, optimizer="muon")
    with Float64Guard(allowed=HOST_SUMS) as guard:
        _, _, s = train_lm(text=_text(shared_dir), out=tmp_path / "run", train_config=cfg, model_overrides=SHAPE,
                           cache_dir=tmp_path / "cache", progress_bar=False, accelerator="cpu", logger=False)
    assert [e["windows"] for e in s.eval_log] == ["subset", "subset", "all"]  # every kind of evaluation ran
    assert not guard.violations, "float64 outside the host sums:\n" + guard.report()
    assert any(op.allowed_by for op in guard.ops)  # the exact sums were made (in float64, on the host)


def test_a_fine_tuning_step_and_its_validation_use_no_float64_outside_host_sums(tmp_path):
    from decoderlab.finetuning import finetune

    torch.set_num_threads(1)
    convs = [[{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]
             for i in range(8)]
    with Float64Guard(allowed=HOST_SUMS) as guard:
        _, _, s = finetune(convs, out=tmp_path / "ft", preset="baby-shakespeare",
                           model_overrides=dict(SHAPE, max_len=32),
                           config_overrides=dict(max_steps=2, batch_size=2, eval_every=1, accumulate=2),
                           eval_prompts=1, progress_bar=False, logger=False, accelerator="cpu")
    assert s.steps == 2 and len(s.val_history) == 2 and s.device == "cpu"  # (the evaluation ran there)
    assert not guard.violations, "float64 outside the host sums:\n" + guard.report()


#: the sampler's uniform draw is float64 today (generation/sampling.py, rewritten in another branch)
SAMPLER_DRAW = "the sampler draws its uniform number in float64 on the model's device (generation.sampling)"


@pytest.mark.xfail(reason=SAMPLER_DRAW, strict=False)
def test_sampled_decoding_uses_no_float64():
    from decoderlab.generation import generate
    from decoderlab.model import DecoderOnlyTransformer, preset

    torch.manual_seed(0)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=30, **SHAPE)).eval()
    with Float64Guard() as guard:
        ids = generate(model, [1, 2, 3], 5, temperature=0.8, top_p=0.9, seed=1)
    assert len(ids) == 5
    assert not guard.violations, "float64 in decoding:\n" + guard.report()
