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
import itertools
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


# -- a training corpus covering the styles -----------------------------------------------------
# Seed task types and fillers, crossed as corpus.py crosses its templates and topics (built
# offline; the target's own greedy answers become the data). None of them is an evaluation
# prompt's template, topic, language-and-task or conversation (tests/test_styles.py checks that
# no four-word sequence of an evaluation prompt occurs in any training prompt).
TRAIN_LANGUAGES = ["Python", "C++", "C#", "PHP", "Swift", "Scala", "Ruby", "Lua", "R", "Haskell",
                   "Elixir", "Dart", "Julia", "Perl"]
TRAIN_CODE_OPS = [
    "parse a query string into key-value pairs", "compute a moving average over a window",
    "merge overlapping intervals", "format a byte count as a human-readable size",
    "validate a hex colour code", "count the islands in a grid of zeros and ones",
    "check a card number with the Luhn algorithm", "turn a number of seconds into h:mm:ss",
    "group records by one of their fields", "retry a call with exponential backoff",
    "build a histogram of word lengths", "drop repeated lines from a text",
    "rotate a square matrix by 90 degrees", "find the peak element of an array",
    "encode bytes as base64", "split a full name into first and last name",
    "sum the values of a nested map", "find the earliest and latest timestamp in a log",
    "wrap text at a given line width", "compute a running median",
]
TRAIN_CONCEPTS = ["closures", "generics", "pattern matching", "iterators", "exceptions",
                  "immutability", "interfaces", "higher-order functions", "recursion",
                  "string formatting", "modules and imports", "enums"]
TRAIN_CODE_TEMPLATES = [
    "Write a {lang} function to {op}.",
    "Implement a {lang} program that can {op}, and show how to call it.",
    "Here is my plan: write {lang} code to {op}. What edge cases should the code handle? "
    "Show the finished code.",
    "My {lang} code to {op} gives wrong results for empty input. Show a corrected version "
    "and point out the fix.",
    "Port a short Python routine that can {op} to {lang}, keeping the same behaviour.",
    "Add tests for a {lang} routine meant to {op}: cover normal input and two edge cases.",
    "Describe {concept} in {lang} and give a small example.",
    "Review this idea for {lang}: using {concept} everywhere. When does it help and when "
    "does it hurt?",
]
TRAIN_ENTITIES = [
    ("a hotel reservation", "guest, check_in, nights, room_type"),
    ("a concert ticket", "artist, venue, date, seat, price"),
    ("a bug report", "id, title, severity, steps, assignee"),
    ("a weather forecast", "city, date, high, low, conditions"),
    ("a book review", "book, reviewer, rating, summary"),
    ("a flight", "number, origin, destination, departure, duration_minutes"),
    ("a user profile", "username, email, joined, roles"),
    ("a car for sale", "make, model, year, mileage, price"),
    ("a course syllabus", "course, weeks, topics, assessment"),
    ("a restaurant menu item", "dish, ingredients, price, vegetarian"),
    # added with the second style round
    ("a library loan", "member, title, borrowed, due, renewals"),
    ("a job posting", "title, company, location, salary_range, remote"),
    ("a plant in a garden centre", "species, pot_size, light, watering, price"),
    ("a support ticket", "ticket_id, customer, priority, status, opened"),
    ("a museum exhibit", "name, artist, year, room, on_loan"),
    ("a bank transaction", "date, description, amount, currency, balance"),
    ("a podcast episode", "show, episode, guest, length_minutes, published"),
    ("a gym class", "class_name, instructor, weekday, start_time, capacity"),
    ("a rental apartment", "address, rooms, rent, deposit, available_from"),
    ("a shipping order", "order_id, items, weight_kg, carrier, eta"),
    ("a board game", "title, players, play_time, age, publisher"),
    ("a medication schedule", "medicine, dose, times_per_day, with_food"),
]
TRAIN_STRUCTURED_TEMPLATES = [
    "Give {entity} as JSON with the fields {fields}. Output JSON only.",
    "Write a YAML document holding three examples of {entity} with the fields {fields}.",
    "Create a markdown table with the columns {fields}, filled in for four examples of "
    "{entity}.",
    "Output CSV rows (with a header line {fields}) for five examples of {entity}.",
    "As a numbered list, name the fields {fields} of {entity} and say what each one holds.",
    "Show an XML element for {entity} with child elements {fields}.",
    # added with the second style round
    "Write a TOML config section for {entity} using the keys {fields}.",
    "Return a JSON array of three objects, each {entity} holding {fields}. No prose.",
    "Lay out two examples of {entity} as a markdown bulleted list, one nested bullet per field "
    "({fields}).",
]
TRAIN_SENTENCES = [
    "Our team finished the quarterly budget two days early and under cost.",
    "The library will close at noon on Friday for staff training.",
    "Customers can now return online orders at any of our stores.",
    "The new software update fixes the login problem but slows down the search page.",
    "Heavy rain delayed the harvest, so prices at the market went up.",
    "Please remember to lock the back door when you leave the office.",
    "The museum's new wing opens next spring with a dinosaur exhibit.",
    "After months of practice, the choir won first place at the regional festival.",
    "The factory reduced its water use by a third by recycling cooling water.",
    "Volunteers planted two hundred trees along the river last weekend.",
    "The train strike means many commuters will work from home this week.",
    "Our landlord says the heating will be repaired by Wednesday.",
    # added with the second style round
    "The bakery on the corner now opens at six and sells gluten-free loaves.",
    "Ticket sales for the summer concert doubled after the band announced a second date.",
    "The school will replace its old computers with tablets next term.",
    "Our flight was cancelled, so we spent the night at an airport hotel.",
    "The city plans to add fifty electric buses to its fleet by 2028.",
    "The printer on the third floor is out of toner again.",
    "Sales of winter coats fell because the autumn was unusually warm.",
    "The hospital opened a new children's ward with forty beds.",
    "I forgot my umbrella and got soaked on the way to work.",
    "The committee postponed its decision until the budget is approved.",
    "The bridge will be closed to cars for repairs during August.",
    "Our dog learned to open the fridge and ate the whole cheese.",
]
TRAIN_TONES = ["more formal", "friendlier", "more enthusiastic", "neutral and factual",
               "suitable for a child", "shorter and more direct"]
