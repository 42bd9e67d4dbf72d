"""bench/recipe_real.py's SFT data on a tiny SmolLM2-like base (a random llama in a GGUF file with SmolLM2's
ChatML; nothing downloaded): the conversations open with the system turn ``chat --tools calculator`` writes,
call the calculator in the chatml-tools layout, and a LoRA run on them trains with chatml-tools -- on the call
and the answer only."""

import json
import sys
from pathlib import Path

import pytest
from tiny_runs import one_thread, tiny_cfg  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import TOOLS, calculate, load_model, parse_hermes_calls, tools_template
from decoderlab.finetuning import finetune
from decoderlab.lora import lora_settings
from decoderlab.tasks import generate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe_real():
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe_real

    return recipe_real


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from hf_chat_templates import SMOLLM2
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    texts = [json.dumps(TOOLS["calculator"].definition), "You are a helpful AI assistant named SmolLM, trained by "
             "Hugging Face. A box holds 24 pens; how many pens are in 17 boxes? <tool_call> </tool_call> "
             "<tool_response> </tool_response> 0123456789 + - * = ."]
    bpe = byte_level_bpe(400, texts=texts * 3)
    model = hf_model("llama", bpe.get_vocab_size(), max_position_embeddings=2048)
    return write_gguf(tmp_path_factory.mktemp("base") / "smol.gguf", "llama", model, bpe, chat_template=SMOLLM2)


def test_the_tool_system_turn_renders_as_the_calculator_offered(recipe_real, smollm2_gguf):
    _, tok, template, _ = load_model(smollm2_gguf)
    system, t = recipe_real.tool_system(template), tools_template(template)
    item = generate("word_problem", "train", 1, seed=0, difficulty=2)[0]
    question = [{"role": "user", "content": item.question}]
    offered = t.render(question, tok, add_generation_prompt=True, tools=recipe_real.calculator_definitions())[0]
    assert t.render([{"role": "system", "content": system}] + question, tok, add_generation_prompt=True)[0] == offered
    assert "<tools>" in system and '"name": "calculator"' in system


def test_a_lora_run_on_the_mix_trains_the_calls_in_the_chatml_tools_layout(recipe_real, smollm2_gguf, tmp_path):
    _, tok, template, _ = load_model(smollm2_gguf)
    system = recipe_real.tool_system(template)
    convs = recipe_real.sft_conversations(24, system, {"Hi!": "Hello! How can I help?"}, seed=0)
    calling = [c for c in convs if any(m.get("tool_calls") for m in c)]
    assert calling and len(calling) < len(convs)  # the tool conversations and plain chat
    _, _, s = finetune(convs, out=tmp_path / "run", checkpoint=smollm2_gguf, lora=lora_settings(4),
                       train_config=tiny_cfg(max_steps=1, batch_size=4), val_fraction=0, eval_prompts=0,
                       progress_bar=False, logger=False, accelerator="cpu")
    assert s.template == "chatml-tools"
    run = load_model(tmp_path / "run")
    for conv in calling[:5]:
        ids, mask = run.template.render(conv, run.tokenizer)
        question, answer = conv[1]["content"], conv[-1]["content"]
        expression = json.loads(conv[2]["tool_calls"][0]["function"]["arguments"])["expression"]
        call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        text = run.tokenizer.decode(ids)
        assert f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{call}<|im_end|>" in text
        trained = run.tokenizer.decode([i for i, m in zip(ids, mask) if m])
        assert trained == f"{call}<|im_end|>{answer}<|im_end|>"  # the call and the answer, nothing else
        _, (parsed,) = parse_hermes_calls(call)
        assert parsed.name == "calculator" and answer == f"{expression} = {calculate(parsed.arguments)}."


def test_a_card_of_fewer_than_100_questions_and_a_base_without_a_chat_template_are_refused(recipe_real, tmp_path,
                                                                                            capsys):
    with pytest.raises(SystemExit):
        recipe_real.parse(["--base", "x.gguf", "--questions", "99"])
    assert "--questions 99 is under 100" in capsys.readouterr().err
    from tiny_models import tiny_model

    from decoderlab.checkpoint import save_checkpoint

    model, tok = tiny_model()
    save_checkpoint(tmp_path / "lm", model, tok)
    with pytest.raises(SystemExit, match="is not a chat model"):
        recipe_real.load_chat_base(tmp_path / "lm")


def test_greedy_replies_over_the_shared_prefix_equal_generate_batch(recipe_real, smollm2_gguf, monkeypatch):
    """The card's replies prefill the prompts' shared system turn once and batch the rests by length: the same
    tokens as generate_batch on the whole prompts (greedy; a stop at the end of turn, or the cap)."""
    import torch

    from decoderlab.generation import SamplingParams, generate_batch

    model, tok, template, _ = load_model(smollm2_gguf)
    system, t = recipe_real.tool_system(template), tools_template(template)
    questions = [i.question for i in generate("word_problem", "held-out", 5, seed=0)] + ["What is 12 + 7?"]
    prompts = [t.render([{"role": "system", "content": system}, {"role": "user", "content": q}], tok,
                        add_generation_prompt=True)[0] for q in questions]
    assert recipe_real.common_prefix(prompts) > len(tok.encode(system))
    eot = t.end_of_turn_id(tok)
    monkeypatch.setattr(recipe_real, "MIN_GROUP", 1)  # the shared-prefix path, however few prompts a length has
    with torch.no_grad():
        ours = recipe_real.replies(model.eval(), tok, prompts, 12, eot)
        theirs = generate_batch(model, prompts, SamplingParams(max_new_tokens=12, stop=(eot,), temperature=0),
                                tokenizer=tok)
    assert [text for text, _ in ours] == [tok.decode(ids) for ids in theirs]
    assert [ended for _, ended in ours] == [len(ids) < 12 for ids in theirs]


