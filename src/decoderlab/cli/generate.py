"""``decoderlab generate`` (and its alias ``sample``, which is ``generate --no-stream --echo``): continue a prompt,
or with ``--chat`` answer it as a user message with the checkpoint's chat template."""

from __future__ import annotations

import re
import sys

from ..config.defaults import DEFAULT_TEMPERATURE
from .options import (AOT_OPTIONS, CHECKPOINT_OPTIONS, COMPILE_OPTIONS, DEVICE_OPTIONS, EAGER_OPTIONS, SAMPLING_OPTIONS,
                      THREADS_OPTIONS, add_options, flag, given, load_model, no_chat_template, sampling_params,
                      set_threads)

DESCRIPTION = (
    "Continue a prompt. The lesson's model (statquest, trained on prompt/response pairs) answers its prompt "
    "greedily until <EOS>, as in the lesson (with --chat its reply is sampled as the options say). "
    "`decoderlab sample` is `decoderlab generate --no-stream --echo` (the same options). With --chat the prompt "
    "is a user message and the reply is rendered with the chat template stored in a checkpoint written by "
    "`decoderlab finetune`; it ends at the end of turn. "
    r"--stop understands the backslash escapes \n \t \r \\ \0 \xHH \uHHHH, so --stop '\n\n' stops at a blank line.")


def add_generate(p) -> None:
    p.description = DESCRIPTION
    _add_generate_options(p)


def add_sample(p) -> None:
    p.description = DESCRIPTION
    _add_generate_options(p)
    p.set_defaults(no_stream=True, echo=True)


def _add_generate_options(p) -> None:
    add_options(p, CHECKPOINT_OPTIONS)
    add_options(p, DEVICE_OPTIONS)
    add_options(p, COMPILE_OPTIONS)
    add_options(p, AOT_OPTIONS)
    add_options(p, EAGER_OPTIONS)
    add_options(p, SAMPLING_OPTIONS,
                temperature_help=f"sampling temperature, 0 = greedy (default {DEFAULT_TEMPERATURE:g})")
    add_options(p, THREADS_OPTIONS)
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help=r"stop before this text; backslash escapes such as \n and \t are understood (repeatable; "
                        "default: none)")
    p.add_argument("--no-stream", action="store_true",
                   help="print the continuation at the end (default: stream it as it is produced)")
    p.add_argument("--echo", action="store_true",
                   help="print the prompt followed by its continuation, decoded together (the lesson's model "
                        "then continues the text instead of answering; default: the continuation only)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: one assistant reply with the checkpoint's chat template "
                        "(default: continue the text)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message before the prompt, with --chat (default: none)")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt text (default: a newline, which a language model continues; required with --chat "
                        "and for the lesson's model, which answers a prompt in its vocabulary: what is statquest)")
    p.add_argument("--verbose", action="store_true",
                   help="say on standard error where and how it decodes (device, weight dtype, threads, the CPU's "
                        "instructions, eager or compiled) and, at the end, the time to the first text and in all "
                        "(default: off)")
    p.set_defaults(func=cmd_generate)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "0": "\0", "'": "'", '"': '"', "a": "\a", "b": "\b",
            "f": "\f", "v": "\v"}
_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.|$)", re.S)


def unescape(text: str, flag: str = "--stop") -> str:
    r"""``text`` with the backslash escapes a user types in a shell turned into characters: ``\n`` (newline),
    ``\t``, ``\r``, ``\\``, ``\0``, ``\'``, ``\"``, ``\a``, ``\b``, ``\f``, ``\v``, ``\xHH``, ``\uHHHH`` and
    ``\UHHHHHHHH`` (as in Python string literals). Any other character stands for itself.

    Raises:
        ValueError: an unknown escape (``\q``) or a lone backslash at the end, showing ``text`` as typed.
    """
    def replace(m: re.Match) -> str:
        e = m.group(1)
        if len(e) > 1:
            return chr(int(e[1:], 16))
        if e in _ESCAPES:
            return _ESCAPES[e]
        what = "ends with a lone backslash" if e == "" else f"has an unknown escape \\{e}"
        raise ValueError(rf"{flag} '{text}' {what}; known escapes: \n \t \r \\ \0 \xHH \uHHHH (write \\ for a "
                         "backslash)")

    return _ESCAPE_RE.sub(replace, text)


