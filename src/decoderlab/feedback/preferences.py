"""An alias for one release: DPO's preference rows are read and rendered by :mod:`decoderlab.finetuning.dpo`
(import from there)."""

from ..finetuning.dpo import (PREFERENCE_FIELDS, PreferencePair, load_preferences, parse_pair,  # noqa: F401
                              render_completion, render_pair)
