"""Chat messages to prompt text: the checkpoint's template when it has one, else the built-in one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotweights.errors import CheckpointError
from hotweights.standby.chat import ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
CHECKPOINT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("config", "text", "from_checkpoint"),
    [
        (None, "system: Be brief.\nuser: Hi\nassistant:", False),
        ({"bos_token": "<s>"}, "system: Be brief.\nuser: Hi\nassistant:", False),
        ({"bos_token": "<s>", "chat_template": CHECKPOINT_TEMPLATE}, "<s><system>Be brief.<user>Hi<assistant>", True),
    ],
)
def test_the_template_renders_the_messages(
    tmp_path: Path, config: dict | None, text: str, from_checkpoint: bool
) -> None:
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(tmp_path)
    assert (template.render(MESSAGES), template.from_checkpoint) == (text, from_checkpoint)


@pytest.mark.unit
def test_a_template_that_is_not_jinja_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat_template is not a Jinja template"):
        ChatTemplate.load(tmp_path)
