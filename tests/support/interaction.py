"""A user at the keyboard, for tests: Ctrl-C at a training step, lines typed at a prompt. Kept here rather than in a
conftest.py because ``from support.interaction import ...`` resolves to whichever conftest.py pytest imported first."""

import lightning as L


class InterruptAt(L.Callback):
    """A Lightning callback that raises KeyboardInterrupt (Ctrl-C) at the start of step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def type_lines(monkeypatch, lines):
    """Make ``input()`` return ``lines`` one by one (an exception class in the list is raised instead), then
    raise EOFError (Ctrl-D), as a user typing them at ``decoderlab chat`` would."""
    it = iter(lines)

    def fake_input(prompt=""):
        try:
            line = next(it)
        except StopIteration:
            raise EOFError from None
        if isinstance(line, type) and issubclass(line, BaseException):
            raise line
        return line

    monkeypatch.setattr("builtins.input", fake_input)
