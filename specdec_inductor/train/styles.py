"""Prompts by style: the evaluation set that `benchmarks/bench_styles.py` reports per style,
held out from the training corpus at the template level (no template, topic or code task of
corpus.py occurs in it; tests/test_styles.py checks), and the seed task types and topics a
style-covering training corpus is generated from (`style_training_prompts`), disjoint from the
evaluation set in the same sense.

Styles: code (several languages; write, explain, fix, convert, test), structured output (JSON,
YAML, markdown tables, lists, CSV), rewriting (summarise, translate, change tone, repeat with
changes), short factual answers, multi-turn chat and math word problems. A prompt is one user
turn, or a conversation (a list of chat messages) for multi-turn chat.
"""
import random
import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Union

Messages = List[Dict[str, str]]

STYLES = ("code", "structured", "rewrite", "short", "chat", "math")


@dataclass(frozen=True)
class StylePrompt:
    style: str
    name: str
    content: Union[str, tuple]  # one user turn, or ((role, text), ...) ending with a user turn

    def messages(self) -> Messages:
        if isinstance(self.content, str):
            return [{"role": "user", "content": self.content}]
        return [{"role": role, "content": text} for role, text in self.content]

    def text(self) -> str:
        """Every turn's text, for the overlap checks."""
        return "\n".join(m["content"] for m in self.messages())


_GO_SUM = ("func total(xs []int) int {\n    t := 0\n    for i := 1; i <= len(xs); i++ {\n"
           "        t += xs[i]\n    }\n    return t\n}")
_JS_LOOP = ("const names = [];\nfor (let i = 0; i < users.length; i++) {\n"
            "  if (users[i].active) {\n    names.push(users[i].name.toUpperCase());\n  }\n}")
_SQL = ("SELECT d.title, COUNT(e.id) AS staff\nFROM departments d\n"
        "LEFT JOIN employees e ON e.dept_id = d.id\nGROUP BY d.title\nHAVING COUNT(e.id) > 5\n"
        "ORDER BY staff DESC;")
_TS_SLUG = ("export function slugify(title: string): string {\n  return title\n    .toLowerCase()\n"
            "    .trim()\n    .replace(/[^a-z0-9]+/g, '-')\n    .replace(/^-|-$/g, '');\n}")

