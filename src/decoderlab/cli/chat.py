"""``decoderlab chat``: talk with a model, turn by turn, with slash commands that change the settings."""

from __future__ import annotations

import argparse
import sys

from ..config.defaults import DEFAULT_TEMPERATURE
from .argtypes import number
from .errors import USAGE, error_message, print_error
from .options import (AOT_OPTIONS, CHECKPOINT_OPTIONS, DEVICE_OPTIONS, EAGER_OPTIONS, SAMPLING_OPTIONS, THREADS_OPTIONS,
                      add_options, given, load_model, set_threads)

#: the slash commands of ``decoderlab chat``: (name, argument, help); the settings are named as their flags
CHAT_COMMANDS = (
    ("/temperature", "T", "sampling temperature (0 = greedy)"),
    ("/top-k", "K", "sample among the K most probable tokens (0 or off: no top-k filter)"),
    ("/top-p", "P", "nucleus sampling, P in (0, 1] (off: no top-p filter)"),
    ("/max-new-tokens", "N", "longest reply, in tokens"),
    ("/seed", "S", "seed the sampling of the next turns (off: fresh entropy)"),
    ("/reset", "", "forget the conversation"),
    ("/help", "", "this help"),
    ("/quit", "", "leave (also /exit, Ctrl-D)"),
)
CHAT_HELP = ("commands (the settings are named as the flags; /top_k, /max_new_tokens ... work too):\n"
             + "\n".join(f"  {f'{name} {arg}'.strip():<19} {text}" for name, arg, text in CHAT_COMMANDS)
             + "\nCtrl-C stops a reply; Ctrl-D, /quit (or Ctrl-C at the prompt) exits.")

DESCRIPTION = ("Talk with a model: each line you type is a turn, and the model's reply continues the conversation. "
               "A chat checkpoint (written by `decoderlab finetune`) renders every turn with its stored template "
               "and drops the oldest turns when the conversation outgrows the context. Slash commands (/help) "
               "change the settings; /quit, /exit or Ctrl-D leave.\n\n" + CHAT_HELP)


def add_chat(p) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_options(p, CHECKPOINT_OPTIONS)
    add_options(p, DEVICE_OPTIONS)
    add_options(p, AOT_OPTIONS)
    add_options(p, EAGER_OPTIONS)
    add_options(p, SAMPLING_OPTIONS, temperature_help="sampling temperature (default: 0 = greedy for pair-trained "
                                                      f"models, else {DEFAULT_TEMPERATURE:g})")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message that opens the conversation, for a chat checkpoint; kept when old turns "
                        "are dropped and after /reset (default: none)")
    p.add_argument("--template", default=None, metavar="NAME",
                   help="the chat template to render the conversation with instead of the checkpoint's own: "
                        "decoderlab, tools, chatml-tools (SmolLM2's ChatML with tool calls), or a *.jinja file; the "
                        "tokenizer must hold its tokens (default: the checkpoint's)")
    p.add_argument("--tools", default=None, metavar="NAMES",
                   help="built-in tools the model may call, comma-separated (calculator); each call and its result "
                        "is shown before the answer; needs a chat template that writes tool calls: the tools or "
                        "chatml-tools template, or a Hugging Face one that writes <tool_call> blocks, as Qwen2.5's "
                        "(SmolLM2-Instruct's ChatML is given chatml-tools) (default: none)")
    p.add_argument("--max-tool-calls", type=number(int, 0), default=3, metavar="N",
                   help="the most tool calls in one turn (default 3)")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_chat)


class ChatExit(Exception):
    """Raised by :func:`chat_command` for ``/quit`` and ``/exit``: the conversation is over."""


class _CommandArgumentError(ValueError):
    """A chat command's argument is not what the command takes (the message says what it takes)."""


def _command_number(typed: str, arg: str, kind, takes: str, maximum=None):
    """``arg`` as ``kind`` (int or float) for the chat command ``/typed``; an integer must be >= 0 (and <=
    ``maximum``). Raises ``_CommandArgumentError``: "/max-new-tokens takes an integer >= 0, got 'abc'"."""
    try:
        value = kind(arg)
    except ValueError:
        value = None
    if value is None or (kind is int and (value < 0 or (maximum is not None and value > maximum))):
        raise _CommandArgumentError(f"/{typed} takes {takes}, got {arg!r}")
    return value


