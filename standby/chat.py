"""Chat messages to prompt text: the checkpoint's chat template, or the built-in one.

A checkpoint whose ``tokenizer_config.json`` has a ``chat_template`` (a Jinja string, the Hugging Face
convention) gets it, rendered with ``messages``, ``add_generation_prompt=True``, ``bos_token`` and
``eos_token``; its text is tokenized without adding special tokens (the template writes them). Any other
checkpoint gets ``ROLE_LINES_TEMPLATE``: one ``role: content`` line per message, then ``assistant:``,
tokenized as a plain prompt. The generated checkpoints carry the same lines after their BOS token as their
template, so every engine (vLLM and SGLang through ``transformers``) renders the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.sandbox

from hotweights.errors import CheckpointError
from hotweights.layout import ROLE_LINES_TEMPLATE


@dataclass(frozen=True)
class ChatTemplate:
    template: jinja2.Template
    special: dict[str, str]  # bos_token and eos_token, as the template may use them
    from_checkpoint: bool  # the template writes special tokens itself

    @classmethod
    def load(cls, model_dir: Path) -> ChatTemplate:
        """The checkpoint's template, or the default one; CheckpointError naming the file if its
        template is not valid Jinja."""
        path = model_dir / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        source = config.get("chat_template")
        special = {k: v for k in ("bos_token", "eos_token") if isinstance(v := config.get(k), str)}
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            template = environment.from_string(source if isinstance(source, str) else ROLE_LINES_TEMPLATE)
        except jinja2.TemplateSyntaxError as exc:
            raise CheckpointError(f"{path}: chat_template is not a Jinja template ({exc})") from None
        return cls(template, special, isinstance(source, str))

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