def stops(typed: list[str] | None, tok) -> list[str] | None:
    """The --stop strings, unescaped and checked against the tokenizer; errors show them as typed."""
    if typed is None:
        return None
    out = []
    for raw in typed:
        stop = unescape(raw)
        if stop == "":
            raise ValueError("--stop '' is empty; give the text to stop before")
        if stop not in getattr(tok, "token_to_id", {}):
            try:
                ids = tok.encode(stop)
            except (KeyError, ValueError) as e:
                msg = e.args[0] if e.args else e
                raise ValueError(f"--stop '{raw}' cannot be encoded by this model's tokenizer: {msg}") from None
            if not ids:
                raise ValueError(f"--stop '{raw}' encodes to no tokens")
        out.append(stop)
    return out


def cmd_generate(args) -> int:
    prompt = args.prompt
    if args.system is not None and not args.chat:
        raise ValueError("--system applies with --chat (a system message of a chat checkpoint's conversation)")
    if args.chat and prompt is not None and not prompt.strip():  # (before the model is read)
        raise ValueError(f"--chat's user message is empty ({prompt!r}); give the message to answer")
    threads = set_threads(args)
    model, tok, template, _ = load_model(args)
    if getattr(args, "verbose", False):
        say_setup(model, threads, args)
    # the lesson's model answers its prompt (the prompt is the user turn of its template), as in the lesson
    if args.chat or (template is not None and template.name == "lesson" and not args.echo):
        return _generate_chat(args, model, tok, template, prompt)
    from ..generation import stream_text
    from ..tokenizers import EOS

    prompt = "\n" if prompt is None else prompt
    # stop strings are matched on the text; <PAD> is never sampled and the end-of-text tokens (<EOS>, a chat
    # template's end of turn) end a language model's text (where the template opens the assistant turn with
    # <EOS>, the lesson's, it separates prompt and answer: the text goes on); with --echo the prompt and its
    # continuation are decoded together, so word tokens keep their separators
    params = sampling_params(args, stop=stops(args.stop, tok),
                             stop_at_eos=getattr(template, "assistant", None) != EOS)
    pieces = stream_text(model, prompt, tok, params, echo=args.echo)  # the text with its start token, if any
    if getattr(args, "verbose", False):
        pieces = timed_pieces(pieces)
    write_pieces(pieces, stream=not args.no_stream)
    say_packages(model, verbose=getattr(args, "verbose", False))
    return 0


def say_packages(model, verbose: bool) -> None:
    """``verbose``: one line on standard error per package loaded from disk (a package compiled in this run was
    said as its compile ended, with its time and where it is kept: ``AOTDecodeStep``'s ``notify``)."""
    step = model.compiled_decode
    for kind, path in getattr(step, "packages", {}).items():
        if verbose and not step.compile_seconds[kind]:
            print(f"decoderlab: loaded the decode step compiled ahead of time from {path}", file=sys.stderr,
                  flush=True)


def say_setup(model, threads: int, args) -> None:
    """``--verbose``: one line on standard error naming the device, the weights' dtype, the threads, the CPU's
    instructions (the ones that decide which dtype decodes fast) and the decode step."""
    from ..devices import cpu_summary
    from ..dtypes import weights_said

    p = next(model.parameters())
    cpu = f"; cpu {cpu_summary()}" if p.device.type == "cpu" else ""
    step = model.compiled_decode
    step = ("eager" if step is None else "ahead of time (torch.export + AOTInductor, static KV cache)"
            if hasattr(step, "packages") else "compiled (torch.compile, static KV cache)")
    print(f"decoderlab: device {p.device}, weights {weights_said(model)}, {threads} intra-op thread(s), "
          f"decode {step}{cpu}", file=sys.stderr, flush=True)