# each setting changes through SamplingParams.replace, which checks it (the library's one check)
def _set_temperature(session, typed: str, arg: str, off: bool) -> str:
    t = _command_number(typed, arg, float, "a number >= 0 (0 = greedy)")
    session.params = session.params.replace(temperature=t)
    return f"(temperature = {t:g})"


def _set_top_k(session, typed: str, arg: str, off: bool) -> str:
    k = None if off else _command_number(typed, arg, int, "an integer >= 0 (0 or off: no top-k filter)")
    session.params = session.params.replace(top_k=k)  # 0 = no top-k filter, as the flag
    k = session.params.top_k
    return f"({typed} off)" if k is None else f"({typed} = {k})"


def _set_top_p(session, typed: str, arg: str, off: bool) -> str:
    p = None if off else _command_number(typed, arg, float, "a number in (0, 1] (off: no top-p filter)")
    session.params = session.params.replace(top_p=p)
    return f"({typed} off)" if p is None else f"({typed} = {p:g})"


def _set_max_new_tokens(session, typed: str, arg: str, off: bool) -> str:
    room = session.model.config.max_len  # a reply never outgrows the model's context
    session.params = session.params.replace(max_new_tokens=_command_number(
        typed, arg, int, f"an integer >= 0 and <= {room} (the model's context, in tokens)", maximum=room))
    return f"({typed} = {session.params.max_new_tokens})"


def _set_seed(session, typed: str, arg: str, off: bool) -> str:
    from ..generation.sampling import MAX_SEED

    seed = None if off else _command_number(typed, arg, int, "an integer in 0 .. 2**63-1 (off: fresh entropy)",
                                            maximum=MAX_SEED)
    session.params = session.params.replace(seed=seed)
    return "(seed off)" if seed is None else f"(seed = {seed})"


def _reset(session, typed: str, arg: str, off: bool) -> str:
    session.reset()
    return "(conversation reset)"


def _quit(session, typed: str, arg: str, off: bool) -> str:
    raise ChatExit


#: the slash commands (lower case, ``_`` read as ``-``) -> what they do to the session
_ACTIONS = {"help": lambda *_: CHAT_HELP, "quit": _quit, "exit": _quit, "reset": _reset,
            "temperature": _set_temperature, "top-k": _set_top_k, "top-p": _set_top_p,
            "max-new-tokens": _set_max_new_tokens, "seed": _set_seed}


def chat_command(session, line: str) -> str | None:
    """Run a ``/command`` of ``decoderlab chat`` on ``session`` (a ``ChatSession``) and return its message, or
    None when ``line`` is not a command. Settings are named as their flags (``/top-k 20``,
    ``/max-new-tokens 50``; the underscore forms work too); see ``CHAT_COMMANDS``.

    Raises:
        ChatExit: ``/quit`` or ``/exit``.
        ValueError: an unknown command, or an argument the command does not take (saying what it takes).
    """
    line = line.strip()
    if not line.startswith("/"):
        return None
    typed, _, arg = line[1:].partition(" ")
    action = _ACTIONS.get(typed.lower().replace("_", "-"))
    if action is None:
        raise ValueError(f"unknown command /{typed}; type /help")
    arg = arg.strip()
    try:
        return action(session, typed, arg, arg.lower() in ("off", "none", ""))
    except _CommandArgumentError:
        raise
    except (ValueError, TypeError) as e:
        raise ValueError(f"/{typed} {arg!r}: {e}") from None


