"""The style evaluation set (train/styles.py): every style is covered, and no template, topic or
code task of the training corpus (train/corpus.py) occurs in it; the overlap check itself
finds each kind of overlap; multi-turn prompts go through the chat template turn by turn."""
import pytest

from specdec_inductor.train import corpus, styles

CORPUS_TEMPLATES = corpus.TEMPLATES + corpus.CODE_TEMPLATES
CORPUS_TOPICS = corpus.TOPICS + corpus.HELDOUT_TOPICS
CORPUS_TASKS = corpus.CODE_TASKS + corpus.HELDOUT_CODE_TASKS


def _overlaps(text):
    return styles.corpus_overlaps(text, CORPUS_TEMPLATES, CORPUS_TOPICS, CORPUS_TASKS)


def test_every_style_has_prompts_with_distinct_names():
    prompts = styles.eval_prompts()
    assert {p.style for p in prompts} == set(styles.STYLES)
    for style in styles.STYLES:
        assert len(styles.eval_prompts([style])) >= 4, style
    assert len({p.name for p in prompts}) == len(prompts)
    chats = styles.eval_prompts(["chat"])
    assert all(len(p.messages()) >= 3 and p.messages()[-1]["role"] == "user" for p in chats)
    with pytest.raises(ValueError, match="'styles'"):
        styles.eval_prompts(["poetry"])


def test_no_corpus_template_topic_or_code_task_in_the_evaluation_set():
    for p in styles.eval_prompts():
        assert _overlaps(p.text()) == [], p.name
    # nor is any evaluation prompt a training prompt
    everything = set(corpus.training_prompts(len(corpus.TEMPLATES) * len(corpus.TOPICS)
                                             + len(corpus.CODE_TEMPLATES) * len(corpus.CODE_TASKS)))
    assert not {p.text() for p in styles.eval_prompts()} & everything


def test_the_overlap_check_finds_templates_topics_and_code_tasks():
    assert "template 'Write a Python function that {c}.'" in _overlaps(
        "Write a Python function that sorts a deck.")
    assert any("topic 'volcanoes'" == o for o in _overlaps("Is this volcano active?"))  # singular
    assert any("topic 'the Moon'" == o for o in _overlaps("How far away is the moon?"))
    assert any(o.startswith("code task") for o in _overlaps("Show code that reverses a string."))
    assert _overlaps("What is the capital of Australia?") == []
    assert _overlaps("Tell me about volcanology.") == []  # whole words only


def test_multi_turn_prompts_keep_every_turn():
    class Template:  # a tokenizer stand-in: one id per character of 'role:content|'
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            return [ord(c) for m in messages for c in f"{m['role']}:{m['content']}|"]
    p = styles.eval_prompts(["chat"])[0]
    text = "".join(chr(i) for i in styles.encode_prompt(Template(), p))
    assert text.count("user:") == 2 and text.count("assistant:") == 1
    assert p.messages()[1]["content"] in text
