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


def _whole_training_pool():
    import random
    return {p.text() for p in styles._style_pool(random.Random(0))}


def test_training_prompts_share_no_four_words_with_the_evaluation_set():
    pool = styles.style_training_prompts(len(_whole_training_pool()))
    assert len({p.text() for p in pool}) == len(pool) == len(_whole_training_pool())
    for e in styles.eval_prompts():
        for t in pool:
            assert styles.shared_word_runs(e.text(), t.text()) == [], (e.name, t.text())
    # the check itself
    assert styles.shared_word_runs("What is the capital of Peru?",
                                   "Tell me: what is the capital, of Chile") == [
        "is the capital of", "what is the capital"]  # case and punctuation aside


def test_training_prompts_mix_every_style_and_are_seeded():
    first = styles.style_training_prompts(60, seed=1)
    assert {p.style for p in first} == set(styles.STYLES)
    counts = {s: sum(p.style == s for p in first) for s in styles.STYLES}
    assert max(counts.values()) - min(counts.values()) <= 1  # the styles take turns
    assert [p.text() for p in first] == [p.text() for p in styles.style_training_prompts(60, 1)]
    assert [p.text() for p in first] != [p.text() for p in styles.style_training_prompts(60, 2)]
    with pytest.raises(ValueError, match="'num_prompts'"):
        styles.style_training_prompts(0)


def test_train_draft_corpus_choices():
    from specdec_inductor.train.command import corpus_prompts
    assert corpus_prompts("default", 10, 0) == corpus.training_prompts(10, 0)
    mixed = corpus_prompts("mixed", 10, 0)
    assert sum(isinstance(p, styles.StylePrompt) for p in mixed) == 5
    assert all(isinstance(p, styles.StylePrompt) for p in corpus_prompts("styles", 10, 0))
