"""What a fine-tuning method is to :func:`~decoderlab.finetuning.finetune`: its parts (:class:`Method`), chosen
once by name, and the run as a method sees it (:class:`Job`).

Each method is one room that ends with its ``Method`` (:data:`decoderlab.finetuning.sft.SFT`,
:data:`decoderlab.finetuning.dpo.DPO`); :data:`decoderlab.finetuning.run.METHODS` maps the names to them. A new
method is a new room and one line of that table (and its name in ``decoderlab.config.FINETUNE_METHODS``, which
``--help`` reads without torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..chat import ChatTemplate
from ..tokenizers import Tokenizer
from ..training import Run
from .start import pad_id_for


@dataclass
class Job:
    """One fine-tuning run as its method sees it, once every refusal is behind it.

    Attributes:
        run: the run directory and its ``TrainConfig`` (:class:`decoderlab.training.Run`).
        tokenizer, template: the model's tokenizer (with the template's tokens) and the chat template.
        max_len: the context the rows are cut to (the model's ``max_len``).
        start: what run.json records of the starting point (``checkpoint``, ``preset``, ``added_tokens``,
            ``lora``, ``trainable_parameters``).
        options: the method's own settings (DPO's ``beta``), as :attr:`Method.options` resolved them.
        train_items, val_items: what the method loaded (conversations or preference pairs), trained on / held out.
        reference: the starting model, frozen, for a method that trains against it (else None).
        eval_options: the held-out evaluation's settings (SFT's ``max_new_tokens``, ``max_prompts``).
    """

    run: Run
    tokenizer: Tokenizer
    template: ChatTemplate
    max_len: int
    start: dict
    options: dict
    train_items: list
    val_items: list
    reference: torch.nn.Module | None = None
    eval_options: dict = field(default_factory=dict)

    @property
    def pad_id(self) -> int:
        """The padding id of the tokenizer under the template (never the end of turn;
        :func:`~decoderlab.finetuning.start.pad_id_for`)."""
        return pad_id_for(self.tokenizer, self.template)


@dataclass(frozen=True)
class Method:
    """The parts of one fine-tuning method, in the order :func:`~decoderlab.finetuning.finetune` calls them.

    Attributes:
        name: the method's name (``method=`` and ``--method``; recorded in run.json and meta.json).
        option_names: the settings of this method alone (DPO's ``("beta",)``); ``finetune`` refuses another
            method's, naming the method it applies to.
        options: ``options(run, given) -> dict``: those settings from ``given`` (None: not given), defaults
            filled and a resume's own kept.
        read_data: ``read_data(run, data, val_data, val_fraction) -> (what run.json records, training items,
            held-out items)``, refusing on a resume data other than the run's.
        texts: ``texts(items) -> conversations``: the text a tokenizer must represent (and one built from
            scratch learns).
        train: ``train(job, model) -> (datamodule, Lightning module)``; the datamodule holds the training and
            held-out rows (``.train``, ``.val``).
        summarize: ``summarize(job, trainer, exporter, seconds) -> (model, summary)``: the held-out evaluation
            and the export on the training device, the summary (and summary.json).
        closing: ``closing(summary) -> str``: the run's last line on the terminal ("fine-tuned for N steps;
            ..." with the held-out evaluation).
        reference: whether the method trains against the starting model, frozen (``Job.reference``).
    """

    name: str
    option_names: tuple[str, ...]
    options: Callable[[Run, dict], dict]
    read_data: Callable[..., tuple[dict, list, list]]
    texts: Callable[[list], list]
    train: Callable[[Job, torch.nn.Module], tuple[Any, Any]]
    summarize: Callable[..., tuple]
    closing: Callable[[Any], str]
    reference: bool = False
