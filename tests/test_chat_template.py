"""slurmft.chat_template: the rules validate and the job share, with one wording."""

from __future__ import annotations

from pathlib import Path

from slurmft import chat_template as ct


def test_template_path_rule(tmp_path: Path) -> None:
    good = tmp_path / "t.jinja"
    good.write_text("{{ messages }}")
    assert ct.template_path_problem(str(good)) is None
    assert "only a .jinja/.j2 template file" in ct.template_path_problem("meta-llama/Llama-2-7b-chat-hf")
    assert "does not exist" in ct.template_path_problem(str(tmp_path / "missing.j2"))


def test_generation_markers() -> None:
    assert ct.has_generation_markers("{% for m in messages %}{%- generation -%}{{ m }}{% endgeneration %}{% endfor %}")
    assert not ct.has_generation_markers("{% for m in messages %}{{ m }}{% endfor %}")


def test_messages_name_the_fix() -> None:
    assert "train.sft.chat_template_path" in ct.no_template_message("/tok")
    assert ct.no_markers_message("org/tok").startswith("data.assistant_only_loss needs {% generation %} markers")
    msg = ct.cannot_render_message("data.datasets[0] (x.jsonl)", 3, ValueError("no system role"))
    assert msg.startswith("data.datasets[0] (x.jsonl): the chat template cannot render conversation 3 "
                          "(ValueError: no system role)")
