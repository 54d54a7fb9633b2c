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
    # added with the 2400-prompt corpus
    "the solar system", "kangaroos", "the Titanic", "paper making", "Greek mythology",
    "volleyball", "tigers", "the human skeleton", "microscopes", "the Aztecs", "rice farming",
    "electric guitars", "the Nile", "snowflakes", "frogs", "the Byzantine Empire", "wildfires",
    "carbon dioxide", "the steam engine", "basketball", "dolphins", "maps",
    "the Maya civilization", "radio", "television", "the telephone", "lightning", "tsunamis",
    "camels", "giraffes", "the Milky Way", "gravity", "friction", "sound waves", "the human eye",
    "the digestive system", "the lungs", "blood types", "sugar", "olive oil", "beekeeping",
    "knitting", "painting", "sculpture", "ballet", "opera", "poetry", "newspapers", "money",
    "taxes", "supply and demand", "the United Nations", "elections", "human rights",
    "Saturn's rings", "Jupiter", "asteroids", "the Big Bang", "evolution", "genetics", "bacteria",
    "viruses", "seeds", "oak trees", "cacti", "the savanna", "caves", "waterfalls", "islands",
    "mountain climbing", "the Alps", "the Himalayas", "lakes", "wetlands", "ice cream", "pizza",
    "sushi", "motorcycles", "ships", "rockets", "the International Space Station",
    "electric circuits", "semiconductors", "smartphones", "video games", "3D printing",
    "cybersecurity", "cloud computing", "open source software", "programming languages",
    "databases", "laughter", "friendship", "time zones", "calendars", "clocks",
    "the metric system", "prime numbers", "geometry", "probability",
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
    # added with the 2400-prompt corpus
    "reverses the words in a sentence", "checks whether a number is an Armstrong number",
    "computes the least common multiple of two numbers",
    "converts a binary string to a decimal number", "counts the set bits of an integer",
    "finds the index of the smallest value in a list",
    "checks whether a string contains only digits", "computes the nth triangular number",
    "returns the elements that appear exactly once in a list", "implements insertion sort",
    "implements quicksort", "implements selection sort",
    "computes the mean and standard deviation of a list",
    "finds the kth smallest element in a list", "checks whether a matrix is symmetric",
    "multiplies two matrices", "computes the length of the longest increasing subsequence",
    "implements a binary search tree class", "performs a breadth-first search on a graph",
    "performs a depth-first search on a graph", "finds the shortest path in a grid",
    "sums a list recursively", "converts a string to title case",
    "truncates a string to n characters", "pads a number with leading zeros",
    "counts the uppercase letters in a string", "checks whether two lists have the same elements",
    "pairs up the elements of two lists", "computes the Hamming distance between two strings",
    "encodes a string with a Caesar cipher", "decodes a Caesar cipher",
    "compresses a string with run-length encoding", "finds all divisors of a number",
    "checks whether a number is even", "computes the cumulative product of a list",
    "finds the longest palindromic substring", "removes punctuation from a string",
    "sorts a list of strings by length", "finds the common elements of three lists",
    "converts hours and minutes to seconds",
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