def timed_pieces(pieces):
    """The pieces, then one line on standard error: seconds to the first text (a compiled step's compile
    included) and in all."""
    import time

    start, first = time.perf_counter(), None
    for piece in pieces:
        if first is None:
            first = time.perf_counter() - start
        yield piece
    total = time.perf_counter() - start
    print(f"\ndecoderlab: first text after {first or total:.2f} s, {total:.2f} s in all", file=sys.stderr,
          flush=True)


def _lesson_prompt(args, template, prompt):
    """The lesson's model answering without --chat: greedily, as in the lesson (the sampling options need
    --chat); its prompt may end with the <EOS> the lesson writes after it (the template adds it otherwise)."""
    sampling = [*given(args, SAMPLING_OPTIONS), *(["stop"] if args.stop is not None else [])]
    if sampling:
        raise ValueError(f"{', '.join(flag(o) for o in sampling)} {'does' if len(sampling) == 1 else 'do'} not "
                         "apply: the lesson's model answers greedily until <EOS>, as in the lesson (give --chat to "
                         "sample its reply)")
    if prompt is not None and prompt.split()[-1:] == [template.assistant]:
        prompt = prompt.rsplit(template.assistant, 1)[0]
    return prompt


def write_pieces(pieces, *, stream: bool, tail=lambda: "") -> None:
    """Write text pieces as they come (``stream``) or all at the end, then ``tail()`` and a newline. On Ctrl-C,
    what was produced so far is written before the interrupt goes on (``main`` prints the one line, exit 130)."""
    written: list[str] = []
    try:
        for piece in pieces:
            if stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            else:
                written.append(piece)
    except KeyboardInterrupt:
        sys.stdout.write("".join(written) + "\n")
        sys.stdout.flush()
        raise
    sys.stdout.write("".join(written) + tail() + "\n")


def example_message(tok) -> str:
    """A user message ``tok`` can read, for an error's example: "hello", or where a word vocabulary lacks it (the
    lesson's: what, is, statquest, awesome, <EOS>) its first three words ("what is statquest")."""
    try:
        tok.encode("hello")
        return "hello"
    except (KeyError, ValueError):
        words = [w for w in getattr(tok, "token_to_id", {}) if not re.fullmatch(r"<[^<>]+>", w)]
        return " ".join(words[:3]) or "hello"


def _generate_chat(args, model, tok, template, prompt) -> int:
    """``generate --chat``: one reply to ``prompt`` as a user message (after ``--system``), rendered with the
    checkpoint's template (the renderer fine-tuning used), ending at the end of turn. The lesson's model answers
    so without --chat too (:func:`_lesson_prompt`), and its answer is printed with its <EOS>."""
    from ..chat.replies import context_full_note, stream_chat_reply

    lesson = template is not None and template.name == "lesson"
    if lesson and not args.chat:
        prompt = _lesson_prompt(args, template, prompt)
    not_here = [f for f, given_ in (("--stop", args.stop is not None),
                                    ("--echo", args.echo and args.command != "sample")) if given_]
    if not_here:
        raise ValueError(f"{', '.join(not_here)} {'does' if len(not_here) == 1 else 'do'} not apply with --chat: "
                         f"the reply ends at the chat template's end of turn")
    if template is None:
        raise no_chat_template(args.checkpoint)
    if prompt is None:
        raise ValueError(f"give the user message to answer, e.g. \"{example_message(tok)}\"")
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": prompt}]
    # the template's temperature when none is given: the lesson answers greedily (and prints its <EOS>)
    default = {"temperature": template.default_temperature} if args.temperature is None else {}
    info: dict = {}
    pieces = stream_chat_reply(model, messages, tok, template, sampling_params(args, **default), info=info)
    if getattr(args, "verbose", False):  # the timing line of plain generate --verbose, for the reply
        pieces = timed_pieces(pieces)
    write_pieces(pieces, stream=not args.no_stream,
                 tail=lambda: f"{tok.separator}{template.end}" if lesson and info.get("ended_with_end_of_turn")
                 else "")
    note = context_full_note(info, model.config.max_len)
    if note:
        print(f"decoderlab: {note.strip('()')}", file=sys.stderr)
    say_packages(model, verbose=getattr(args, "verbose", False))
    return 0
