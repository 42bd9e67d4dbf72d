"""Why llguidance: compile time and per-token mask time of a JSON schema against two maintained grammar
libraries installed here -- llguidance (what decoderlab uses) and outlines-core (Outlines' Rust core) -- over
decoderlab's own vocabularies (the tinyshakespeare characters + JSON punctuation, and a byte-level BPE of
1,024 tokens). xgrammar is not measured: it depends on torch and its wheels pin versions that would replace
this project's torch 2.13 CPU build.

Each library walks the same valid JSON text token by token (the greedy longest-match tokenization of a fixed
document), computing the allowed-token mask before every token as a (V,) bool tensor, as generation does
(for llguidance through decoderlab's ``GrammarState.allowed``). Reported: the build (schema
-> grammar compiled for the vocabulary) and the mean mask time per token, best of 3.

Usage: python bench/grammar_libraries.py
"""

from __future__ import annotations

import json
import time

# properties in sorted order: decoderlab's Grammar stores a schema with sorted keys, and both libraries write
# the properties in the schema's order
SCHEMA = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 0, "maximum": 120}, "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["age", "name", "tags"], "additionalProperties": False}
DOC = '{"age": 17, "name": "romeo", "tags": ["a", "c"]}'


def vocabularies():
    import decoderlab as dl

    text = dl.read_corpus()
    char = dl.CharTokenizer(set(text) | set('{}[]":,0123456789'))
    bpe = dl.BPETokenizer.train([text[:200_000] + DOC * 20], 1024)
    return {"char": char, "bpe-1024": bpe}


def best(fn, repeats=3) -> float:
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def with_llguidance(tok, ids):
    from decoderlab.generation.grammar import Grammar, bind_grammar

    n = tok.vocab_size
    build = best(lambda: bind_grammar(Grammar.json_schema(SCHEMA), tok, n))
    bound = bind_grammar(Grammar.json_schema(SCHEMA), tok, n)

    def walk():
        st = bound.state()
        for t in ids:
            assert bool(st.allowed(n)[t])
            st.advance(t)
    return build, best(walk) / len(ids)


def with_outlines_core(tok, ids):
    import outlines_core as oc
    import torch

    n = tok.vocab_size
    specials = set(getattr(tok, "special_ids", ()))
    table: dict[str, list[int]] = {}
    for i in range(n):
        if i not in specials:
            table.setdefault(tok.decode([i]), []).append(i)
    eos = tok.eos_id
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")

    def build_index():
        return oc.Index(regex, oc.Vocabulary(eos, table))
    build = best(build_index)
    index = build_index()

    def walk():  # the allowed ids as the (V,) bool mask generation applies, as decoderlab's llguidance path does
        g = oc.Guide(index)
        for t in ids:
            mask = torch.zeros(n, dtype=torch.bool)
            mask[torch.tensor(g.get_tokens())] = True
            assert bool(mask[t])
            g.advance(t)
    return build, best(walk) / len(ids)


def main() -> None:
    print("| vocabulary | library | build ms | mask per token us |")
    print("|---|---|---:|---:|")
    for name, tok in vocabularies().items():
        ids = tok.encode(DOC)
        assert tok.decode(ids) == DOC
        for lib, fn in (("llguidance", with_llguidance), ("outlines-core", with_outlines_core)):
            build, per = fn(tok, ids)
            print(f"| {name} ({tok.vocab_size}) | {lib} | {1000 * build:.1f} | {1e6 * per:.0f} |", flush=True)


if __name__ == "__main__":
    main()