@pytest.mark.parametrize("eval_dtype", ["float32", "bfloat16"])
def test_rows_that_end_leave_the_batch_and_the_replies_stay_generate_batchs(recipe_real, smollm2_gguf, eval_dtype,
                                                                           monkeypatch):
    """Three copies each of two questions, stopped at a token of the first one's reply: its three rows end early
    and leave the batch (the cache rows dropped), the others go on -- every reply still generate_batch's, with the
    card's matrices in float32 and in bfloat16 (float32 activations, as a BF16 file runs)."""
    import torch

    from decoderlab.generation import SamplingParams, generate_batch
    from decoderlab.half import HalfLinear

    model, tok, template = recipe_real.load_scored(smollm2_gguf, eval_dtype)
    assert any(isinstance(m, HalfLinear) for m in model.modules()) == (eval_dtype == "bfloat16")
    with torch.no_grad():  # the random base's greedy replies one token over and over; larger weights vary them
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(6)
    prompts = [template.render([{"role": "user", "content": q}], tok, add_generation_prompt=True)[0]
               for q in ["What is 12 + 7?"] * 3 + ["What is 35 * 4?"] * 3]

    def theirs(stop=None):
        params = SamplingParams(max_new_tokens=12, stop=(stop,) if stop is not None else (), temperature=0)
        return generate_batch(model, prompts, params, tokenizer=tok)

    with torch.no_grad():
        free = theirs()
        stop = next(t for t in free[0][2:] if t not in free[3])  # ends the first question's rows only
        expected = theirs(stop)
        monkeypatch.setattr(recipe_real, "MIN_GROUP", 1)  # the shared-prefix path (_decode), not generate_batch
        ours = recipe_real.replies(model, tok, prompts, 12, stop)
    assert [ended for _, ended in ours] == [True] * 3 + [False] * 3
    assert [text for text, _ in ours] == [tok.decode(ids) for ids in expected]


def test_the_tool_reward_scores_the_first_call_or_else_the_last_number(recipe_real):
    row = {"reference": "373"}
    call = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
    assert recipe_real.tool_reward(call.format("24 * 17 - 35"), row, True) == 1.0
    assert recipe_real.tool_reward(call.format("24 * 17 + 35"), row, True) == 0.0  # the call computes 443
    assert recipe_real.tool_reward(call.format("24 * 17 - 35") + call.format("1 + 1"), row, True) == 1.0
    assert recipe_real.tool_reward("<tool_call>{not json</tool_call> 373", row, True) == 0.0  # a broken call
    assert recipe_real.tool_reward("24 * 17 - 35 = 373.", row, True) == 1.0  # answered without the calculator
    assert recipe_real.tool_reward("It is 372.", row, True) == 0.0


def test_sampled_replies_are_seeded_and_rl_and_its_control_start_from_the_lora_sft_run(recipe_real, smollm2_gguf,
                                                                                       tmp_path):
    """The room's samples repeat with their seed; GRPO with LoRA and the equal-compute SFT both continue a LoRA
    SFT run of the GGUF base (one step each here), and each run loads as a chat checkpoint."""
    import torch

    _, tok, template, _ = load_model(smollm2_gguf)
    system = recipe_real.tool_system(template)
    convs = recipe_real.sft_conversations(8, system, {"Hi!": "Hello! How can I help?"}, seed=0)
    finetune(convs, out=tmp_path / "sft", checkpoint=smollm2_gguf, lora=lora_settings(4), dtype="float32",
             train_config=tiny_cfg(max_steps=1, batch_size=4), val_fraction=0, eval_prompts=0, progress_bar=False,
             logger=False, accelerator="cpu")
    sft = load_model(tmp_path / "sft")
    prompts = [sft.template.render([{"role": "user", "content": "What is 12 + 7?"}], tok,
                                   add_generation_prompt=True)[0]] * 3
    eot = sft.template.end_of_turn_id(tok)
    with torch.no_grad():
        first, again = (recipe_real.replies(sft.model.eval(), tok, prompts, 8, eot, temperature=1.0, seed=3)
                        for _ in range(2))
    assert first == again and len(set(first)) > 1  # the seed fixes the samples; the rows differ
    args = recipe_real.parse(["--base", str(smollm2_gguf), "--max-steps", "1", "--rl-eval-every", "1",
                              "--rl-prompts", "12", "--rl-batch", "2", "--batch", "2", "--lora-rank", "4"])
    row = {"skill": "addition", "difficulty": 2, "mode": "off"}
    assert recipe_real.rl_stage(args, tmp_path, system, row)["steps"] == 1
    assert recipe_real.control_stage(args, tmp_path, system, row, 0.0)["steps"] == 1
    for name in ("rl", "control"):
        run = load_model(tmp_path / name)
        assert run.template.name == "chatml-tools"
        assert json.loads((tmp_path / name / "run.json").read_text())["base"] == str((tmp_path / "sft").resolve())
