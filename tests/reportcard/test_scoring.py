import decoderlab as dl


def test_a_base_model_s_question_starts_with_the_start_token_its_tokenizer_puts_first(llama_directory):
    """A Llama 2 / TinyLlama-style base model (add_bos_token) reads a report-card question as transformers'
    ``tokenizer(question + "\\n")``, <s> first: its greedy reply is the transformers model's after those ids."""
    from hf.families import greedy_tokens

    from decoderlab.reportcard.scoring import MAX_NEW_TOKENS, Checkpoint, greedy
    from decoderlab.tasks import Item

    path, hf, auto = llama_directory
    m = dl.load(path)
    ck = Checkpoint(m.model.eval(), m.tokenizer, None)
    question = "What is 12 + 7?"
    ids = auto(question + "\n")["input_ids"]
    assert ids[0] == auto.bos_token_id and ck.prompt(question) == ids
    new = greedy_tokens(hf, ids, MAX_NEW_TOKENS)
    ended = next((i for i, t in enumerate(new) if t == auto.eos_token_id), len(new))  # generate stops at </s>
    want = auto.decode(new[:ended], skip_special_tokens=True).strip().split("\n")[0]
    (off,), on = greedy(ck, [Item(question, "19", "add", 0, "exact", "held-out")], MAX_NEW_TOKENS)
    assert want and on is None and off["reply"] == want
