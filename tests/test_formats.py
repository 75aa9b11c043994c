"""slurmft.formats: the row formats both validate and the job read (pure, no datasets library)."""

from __future__ import annotations

from slurmft import formats


def test_lima_and_guanaco_map_to_messages() -> None:
    assert formats.lima_to_messages(["q", "a", "q2", "a2"]) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
    ]
    text = "### Human: Hi there.### Assistant: Hello!### Human: Bye.### Assistant: Bye!"
    assert formats.guanaco_to_messages(text) == [
        {"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Bye!"},
    ]


def test_normalize_merges_repeated_roles_and_drops_unanswered_turns() -> None:
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": " "},
            {"role": "assistant", "content": "c"}, {"role": "user", "content": "left hanging"}]
    assert formats.normalize(msgs) == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]
