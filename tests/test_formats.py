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


def test_preference_rows_become_trl_explicit_prompt_conversations() -> None:
    from slurmft.formats import preference_problem, to_preference

    user, good, bad = ({"role": r, "content": c} for r, c in (("user", "q?"), ("assistant", "a"), ("assistant", "b")))
    want = {"prompt": [user], "chosen": [good], "rejected": [bad]}
    assert to_preference({"prompt": "q?", "chosen": "a", "rejected": "b"}) == want  # explicit, strings
    assert to_preference({"prompt": [user], "chosen": [good], "rejected": [bad]}) == want  # explicit, conversations
    assert to_preference({"chosen": [user, good], "rejected": [user, bad]}) == want  # implicit, conversations
    assert to_preference({"prompt": "q?", "chosen": [user, good], "rejected": [user, bad]}) == want  # UltraFeedback
    assert to_preference({"chosen": "\n\nHuman: q?\n\nAssistant: a", "rejected": "\n\nHuman: q?\n\nAssistant: b"}) == want
    implicit = to_preference({"chosen": "The sky is blue.", "rejected": "The sky is green."})  # TRL's string rule
    assert [implicit[k][0]["content"] for k in ("prompt", "chosen", "rejected")] == ["The sky is", "blue.", "green."]
    assert preference_problem(want) is None
    assert preference_problem(to_preference({"prompt": "q?", "chosen": "", "rejected": "b"})) == "an empty 'chosen'"
    assert preference_problem(to_preference({"prompt": "q?", "chosen": "a", "rejected": "a"})).endswith("the same")