TRAIN_LANGUAGE_NAMES = ["Spanish", "German", "Italian", "Portuguese", "Dutch",
                        # added with the second style round
                        "Swedish", "Polish"]
TRAIN_REWRITE_TEMPLATES = [
    "Make this sentence {tone}: {sentence}",
    "Put this into {language}: {sentence}",
    "Condense into at most ten words: {sentence}",
    "Turn this statement into a question and then into a headline: {sentence}",
    "Write the sentence below three times, each time swapping one word for a synonym:\n"
    "{sentence}",
    "Expand this into a short paragraph with one more detail: {sentence}",
    # added with the second style round
    "Rewrite in the passive voice where you can: {sentence}",
    "Give two alternative ways of saying this: {sentence}",
    "Write this as a one-line text message to a colleague: {sentence}",
]
# Rewrites of longer texts (added with the second style round): summaries of paragraphs,
# grammar fixes, and copies of a list with one change.
TRAIN_PARAGRAPHS = [
    "The new community garden opened in April on an empty lot behind the station. Residents "
    "rent small beds for a few euros a season, and a local school uses two of them to teach "
    "pupils how vegetables grow. Volunteers hope to add a greenhouse next year if a grant is "
    "approved.",
    "Last month the company moved its support team to a four-day week. Response times stayed "
    "the same, sick days fell by a fifth, and most staff said they felt less tired. Managers "
    "will decide in the autumn whether to extend the scheme to other departments.",
    "Researchers tagged forty sea turtles off the coast to learn where they feed in winter. "
    "Most swam south to warmer water, but six stayed near the harbour all season, which "
    "surprised the team. The data will help decide where fishing nets are banned.",
    "The old cinema on Mill Road will reopen after a two-year restoration. The original seats "
    "were repaired rather than replaced, and a small cafe now fills the former ticket hall. "
    "The first week will show classic films at reduced prices.",
    "A survey of 2,000 commuters found that most would cycle to work if there were safe lanes "
    "and somewhere to shower. Cost was the main reason people gave for driving, followed by "
    "the weather. The council says it will publish a cycling plan in the spring.",
    "Our neighbourhood book club has grown from five members to twenty in a year. We now meet "
    "in the library instead of someone's living room, and each month a different member picks "
    "the book. Next month we are reading a detective story set in Oslo.",
]
TRAIN_SLOPPY = [
    "me and him goes to the shop yesterday but it were closed",
    "their going to announce the results tomorow, wich is to late for us",
    "the datas shows that less people buys newspapers then before",
    "i has three brother and none of them likes football",
    "could you sent me the file's before friday, its urgent",
    "the team have did a grate job on this years report",
]
TRAIN_LISTS = [
    ("Breakfast: oatmeal\nLunch: lentil soup\nSnack: oatmeal bar\nDinner: grilled fish",
     "oatmeal", "porridge"),
    ("- Call the plumber\n- Pay the gas bill\n- Call the dentist\n- Buy stamps",
     "Call", "Email"),
    ("Room 101: Maths\nRoom 102: History\nRoom 103: Maths\nRoom 104: Art", "Maths", "Physics"),
    ("08:00 bus to Leeds\n12:30 bus to York\n17:45 bus to Leeds", "Leeds", "Hull"),
    ("1) red pen\n2) blue folder\n3) red stapler\n4) green marker", "red", "black"),
]
TRAIN_LONG_REWRITE_TEMPLATES = [
    "Summarise this paragraph in one sentence:\n\n{paragraph}",
    "Give the three key points of this text as bullets:\n\n{paragraph}",
    "Write a headline and a one-line teaser for this news item:\n\n{paragraph}",
    "Correct the grammar and spelling: \"{sloppy}\"",
    "Fix the mistakes in this sentence and explain each fix briefly: {sloppy}",
    "Copy this out again with '{old}' changed to '{new}' everywhere, nothing else "
    "changed:\n\n{lines}",
]
TRAIN_FACTS = [
    "What is the chemical symbol for {x}?", "Which continent is {y} in?",
    "What is the official language of {y}?", "What currency is used in {y}?",
    # added with the second style round
    "Who painted {p}?", "In what year did {e}?", "What is the plural of '{w}'?",
    "What is the opposite of '{w}'?", "What does the abbreviation {a} stand for?",
    "How many sides does a {s} have?", "Roughly how far is it from {c}? One line, please.",
    "Name the highest mountain in {y}.",
]
TRAIN_FACT_FILLERS = {"x": ["iron", "sodium", "potassium", "silver", "lead", "tin", "helium",
                            "neon", "copper", "zinc"],
                      "y": ["Peru", "Kenya", "Norway", "Vietnam", "Chile", "Egypt", "Poland",
                            "Mexico", "Thailand", "Ghana", "Finland", "Argentina"],
                      # added with the second style round
                      "p": ["the Mona Lisa", "The Starry Night", "Guernica", "The Night Watch",
                            "The Persistence of Memory", "Girl with a Pearl Earring",
                            "The Birth of Venus", "The Scream", "Water Lilies",
                            "The Last Supper"],
                      "e": ["the Berlin Wall fall", "the first person walk on the Moon",
                            "the Titanic sink", "World War I end", "the euro coins enter use",
                            "the first iPhone go on sale", "Columbus reach the Americas",
                            "the Wright brothers first fly"],
                      "w": ["mouse", "child", "cactus", "ancient", "generous", "narrow",
                            "arrive", "victory", "shallow", "criterion"],
                      "a": ["NASA", "UNESCO", "CPU", "DNA", "HTML", "GDP", "PDF", "WHO",
                            "USB", "ISBN"],
                      "s": ["hexagon", "pentagon", "triangle", "octagon", "decagon",
                            "rhombus"],
                      "c": ["London to Paris", "New York to Boston", "Tokyo to Osaka",
                            "Madrid to Lisbon", "Sydney to Melbourne", "Rome to Milan"]}