EVAL_PROMPTS: List[StylePrompt] = [
    # code: languages and task types the corpus never asks for
    StylePrompt("code", "go-fix", f"This Go function panics. Find the bug and fix it:\n\n{_GO_SUM}"),
    StylePrompt("code", "js-to-py", "Convert this JavaScript to idiomatic Python using a list "
                "comprehension:\n\n" + _JS_LOOP),
    StylePrompt("code", "sql-explain", f"What does this SQL query return? Walk through each "
                f"clause.\n\n{_SQL}"),
    StylePrompt("code", "bash-write", "Write a bash script that renames every .jpeg file in "
                "the current directory to .jpg and prints how many it renamed."),
    StylePrompt("code", "ts-jest", f"Write Jest test cases for this TypeScript helper:\n\n{_TS_SLUG}"),
    StylePrompt("code", "kotlin-class", "Create a Kotlin data class for a parcel with a "
                "tracking code, weight in kg, destination and a delivered flag, plus a function "
                "that marks it as delivered."),
    # structured output
    StylePrompt("structured", "json-recipe", "Return a JSON object describing a pancake recipe "
                "with the keys \"name\", \"servings\", \"ingredients\" (a list of objects with "
                "\"item\" and \"amount\") and \"steps\". Output only the JSON."),
    StylePrompt("structured", "yaml-compose", "Write a docker-compose YAML file with a postgres "
                "service and a web service built from the current directory that depends on "
                "it and publishes 8000 on the host."),
    StylePrompt("structured", "md-table", "Make a markdown table of Paris, Berlin, Madrid "
                "and Rome with columns for country, approximate population and the river "
                "that flows through it."),
    StylePrompt("structured", "csv-inventory", "Produce a CSV with the header "
                "sku,product,quantity,price for six office supplies. No explanation, just "
                "the CSV."),
    StylePrompt("structured", "checklist", "Give me a packing checklist for a three-day "
                "hiking trip, grouped under the headings Clothing, Food and Gear, as a "
                "bulleted list."),
    # rewriting
    StylePrompt("rewrite", "summarise", "Summarise the following in two sentences:\n\nThe "
                "town council met on Tuesday to discuss the proposed bus lane on Harbour "
                "Street. Shop owners argued that removing parking would hurt their sales, "
                "while cyclists and commuters said the lane would cut journey times and make "
                "the street safer. After three hours of debate, the council voted to run a "
                "six-month trial and to survey businesses before and after."),
    StylePrompt("rewrite", "translate", "Translate into French: \"The meeting has been moved "
                "to Thursday at ten. Please bring the signed contract and your laptop.\""),
    StylePrompt("rewrite", "tone", "Rewrite this message so it sounds polite and "
                "professional:\n\n\"hey, ur report is late AGAIN. send it today or i'm "
                "telling the boss.\""),
    StylePrompt("rewrite", "repeat-change", "Repeat the following list exactly, but replace "
                "every occurrence of 'Monday' with 'Friday':\n\n1. Monday: team standup at "
                "9:00\n2. Monday: review pull requests\n3. Tuesday: client call\n4. Monday: "
                "deploy to staging\n5. Wednesday: write release notes"),
    StylePrompt("rewrite", "simplify", "Rephrase this for a general audience: \"The "
                "aforementioned remuneration shall be disbursed upon satisfactory completion "
                "of the deliverables specified herein.\""),
    # short factual answers
    StylePrompt("short", "capital", "What is the capital of Australia?"),
    StylePrompt("short", "author", "Who wrote the novel Pride and Prejudice?"),
    StylePrompt("short", "boiling", "At what temperature does water boil at sea level, in "
                "Celsius?"),
    StylePrompt("short", "legs", "How many legs does an insect have?"),
    StylePrompt("short", "largest-ocean", "Which is the largest ocean on Earth? Answer in one "
                "word."),
    # multi-turn chat
    StylePrompt("chat", "trip", (("user", "I'm planning a weekend in Lisbon."),
                                 ("assistant", "Lovely choice! Are you more interested in food, "
                                               "history or nightlife?"),
                                 ("user", "Mostly food. What should I try?"))),
    StylePrompt("chat", "plant", (("user", "My basil plant keeps wilting."),
                                  ("assistant", "Sorry to hear that. How often do you water it, "
                                                "and does it get direct sunlight?"),
                                  ("user", "Every day, and it sits on a dark shelf."))),
    StylePrompt("chat", "gift", (("user", "I need a present for my sister, she turns 30 next week."),
                                 ("assistant", "Happy to help. What does she enjoy?"),
                                 ("user", "She likes hiking and reading mystery novels. "
                                          "My budget is about 40 euros."))),
    StylePrompt("chat", "interview", (("user", "I have a job interview tomorrow."),
                                      ("assistant", "Good luck! What role is it for?"),
                                      ("user", "A junior data analyst position. How should I "
                                               "prepare tonight?"))),
    # math word problems
    StylePrompt("math", "arrival", "A bus leaves at 2:15 pm and travels 180 km at 60 "
                "km per hour. At what time does it arrive?"),
    StylePrompt("math", "discount", "A jacket costs 80 dollars and is on sale for 25% off. "
                "What is the sale price?"),
    StylePrompt("math", "ages", "Tom is three times as old as his son. In 12 years he will be "
                "twice as old. How old is the son now?"),
    StylePrompt("math", "paint", "A room is 5 m long, 4 m wide and 3 m high. How many square "
                "metres of wallpaper cover the walls if the door takes up 2 square metres?"),
    StylePrompt("math", "workers", "Three workers build a fence in 6 hours. How long would "
                "four workers take at the same rate?"),
]


def eval_prompts(styles: Sequence[str] = STYLES) -> List[StylePrompt]:
    """The evaluation prompts of the given styles, in EVAL_PROMPTS order."""
    unknown = [s for s in styles if s not in STYLES]
    if unknown:
        raise ValueError(f"argument 'styles': unknown {unknown}; styles are {list(STYLES)}")
    return [p for p in EVAL_PROMPTS if p.style in styles]


def encode_prompt(tokenizer, prompt: StylePrompt) -> List[int]:
    """Token ids of the prompt's conversation through the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(prompt.messages(), add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# -- overlap with the training corpus ---------------------------------------------------------
def _topic_patterns(topic: str) -> List[str]:
    """Whole-word patterns of a corpus topic (without a leading 'the'; plurals also singular)."""
    core = re.sub(r"^the ", "", topic.lower())
    forms = {core}
    if len(core) > 4:  # singulars: -s, -es, -ies
        forms |= ({core[:-1]} if core.endswith("s") else set()) | (
            {core[:-2]} if core.endswith("es") else set()) | (
            {core[:-3] + "y"} if core.endswith("ies") else set())
    return [r"\b" + re.escape(f) + r"\b" for f in forms]


def _template_fragments(template: str) -> List[str]:
    """The fixed text of a corpus template around its slot, pieces of three words or more."""
    pieces = re.split(r"\{\w\}", template)
    return [p.strip(" ,.?").lower() for p in pieces if len(p.split()) >= 3]


def corpus_overlaps(text: str, templates: Sequence[str], topics: Sequence[str],
                    code_tasks: Sequence[str]) -> List[str]:
    """What of the given templates, topics and code tasks occurs in `text` (empty: none)."""
    low = text.lower()
    found = [f"template {t!r}" for t in templates
             for frag in _template_fragments(t) if frag in low]
    found += [f"topic {t!r}" for t in topics
              if any(re.search(p, low) for p in _topic_patterns(t))]
    found += [f"code task {c!r}" for c in code_tasks if c.lower() in low]
    return found
