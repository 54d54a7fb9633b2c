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
    # added with the 7000-prompt corpus
    "Why is {t} important?",
    "Explain how {t} works, step by step.",
    "Write a dialogue between a teacher and a student about {t}.",
    "What would the world be like without {t}?",
    "Write a short blog post about {t}.",
    "What are some fun facts about {t}?",
    "Describe the future of {t} in the next fifty years.",
    "Explain {t} using an everyday analogy.",
    "Write a short poem about {t}.",
    "Write an email to a friend describing what you learned about {t}.",
    "Create a quiz with three multiple-choice questions about {t}.",
    "What should everyone know about {t}?",
]

CODE_TEMPLATES = [
    "Write a Python function that {c}.",
    "Write a Python function that {c}, with a docstring and type hints.",
    "Explain how to {c} in Python, with a code example.",
    "Write a JavaScript function that {c}.",
    "Write unit tests in Python for a function that {c}.",
    # added with the 7000-prompt corpus
    "Write a C function that {c}.",
    "Write a Java method that {c}.",
    "Write a Rust function that {c}.",
    "Write an efficient Python function that {c}, and state its time complexity.",
    "Show a short Python snippet that {c}, and explain how it works.",
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
    # added with the 7000-prompt corpus
    "the Moon", "sunflowers", "polar bears", "the Sahara", "fireworks", "umbrellas",
    "windmills", "the human skin", "hearing", "dreams",
    "memory", "habits", "exercise", "nutrition", "water purification", "plastic pollution",
    "electric grids", "hydrogen fuel", "geothermal energy", "tidal power", "the Panama Canal",
    "the Suez Canal", "the Colosseum", "the pyramids of Giza", "Stonehenge",
    "the Inca Empire", "the Ottoman Empire", "the Mongol Empire", "samurai", "knights",
    "pirates", "explorers", "the compass", "telescopes", "thermometers", "penicillin", "X-rays", "anesthesia", "first aid", "dentists", "nurses", "firefighters",
    "farmers markets", "supermarkets", "restaurants", "coffee shops", "board games", "puzzles",
    "kites", "skateboarding", "surfing", "swimming", "tennis", "cricket", "baseball",
    "the Tour de France", "cooking pasta", "baking cookies", "fermentation", "yogurt",
    "apples", "bananas", "potatoes", "corn", "wheat", "cotton", "silk", "wool", "glass",
    "steel", "concrete", "wood", "rubber", "gold", "diamonds", "salt", "sand dunes",
    "the rain", "fog", "snow", "thunderstorms", "the aurora borealis", "eclipses",
    "meteor showers", "exoplanets", "Venus", "Mercury", "Neptune", "the Sun", "neutron stars",
    "dark matter", "atoms", "molecules", "chemical reactions", "acids and bases", "electricity",
    "magnetism", "heat", "energy", "motion", "levers", "pulleys", "wheels", "engines",
    "the bicycle chain", "elevators", "escalators", "tunnels", "dams", "canals", "ports",
    "airports", "highways", "traffic lights", "postal services", "museums",
    "zoos", "national parks", "forests", "grasslands", "mangroves", "kelp forests", "jellyfish",
    "sea turtles", "crabs", "salmon", "eagles", "parrots", "hummingbirds", "crows", "bats",
    "horses", "cows", "sheep", "goats", "cats", "dogs", "rabbits", "hedgehogs", "squirrels",
    "beavers", "bears", "lions", "cheetahs", "gorillas", "chimpanzees", "pandas", "koalas",
    "rhinos", "hippos", "crocodiles", "snakes", "lizards", "spiders", "earthworms", "mosquitoes",
    "spreadsheets", "email", "passwords", "search engines", "online shopping", "podcasts",
    "streaming services", "digital cameras", "virtual reality", "self-driving cars", "drones",
    "machine learning", "algorithms", "computer networks", "operating systems", "compilers",
    "web browsers", "the World Wide Web", "encryption", "data privacy", "budgeting",
    "saving money", "credit cards", "interest rates", "small businesses", "teamwork",
    "public speaking", "leadership", "negotiation", "time management", "learning a language",
    "reading books", "writing essays", "note taking", "studying for exams", "kindness",
    "gratitude", "curiosity", "patience", "happiness", "stress", "cities", "villages",
    "architecture", "bridges", "gardens", "parks", "festivals", "holidays", "birthdays",
    "weddings", "traditions", "folk tales", "fairy tales", "myths and legends", "theater",
    "film making", "animation", "comics", "cartoons", "drawing", "calligraphy", "typography",
    "fashion", "textiles", "jewelry", "perfume", "soap", "candles",
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
    # added with the 7000-prompt corpus
    "counts how many times a substring occurs in a string", "finds the mode of a list",
    "checks whether a string is a valid IPv4 address", "reverses a linked list",
    "computes the sum of a list of numbers without using sum", "rounds a float to n decimals",
    "converts a dictionary to a list of key-value pairs", "merges two dictionaries",
    "finds the largest product of two numbers in a list", "squares every number in a list",
    "filters the even numbers from a list", "computes the Collatz sequence of a number",
    "checks whether a string starts with a vowel", "finds the longest run of equal elements",
    "computes the distance between two points", "converts kilometers to miles",
    "returns the last n elements of a list", "checks whether a list contains duplicates",
    "computes the nth power of a number without using the power operator",
    "builds a multiplication table", "counts the digits of an integer",
    "returns a list of the first n prime numbers", "finds the minimum and maximum of a list",
    "interleaves two strings", "converts a string to a list of characters",
    "checks whether a word is an isogram", "computes the sum of the squares of the first n numbers",
    "replaces every vowel in a string with a star", "removes empty strings from a list",
    "sorts a dictionary by its values", "finds the most frequent word in a sentence",
    "converts a temperature from Fahrenheit to Celsius", "checks whether a triangle is valid",
    "computes the perimeter of a rectangle", "generates a list of random integers",
    "returns the unique characters of a string", "checks whether a number is a power of two", "finds the longest common subsequence of two strings",
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


# The held-out prompts cycle through the first templates only (those of the 2400-prompt corpus),
# so they stay the same prompts as templates are added and results stay comparable.
HELDOUT_TEMPLATES, HELDOUT_CODE_TEMPLATES = TEMPLATES[:12], CODE_TEMPLATES[:5]


def heldout_prompts() -> List[str]:
    """Prompts for evaluation: topics and code tasks the training prompts never use."""
    prose = [HELDOUT_TEMPLATES[i % len(HELDOUT_TEMPLATES)].format(t=t)
             for i, t in enumerate(HELDOUT_TOPICS)]
    code = [HELDOUT_CODE_TEMPLATES[i % len(HELDOUT_CODE_TEMPLATES)].format(c=c)
            for i, c in enumerate(HELDOUT_CODE_TASKS)]
    return prose + code