TRAIN_CONVERSATIONS = [
    ("I want to start running in the mornings.", "That's a great habit! How fit are you now?",
     ["I can jog for about ten minutes.", "I haven't exercised in years.",
      "I walk a lot but never run."]),
    ("I'm learning to bake bread.", "Fun! What kind of bread would you like to make?",
     ["A simple sandwich loaf.", "Sourdough, but my starter is weak.",
      "Something quick without yeast."]),
    ("I need to organise my study time.", "Sure. What are you studying, and when are exams?",
     ["Chemistry, in three weeks.", "History and French, next month.",
      "Statistics, exam on Monday."]),
    ("My laptop has become really slow.", "Let's look into it. What do you mostly use it for?",
     ["Browsing with many tabs open.", "Editing photos.", "Just email and documents."]),
    ("I'd like to save more each month.", "Good goal. Do you know where most of your money goes?",
     ["Mostly eating out.", "Rent takes half of it.", "Subscriptions add up."]),
    # added with the second style round
    ("We're moving house next month.", "Exciting! Is it a big move or just across town?",
     ["Across the country, with two kids.", "Only two streets away.",
      "To a smaller flat, so I need to get rid of things."]),
    ("I keep waking up at 4 am.", "That sounds tiring. Has anything changed lately?",
     ["I started a new job.", "I drink coffee late in the evening.", "Nothing I can think of."]),
    ("I want to learn to play the guitar.", "Great idea! Do you already play any instrument?",
     ["A little piano as a child.", "No, I'm a complete beginner.",
      "I play the drums in a band."]),
    ("My cat stopped eating her dry food.", "Oh no. How long has this been going on?",
     ["About three days.", "Since we changed brands.", "Only since the weekend, she eats treats."]),
    ("I have to give a speech at my friend's wedding.",
     "What an honour! How long should it be?",
     ["About five minutes.", "Short, I get very nervous.", "No limit, but I want it funny."]),
    ("Our team keeps missing deadlines.", "That's frustrating. How are tasks planned now?",
     ["The manager assigns everything on Monday.", "We don't really plan, we react.",
      "We use a board but nobody updates it."]),
    ("I'm thinking about adopting a dog.", "Lovely! What does your daily routine look like?",
     ["I work from home most days.", "I'm out ten hours a day.", "I live alone in a flat."]),
    ("I want to cook more at home.", "Great! What stops you from cooking now?",
     ["I get home late and tired.", "I only know three dishes.", "My kitchen is tiny."]),
    ("My teenage son spends all night gaming.", "That's a common worry. How is school going?",
     ["His grades are dropping.", "Fine, surprisingly.", "He says he's bored there."]),
    ("I'd like to visit Japan in spring.", "Wonderful. How long will you stay?",
     ["Ten days.", "Three weeks, on a budget.", "Just five days with my parents."]),
    ("I can't decide between two job offers.", "Tough choice! What are the two options?",
     ["A startup with shares or a bank with a pension.",
      "One pays more, the other is closer to home.",
      "Same pay, but one is fully remote."]),
    ("I want to write a novel.", "How exciting! Do you have a story in mind?",
     ["A mystery set on a ferry.", "Not yet, just the wish.",
      "A fantasy, but I keep rewriting chapter one."]),
    ("My tomatoes have yellow leaves.", "Let's figure it out. Are they in pots or in the ground?",
     ["In pots on a balcony.", "In a raised bed.", "In a greenhouse."]),
    ("I'm nervous about my driving test.", "Totally normal. When is it?",
     ["Next Tuesday.", "In two months.", "Tomorrow morning!"]),
    ("I need ideas for a rainy Saturday with kids.", "Fun! How old are they?",
     ["Four and seven.", "Both teenagers.", "Twins, aged two."]),
    ("I'd like to read more books this year.", "Great goal. What did you enjoy reading before?",
     ["Science fiction.", "Biographies.", "I haven't read a book since school."]),
    ("Our neighbours are very noisy at night.", "That's hard. Have you spoken with them?",
     ["Once, nothing changed.", "No, I'm not sure how to start.",
      "Yes, and they got angry."]),
    ("I want to switch careers into teaching.", "Admirable! What do you do now?",
     ["I'm an accountant.", "I work in retail.", "I'm a nurse."]),
    ("I get headaches after working at my computer.",
     "That can wear you down. How many hours a day are you at the screen?",
     ["About eight.", "More than ten.", "Four, but without breaks."]),
    ("I'm hosting dinner for eight people on Friday.", "Nice! Any dietary needs among guests?",
     ["Two are vegan.", "One has a nut allergy.", "No, they eat everything."]),
]
TRAIN_MATH = [
    "{name} buys {a} notebooks at {b} dollars each and pays with a {c}-dollar note. How much "
    "change does {name} get?",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {c} people?",
    "A class has {c} students and {a} of every {b} walk to school. How many walk?",
    "A tank holds {c} litres and drains {a} litres per minute. How long until it is empty?",
    "{name} reads {a} pages a day. How many days does a book of {c} pages take?",
    "The sum of two numbers is {c} and their difference is {a}. What are the numbers?",
    # added with the second style round
    "A train travels {c} km in {a} hours. What is its average speed?",
    "{name} saves {a} dollars a week. How many weeks until {name} has {c} dollars?",
    "A shirt costs {c} dollars. After a {a}0% price cut, what does it cost?",
    "A garden is {a} m by {b} m. How much fencing goes around it?",
    "{name} shares {c} sweets equally among {a} friends. How many does each get, and how many "
    "are left?",
    "A car uses {a} litres of fuel per 100 km. How much fuel does a {c}-km trip need?",
    "{name} is {a} years older than a brother who is {b}. How old will {name} be in {c} years?",
    "A box holds {b} rows of {a} cups. How many boxes are needed for {c} cups?",
]
TRAIN_NAMES = ["Maria", "Ken", "Aisha", "Lucas", "Mei", "Omar"]