def _chat_turn(session, line: str) -> bool:
    """Stream the reply to ``line``; False after an error line (``decoderlab: error: ...`` on standard error).
    Ctrl-C at any moment of the turn (the prompt's prefill, a piece being written, the generator's cleanup, the
    notes after it) stops this reply only: the conversation goes on (Ctrl-C at the prompt leaves)."""
    wrote = False
    try:
        pieces = session.reply(line)
        try:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
                wrote = True
        finally:
            getattr(pieces, "close", lambda: None)()  # the generators' cleanup here, where Ctrl-C is this turn's
        sys.stdout.write("\n")
        sys.stdout.flush()
        if session.notice:  # what the reply did not say itself: empty, turns dropped, no end of turn
            print(session.notice, file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C during a reply stops the reply; the conversation goes on
        sys.stdout.write(("\n" if wrote else "") + "(reply stopped)\n")
        sys.stdout.flush()
    except (KeyError, ValueError) as e:
        print_error(error_message(e))
        return False
    return True


def _session(args):
    """The conversation: a chat checkpoint's stored template (or ``--template``) renders every turn; else the
    token history."""
    tools, chosen = None, None
    if args.tools is not None or args.template is not None:  # unknown names are refused before the model loads
        from ..chat import get_template, get_tools

        tools = None if args.tools is None else get_tools(args.tools)
        chosen = None if args.template is None else get_template(args.template)
    model, tok, template, _ = load_model(args)
    if chosen is not None:
        template = chosen
        template.end_of_turn_id(tok)  # a tokenizer without the template's tokens: refused now, not at a turn
    options = given(args, SAMPLING_OPTIONS)  # the flags given; the session's defaults for the others
    if tools is not None:
        from ..chat import ToolChatSession, check_tool_template

        if template is None:
            raise ValueError(f"--tools needs a chat template that writes tool calls; {args.checkpoint} has no chat "
                             f"template (give --template chatml-tools, or fine-tune it with that template)")
        template = _tools_template(template, args.checkpoint)
        try:
            check_tool_template(template, tok)
        except ValueError as e:
            raise ValueError(f"--tools: {args.checkpoint}: {e}") from None

        return ToolChatSession(model, tok, template, tools, system=args.system, max_calls=args.max_tool_calls,
                               **options)
    if template is not None:
        from ..chat import TemplateChatSession

        return TemplateChatSession(model, tok, template, system=args.system, **options)
    if args.system is not None:
        raise ValueError(f"--system needs a chat checkpoint (written by `decoderlab finetune`); {args.checkpoint} "
                         f"has no chat template in its meta.json")
    from ..generation import ChatSession

    print(f"({args.checkpoint} has no chat template: each line continues the text so far, as a base model does; "
          f"`decoderlab finetune` makes a chat checkpoint)", file=sys.stderr, flush=True)
    return ChatSession(model, tok, **options)


def _tools_template(template, checkpoint):
    """The template ``--tools`` renders with: SmolLM2-Instruct's ChatML (no tool calls) is given chatml-tools, its
    tool-call extension, which is said once; any other template as it is."""
    from ..chat import tools_template

    chosen = tools_template(template)
    if chosen is not template:
        print(f"({checkpoint}'s chat template {template.name!r} writes no tool calls: --tools renders the "
              f"conversation with {chosen.name!r}, the same ChatML with Qwen2.5's tool calls)", file=sys.stderr,
              flush=True)
    return chosen


def _read_line(interactive: bool) -> str | None:
    """The next line typed; None at the end of the input (Ctrl-D); "" for input that is not UTF-8 (said)."""
    try:
        return input("> " if interactive else "")
    except EOFError:
        if interactive:
            print()
        return None
    except KeyboardInterrupt:  # at the prompt: leave (main prints the one line, exit status 130)
        if interactive:
            print()
        raise
    except UnicodeDecodeError as e:  # bytes on standard input that are not UTF-8
        print(f"error: the input is not UTF-8 text: byte 0x{e.object[e.start]:02x} at byte {e.start} "
              f"({e.reason})", flush=True)
        return ""


def cmd_chat(args) -> int:
    """The conversation, line by line. A line that fails (a reply the model cannot give, a slash command's bad
    argument) is one ``decoderlab: error:`` line and the conversation goes on; read from a pipe, the command
    then ends with exit status 2, so that a script sees it."""
    set_threads(args)
    session = _session(args)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - not on every platform
        pass
    interactive = sys.stdin.isatty()
    if interactive:
        print("decoderlab chat -- /help for commands, /quit or Ctrl-D to leave")
    failed = False
    while (line := _read_line(interactive)) is not None:
        if not line.strip():
            continue
        try:
            message = chat_command(session, line)
        except ChatExit:
            break
        except ValueError as e:
            print_error(e)
            failed = True
            continue
        if message is not None:
            print(message, flush=True)
        elif not _chat_turn(session, line):
            failed = True
    return USAGE if failed and not interactive else 0
