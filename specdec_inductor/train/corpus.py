"""The prompt corpus `specdec train-draft` builds its data from: instruction templates crossed
with topics, generated offline (nothing is fetched). Training and held-out prompts use disjoint
topic lists, and neither contains the CLI's or the benchmarks' prompts, so held-out acceptance
measures prompts the head never saw."""
import random
from typing import List

TEMPLATES = [
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give three facts about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Describe {t} to a ten-year-old.",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}, with short answers.",
    "Summarize the history of {t} in a few sentences.",
    "Write a haiku about {t}.",
    "What is a common misconception about {t}?",
    "Compare {t} with something similar and explain the difference.",
    "Give step-by-step advice for someone who wants to learn about {t}.",
]

CODE_TEMPLATES = [
    "Write a Python function that {c}.",
    "Write a Python function that {c}, with a docstring and type hints.",
    "Explain how to {c} in Python, with a code example.",
    "Write a JavaScript function that {c}.",
    "Write unit tests in Python for a function that {c}.",
]

TOPICS = [
    "photosynthesis", "volcanoes", "the water cycle", "black holes", "the Roman Empire",
    "electric cars", "honey bees", "the stock market", "vaccines", "rainforests",
    "the printing press", "solar panels", "chess", "coffee", "the moon landing",
    "earthquakes", "recycling", "the human heart", "bicycles", "the internet",
    "dinosaurs", "glaciers", "democracy", "music theory", "sleep", "airplanes",
    "the periodic table", "gardening", "the Great Wall of China", "octopuses",
    "renewable energy", "inflation", "the immune system", "bread baking", "whales",
    "the Olympic Games", "batteries", "deserts", "the French Revolution", "robots",
    "meditation", "tea", "lighthouses", "the speed of light", "coral reefs",
    "social media", "the alphabet", "trains", "mushrooms", "climate change",
    "ancient Egypt", "the Industrial Revolution", "quantum computing", "elephants",
    "the Silk Road", "vitamins", "hot air balloons", "the Arctic", "wolves", "blockchain",
    "pottery", "the Eiffel Tower", "ocean tides", "fossils", "the Pacific Ocean", "chocolate",
    "space telescopes", "artificial intelligence", "the Mars rovers", "rainbows", "ants",
    "the Cold War", "yoga", "skyscrapers", "suspension bridges", "the nervous system", "DNA",
    "plate tectonics", "nuclear power", "volunteering", "public transport", "banks", "comets",
    "the four seasons", "butterflies", "photography", "the piano", "soccer", "marathons",
    "spices", "the Vikings", "medieval castles", "satellites", "magnets", "clouds", "sharks",
    "hurricanes", "owls", "antibiotics", "the ozone layer",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "merges two sorted lists", "counts the words in a text", "finds the maximum in a list",
    "removes duplicates from a list while keeping order", "computes Fibonacci numbers",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
    "sorts a list of dictionaries by a key", "flattens a nested list",
    "reads a CSV file and returns its rows", "computes the average of a list of numbers",
    "finds the most common element in a list", "implements binary search",
    "capitalizes every word in a sentence", "returns the n largest numbers in a list",
    "validates an email address with a regular expression", "computes the GCD of two numbers",
    "transposes a matrix", "groups words by their first letter",
    "checks whether two strings are anagrams", "converts a decimal number to binary",
    "parses a date string", "implements a stack class", "computes compound interest",
    "splits a list into chunks of size n", "counts vowels in a string",
    "finds all pairs in a list that sum to a target",
    "counts the occurrences of each character in a string", "checks whether a year is a leap year",
    "finds the second largest number in a list", "converts snake_case to camelCase",
    "computes the sum of the digits of a number", "generates all permutations of a string",
    "finds the intersection of two lists", "implements bubble sort", "implements merge sort",
    "checks whether a number is a perfect square", "counts the lines in a file",
    "returns the prime factors of a number", "computes the power set of a set",
    "implements a singly linked list class", "finds the first non-repeating character in a string",
    "computes the dot product of two vectors", "removes all whitespace from a string",
    "converts a list of pairs to a dictionary", "computes the running sum of a list",
    "finds the missing number in a sequence from 1 to n", "validates a phone number",
    "computes the area of a circle", "shuffles a list in place",
    "writes a dictionary to a JSON file", "computes the edit distance between two strings",
    "checks whether a list is sorted", "counts word frequencies in a file",
    "generates a random password", "evaluates a simple arithmetic expression",
    "finds the longest common prefix of a list of strings",
]

HELDOUT_TOPICS = [
    "penguins", "the Renaissance", "wind turbines", "origami", "the Amazon river",
    "submarines", "bamboo", "the human brain", "jazz", "tornadoes", "libraries", "cheese",
]

HELDOUT_CODE_TASKS = [
    "rotates a list by k positions", "computes the median of a list",
    "checks whether parentheses in a string are balanced", "converts a Roman numeral to an integer",
    "finds the longest word in a sentence", "implements a queue with two stacks",
]


def _cross(templates: List[str], key: str, items: List[str]) -> List[str]:
    return [tpl.format(**{key: item}) for item in items for tpl in templates]


def training_prompts(num_prompts: int, seed: int = 0) -> List[str]:
    """`num_prompts` distinct training prompts (at most every template x topic pair), in a
    seeded order that mixes prose and code."""
    pool = _cross(TEMPLATES, "t", TOPICS) + _cross(CODE_TEMPLATES, "c", CODE_TASKS)
    if not 1 <= num_prompts <= len(pool):
        raise ValueError(f"argument 'num_prompts' must lie in [1, {len(pool)}], got {num_prompts}")
    random.Random(seed).shuffle(pool)
    return pool[:num_prompts]


def heldout_prompts() -> List[str]:
    """Prompts for evaluation: topics and code tasks the training prompts never use."""
    prose = [TEMPLATES[i % len(TEMPLATES)].format(t=t) for i, t in enumerate(HELDOUT_TOPICS)]
    code = [CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(c=c)
            for i, c in enumerate(HELDOUT_CODE_TASKS)]
    return prose + code