def _style_pool(rng: random.Random) -> List[StylePrompt]:
    pool = [StylePrompt("code", "", t.format(lang=lang, op=op))
            for t in TRAIN_CODE_TEMPLATES if "{op}" in t
            for lang in TRAIN_LANGUAGES for op in TRAIN_CODE_OPS]
    pool += [StylePrompt("code", "", t.format(lang=lang, concept=c))
             for t in TRAIN_CODE_TEMPLATES if "{concept}" in t
             for lang in TRAIN_LANGUAGES for c in TRAIN_CONCEPTS]
    pool += [StylePrompt("structured", "", t.format(entity=e, fields=f))
             for t in TRAIN_STRUCTURED_TEMPLATES for e, f in TRAIN_ENTITIES]
    pool += [StylePrompt("rewrite", "", t.format(sentence=s, **fill))
             for t in TRAIN_REWRITE_TEMPLATES for s in TRAIN_SENTENCES for fill in _fills(t)]
    pool += [StylePrompt("rewrite", "", t.format(**fill))
             for t in TRAIN_LONG_REWRITE_TEMPLATES for fill in _fills(t)]
    pool += [StylePrompt("short", "", t.format(**{k: v}))
             for t in TRAIN_FACTS for k, vs in TRAIN_FACT_FILLERS.items() if "{" + k + "}" in t
             for v in vs]
    pool += [StylePrompt("chat", "", (("user", opening), ("assistant", reply), ("user", r)))
             for opening, reply, replies in TRAIN_CONVERSATIONS for r in replies]
    for t in TRAIN_MATH:
        for name in TRAIN_NAMES * 3:  # numbers drawn per prompt
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            c = a * b * rng.randint(2, 6)
            pool.append(StylePrompt("math", "", t.format(name=name, a=a, b=b, c=c)))
    return pool


def _fills(template: str) -> List[Dict[str, str]]:
    """The slot values a rewrite template is crossed with (one empty fill: no slot)."""
    if "{tone}" in template:
        return [{"tone": t} for t in TRAIN_TONES]
    if "{language}" in template:
        return [{"language": lang} for lang in TRAIN_LANGUAGE_NAMES]
    if "{paragraph}" in template:
        return [{"paragraph": p} for p in TRAIN_PARAGRAPHS]
    if "{sloppy}" in template:
        return [{"sloppy": x} for x in TRAIN_SLOPPY]
    if "{lines}" in template:
        return [{"lines": lines, "old": old, "new": new} for lines, old, new in TRAIN_LISTS]
    return [{}]


def style_training_prompts(num_prompts: int, seed: int = 0) -> List[StylePrompt]:
    """`num_prompts` distinct style-covering training prompts, seeded: the styles take turns
    (each style's prompts shuffled) until a style runs out, so small styles are not drowned
    by code, whose pool is the largest."""
    rng = random.Random(seed)
    by_style: Dict[str, List[StylePrompt]] = {}
    for p in {p.text(): p for p in _style_pool(rng)}.values():
        by_style.setdefault(p.style, []).append(p)
    total = sum(len(v) for v in by_style.values())
    if not 1 <= num_prompts <= total:
        raise ValueError(f"argument 'num_prompts' must lie in [1, {total}], got {num_prompts}")
    for prompts in by_style.values():
        rng.shuffle(prompts)
    mixed = [p for turn in itertools.zip_longest(*by_style.values()) for p in turn if p]
    return mixed[:num_prompts]


def shared_word_runs(a: str, b: str, n: int = 4) -> List[str]:
    """The runs of n words (lowercased, punctuation dropped) that texts a and b share."""
    def runs(text):
        words = re.findall(r"[a-z0-9']+", text.lower())
        return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}
    return sorted(runs(a) & runs(b))
