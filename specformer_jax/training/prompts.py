"""Built-in training prompts for self-distillation, generated offline and deterministically.

Where they come from: every template, topic, code snippet and word problem below was written for this project.
No evaluation set is used or copied (no HumanEval, MT-Bench, Alpaca-Eval, GSM8K, nor this repository's own
benchmarks/prompts.jsonl). Prompts that match an evaluation prompt are dropped (`builtin_prompts`) or refused
(`specformer_jax.training.distill`), so the drafter is never trained on what it is measured on.

Instruction templates are crossed with topic lists, with optional answer-style hints, to give a finite pool of about
8,600 prompts (chat, how-things-work and why questions, writing, rewriting and translation, code in several
languages, Python standard-library usage, SQL); math word problems with random numbers are mixed in and take over
when the pool runs out.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from specformer_jax.errors import SpecformerError

# The evaluation prompt set. Its prompts must never become training prompts.
EVALUATION_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts.jsonl"

CONCEPTS = [
    # science and nature
    "photosynthesis", "plate tectonics", "the greenhouse effect", "black holes", "natural selection",
    "the immune system", "vaccines", "DNA replication", "ocean tides", "rainbows", "static electricity",
    "magnetism", "nuclear fusion in stars", "the speed of light", "entropy",
    "coral reefs", "bird migration", "volcanoes", "earthquakes", "the carbon cycle", "antibiotic resistance",
    "the phases of the Moon", "sound waves", "rechargeable batteries", "pollination by bees",
    # technology and computing
    "recursion", "hash tables", "Big-O notation", "public-key cryptography", "packet routing on the internet",
    "DNS", "version control with git branches", "garbage collection", "neural networks", "floating-point numbers",
    "database indexes", "caching", "unit testing", "containers such as Docker", "compilers",
    "regular expressions", "binary search", "GPS positioning", "touchscreens",
    # economics, work and society
    "inflation", "compound interest", "supply and demand", "index funds", "opportunity cost", "a household budget",
    "credit scores", "the stock market", "remote work", "time zones", "ranked-choice voting",
    # health and the mind
    "sleep cycles", "muscle growth", "dietary fibre", "dehydration", "the placebo effect", "habit formation",
    "stress and the body", "human memory",
    # more of everything, so the drafter sees many subjects rather than many answers about a few
    "the water table", "the ozone layer", "continental drift", "the Doppler effect", "friction", "buoyancy",
    "centripetal force", "the periodic table", "chemical bonds", "acids and bases", "enzymes", "mitochondria",
    "the human heart", "the nervous system", "hormones", "allergies", "viruses and bacteria", "fermentation",
    "erosion", "glaciers", "hurricanes", "lightning", "the northern lights", "comets", "exoplanets", "gravity waves",
    "the Big Bang", "solar eclipses", "the seasons", "ocean currents", "desert ecosystems", "rainforests",
    "food chains", "camouflage in animals", "hibernation", "symbiosis", "genetic mutations", "stem cells",
    "operating systems", "virtual memory", "APIs", "cloud computing", "open-source software", "encryption at rest",
    "two-factor authentication", "phishing", "load balancing", "message queues", "functional programming",
    "object-oriented programming", "type systems", "concurrency", "deadlocks", "memory leaks", "code reviews",
    "continuous integration", "technical debt", "microservices", "web browsers", "cookies on websites",
    "machine learning", "overfitting in machine learning", "gradient descent", "search engines", "QR codes",
    "Bluetooth", "3D printing", "electric motors", "transistors", "barcodes", "fibre-optic cables",
    "taxes", "interest rates", "exchange rates", "insurance", "pensions", "small business loans", "marketing funnels",
    "negotiation", "active listening", "critical thinking", "the scientific method", "logical fallacies",
    "probability", "statistics in the news", "prime numbers", "fractions", "percentages", "geometry proofs",
    "the Pythagorean theorem", "exponential growth", "democracy", "the rule of law", "urban planning",
    "public transport", "recycling", "renewable energy", "water purification", "mindfulness", "motivation",
    "procrastination", "introversion", "emotional intelligence", "learning styles", "spaced repetition",
]

EVENTS = [
    "the invention of the printing press", "the fall of the Western Roman Empire", "the Industrial Revolution",
    "the first Moon landing", "the building of the Great Wall of China", "the Black Death in Europe",
    "the voyages of Zheng He", "the construction of the Panama Canal", "the fall of the Berlin Wall",
    "the discovery of penicillin", "the signing of Magna Carta", "the Meiji Restoration in Japan",
    "the invention of the telephone", "the first powered flight by the Wright brothers",
    "the rise of the Mongol Empire", "the Silk Road trade network", "the abolition of the transatlantic slave trade",
    "the French Revolution", "the Renaissance in Florence", "the building of the pyramids of Giza",
    "the invention of the World Wide Web", "the partition of India in 1947",
]

SKILLS = [
    "bake sourdough bread", "prepare for a job interview", "start a vegetable garden", "learn to touch-type",
    "change a flat bicycle tyre", "write a good cover letter", "train for a first 5 km run", "keep a houseplant alive",
    "organise a small kitchen", "make a monthly budget", "learn a new language as an adult",
    "give a short presentation without notes", "take better photos with a phone", "sharpen a kitchen knife",
    "set up a home Wi-Fi network", "back up the files on a computer", "negotiate a salary offer",
    "plan a birthday party for a child", "train a puppy to sit", "write a clear bug report",
    "read more books in a year", "pack a suitcase for a two-week trip", "start meditating",
    "fix a dripping tap", "learn to play the guitar", "make cold brew coffee", "run an effective team meeting",
    "write a README for an open-source project", "prepare for a long-haul flight", "compost kitchen scraps",
    "paint a room", "clean a cast-iron pan", "write a short speech for a wedding", "learn to swim as an adult",
    "study for an exam in one week", "plan a week of meals", "start journaling", "improve my handwriting",
    "organise digital photos", "set up a budget spreadsheet", "learn the basics of chess",
    "care for a sourdough starter",
    "choose a good running shoe", "start investing with a small amount", "write a haiku", "brew tea properly",
    "fold a fitted sheet", "iron a shirt", "plan a hiking trip", "make friends in a new city", "reduce screen time",
    "teach a child to ride a bike", "write unit tests for a Python module", "debug a slow web page",
    "learn SQL from scratch", "prepare a tax return", "decorate a small balcony", "grow herbs on a windowsill",
]

DISHES = [
    "a vegetable curry", "fluffy pancakes", "a lentil soup", "homemade pizza dough", "a Greek salad",
    "banana bread", "a mushroom risotto", "chicken stir-fry", "shakshuka", "guacamole", "a simple tomato sauce",
    "overnight oats", "a chickpea and spinach stew", "fried rice", "oatmeal cookies", "a bean chilli",
    "a carrot cake", "hummus", "a vegetable omelette", "roasted vegetables", "a pasta salad", "pad thai",
    "a fruit smoothie", "garlic bread", "a pumpkin soup", "apple crumble", "a potato gratin", "falafel",
]

PLACES = [
    "Kyoto", "Lisbon", "the Scottish Highlands", "Mexico City", "Cape Town", "Iceland", "Vancouver",
    "Marrakech", "Hanoi", "the Amalfi Coast", "Buenos Aires", "Prague", "New Zealand's South Island",
    "Istanbul", "Seoul", "the Norwegian fjords", "Edinburgh", "Rome", "Barcelona", "Singapore", "Sydney",
    "Patagonia", "Montreal", "Vienna", "Bali", "the Swiss Alps",
]

PAIRS = [
    ("a laptop", "a tablet"), ("renting a home", "buying a home"), ("Python", "JavaScript"), ("TCP", "UDP"),
    ("SQL databases", "NoSQL databases"), ("running", "swimming"), ("electric cars", "petrol cars"),
    ("e-books", "paper books"), ("a Roth IRA", "a traditional IRA"), ("tea", "coffee"),
    ("working from home", "working in an office"), ("trains", "planes for travel within Europe"),
    ("baking soda", "baking powder"), ("stocks", "bonds"), ("classical music", "jazz"), ("Linux", "Windows"),
    ("arrays", "linked lists"), ("threads", "processes"), ("cats", "dogs as pets"), ("solar power", "wind power"),
    ("REST APIs", "GraphQL"), ("frozen vegetables", "fresh vegetables"), ("a savings account", "a checking account"),
    ("yoga", "pilates"), ("static typing", "dynamic typing"), ("a desktop computer", "a laptop"),
    ("public schools", "private schools"), ("city life", "country life"),
    ("Kotlin", "Java"), ("Rust", "C++"), ("Vim", "VS Code"), ("paper notebooks", "note-taking apps"),
    ("leasing a car", "buying a car"), ("HTTP", "HTTPS"), ("RAM", "storage"), ("monoliths", "microservices"),
]

STORY_SUBJECTS = [
    "a lighthouse keeper who finds a message in a bottle", "a robot learning to paint", "the last day of summer",
    "a city where it never stops raining", "a dragon afraid of heights", "two strangers sharing an umbrella",
    "an old map found in a library book", "a cat who runs a bakery", "the first snowfall of the year",
    "an astronaut looking back at Earth", "a forgotten violin", "a village that lives on the back of a giant turtle",
    "a train that only runs at midnight", "a gardener who grows clocks", "the sound of the sea at night",
    "a time traveller stuck in a Tuesday", "a small boat in a storm", "a friendship between a fox and a crow",
    "moving to a new city", "the smell of fresh bread", "a detective who can hear colours",
    "a girl who befriends a cloud", "the last bookshop in town", "a lost key", "an old man and his garden",
    "a robot that wants to be a chef", "a mountain climber at dawn", "a message from the future",
    "the night the power went out", "a street musician", "a secret door in a school", "a whale singing",
]

MESSAGES = [
    "asking my manager for a day off next week", "thanking a neighbour for watering my plants",
    "declining a wedding invitation politely", "reminding a client that an invoice is overdue",
    "welcoming a new member to the team", "apologising for missing a meeting",
    "asking a landlord to fix the heating", "congratulating a friend on a new job",
    "requesting a refund for a damaged parcel", "introducing two colleagues who should meet",
    "asking a professor for a letter of recommendation", "cancelling a gym membership",
    "following up after a job interview", "announcing a change to the office opening hours",
    "asking the team for feedback on a draft proposal", "inviting friends to a housewarming party",
    "asking a colleague to review my code", "telling customers about a delayed delivery",
    "thanking a mentor after a year of help", "asking a neighbour to keep the noise down",
]

PROBLEMS = [
    "I feel tired every afternoon at work", "I keep procrastinating on a big project",
    "I have trouble falling asleep", "I get nervous before speaking in meetings",
    "I spend too much money on takeaway food", "I want to switch careers into software development",
    "My code reviews take far too long", "I can never find time to exercise", "I forget the names of people I meet",
    "My team keeps missing deadlines", "I find it hard to say no to extra work", "My inbox is always overflowing",
    "I want to eat more vegetables but do not like most of them", "I feel lonely after moving to a new city",
    "I get distracted by my phone all the time", "I never drink enough water",
    "My flatmate never does the dishes", "I feel stuck in my job", "I find it hard to start conversations",
    "I worry too much about small things", "My back hurts after working at a desk",
]

LISTABLES = [
    "ways to reduce household energy use", "questions to ask at the end of a job interview",
    "indoor activities for a rainy day with children", "habits that improve sleep",
    "ways to make a small room feel bigger", "uses for leftover rice", "common mistakes in beginner Python code",
    "ways to practise a foreign language every day", "signs that a houseplant needs more light",
    "tips for writing readable emails", "things to check before buying a used car",
    "low-cost hobbies", "ways to cut down on plastic waste", "features of a good password",
    "stretches for people who sit all day", "ideas for a team-building afternoon", "reasons to learn some statistics",
    "ways to keep a long meeting on track", "healthy snacks for a road trip",
    "skills every junior developer should learn", "ways to save money on groceries",
    "good habits for a new programmer", "fun facts about the ocean", "ideas for a science fair project",
    "ways to welcome a new colleague", "tips for a first marathon", "things to do on a long train ride",
]

CODE_TASKS = [
    "returns the n-th Fibonacci number", "merges two sorted lists into one sorted list",
    "counts how often each word appears in a text", "removes duplicates from a list while keeping the order",
    "checks whether two strings are anagrams", "converts a Roman numeral to an integer",
    "finds the largest and smallest number in a list", "flattens a nested list of any depth",
    "returns all prime numbers below n", "capitalises the first letter of every word in a sentence",
    "validates a simple email address", "computes the greatest common divisor of two numbers",
    "rotates a list k steps to the right", "groups a list of words by their first letter",
    "converts a temperature from Celsius to Fahrenheit", "returns the median of a list of numbers",
    "checks whether brackets in a string are balanced", "splits a list into chunks of size n",
    "counts the vowels in a string", "returns the second largest number in a list",
    "transposes a matrix given as a list of rows", "converts a number of seconds into hours, minutes and seconds",
    "finds the longest word in a sentence", "checks whether a year is a leap year",
    "computes the running total of a list of numbers", "returns the index of a target value using binary search",
    "compresses a string like 'aaabbc' into 'a3b2c1'", "finds the first character that does not repeat in a string",
    "sums the digits of an integer", "checks whether a number is a power of two",
    "returns the words of a sentence in reverse order", "counts the lines in a text file",
    "finds the most common element in a list", "converts a binary string to an integer",
    "checks whether a list is sorted", "merges two dictionaries", "returns the intersection of two lists",
    "generates a random password of a given length", "converts a date string to a weekday name",
    "calculates the area of a circle", "finds all pairs in a list that sum to a target",
    "removes all whitespace from a string", "returns the n largest numbers in a list",
    "checks whether a number is an Armstrong number", "implements a simple stack",
    "implements a queue with two stacks", "computes the Levenshtein distance between two strings",
    "parses a CSV line into fields", "converts snake_case to camelCase", "shuffles a list in place",
]

LANGUAGES = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C"]

SQL_TASKS = [
    "finds the five customers with the highest total spending, given orders(customer_id, amount)",
    "lists employees who earn more than their manager, given employees(id, name, salary, manager_id)",
    "counts new users per month, given users(id, created_at)",
    "finds products that have never been ordered, given products(id, name) and order_items(order_id, product_id)",
    "returns the average rating of each film with at least ten reviews, given reviews(film_id, rating)",
    "finds duplicate email addresses, given accounts(id, email)",
    "computes each department's share of the total payroll, given staff(id, department, salary)",
    "returns the most recent login of every user, given logins(user_id, logged_in_at)",
    "lists the top three best-selling products in each category, given sales(product_id, category, quantity)",
    "finds days on which revenue was higher than on the previous day, given daily_revenue(day, revenue)",
    "deletes sessions older than 30 days, given sessions(id, started_at)",
    "finds students enrolled in every course, given enrolments(student_id, course_id) and courses(id)",
]

# (what the code should do, Python code with one bug)
BUGGY_CODE = [
    ("return the average of a list of numbers",
     "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) - 1"),
    ("return the last n items of a list",
     "def last_n(items, n):\n    return items[-n:-1]"),
    ("count how many numbers in a list are even",
     "def count_even(nums):\n    count = 0\n    for n in nums:\n        if n % 2 == 1:\n            count += 1\n"
     "    return count"),
    ("return a new list with every item doubled, leaving the input unchanged",
     "def doubled(items, out=[]):\n    for x in items:\n        out.append(2 * x)\n    return out"),
    ("return True when a word reads the same backwards, ignoring case",
     "def mirrored(word):\n    return word == word[::-1].lower()"),
    ("return the factorial-like product 1 * 2 * ... * n",
     "def product_to(n):\n    result = 0\n    for i in range(1, n + 1):\n        result *= i\n    return result"),
    ("read a file and return the number of lines",
     "def line_count(path):\n    f = open(path)\n    return len(f.read().split(' '))"),
    ("return the keys of a dict sorted by their values, largest first",
     "def ranked(d):\n    return sorted(d, key=d.get)"),
]

# Correct Python code to be explained.
SNIPPETS = [
    "from collections import Counter\n\n"
    "def top_words(text, k=3):\n    return Counter(text.lower().split()).most_common(k)",
    "def chunks(xs, n):\n    for i in range(0, len(xs), n):\n        yield xs[i:i + n]",
    "import functools\n\n"
    "@functools.lru_cache(maxsize=None)\ndef ways(n):\n    return 1 if n <= 1 else ways(n - 1) + ways(n - 2)",
    "squares = {n: n * n for n in range(10) if n % 3 == 0}",
    "with open('log.txt') as f:\n    errors = [line for line in f if 'ERROR' in line]",
    "def compose(*fs):\n    def run(x):\n        for f in reversed(fs):\n            x = f(x)\n        return x\n"
    "    return run",
    "pairs = sorted(zip(names, scores), key=lambda p: p[1], reverse=True)",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n"
    "    def push(self, x):\n        self._items.append(x)\n\n"
    "    def pop(self):\n        return self._items.pop()",
]

DEVICES = [
    "a microwave oven", "a dishwasher", "a thermostat", "a smoke detector", "a bicycle's gears", "a car engine",
    "a solar panel", "a wind turbine", "a digital camera", "a noise-cancelling headphone", "an electric kettle",
    "a heat pump", "a lock and key", "a vacuum cleaner", "a credit card payment", "a search engine",
    "a password manager", "a printer", "an elevator", "a hydroelectric dam", "a compass", "a sailboat",
    "a mobile phone network", "Wi-Fi", "a hard drive", "an LED light bulb", "a toilet flush", "a parachute",
]

WHY_QUESTIONS = [
    "the sky looks blue", "cats purr", "we get hiccups", "bread rises", "ice floats on water", "we dream",
    "onions make people cry", "the Moon has craters", "some people are left-handed", "metal feels cold",
    "we yawn", "the sea is salty", "planes leave white trails", "our voices sound different on recordings",
    "leaves are green", "popcorn pops", "stars twinkle", "the ocean has waves", "coffee keeps people awake",
    "birds fly south in winter", "our ears pop on a plane", "soap removes grease", "time zones exist",
    "software has bugs", "batteries lose capacity over time", "some numbers are called irrational",
]

# Python standard-library functions and classes (names only; the prompts ask about their use).
STDLIB = [
    "itertools.groupby", "itertools.chain", "itertools.product", "itertools.accumulate", "itertools.islice",
    "collections.defaultdict", "collections.Counter", "collections.deque", "collections.namedtuple",
    "functools.reduce", "functools.partial", "functools.lru_cache", "functools.wraps", "operator.itemgetter",
    "os.walk", "os.environ", "os.path.join", "pathlib.Path.glob", "pathlib.Path.read_text", "shutil.copytree",
    "subprocess.run", "argparse.ArgumentParser", "logging.getLogger", "json.dumps", "json.load", "csv.DictReader",
    "datetime.timedelta", "datetime.datetime.strptime", "time.perf_counter", "random.choice", "random.sample",
    "statistics.median", "math.isclose", "decimal.Decimal", "fractions.Fraction", "re.sub", "re.findall",
    "string.Template", "textwrap.dedent", "enumerate", "zip", "sorted with a key function", "dict.get",
    "dict.setdefault", "str.join", "str.split", "str.format", "f-strings", "list slicing", "set operations",
    "contextlib.contextmanager", "dataclasses.dataclass", "typing.Optional", "abc.ABC", "enum.Enum",
    "threading.Thread", "concurrent.futures.ThreadPoolExecutor", "asyncio.gather", "queue.Queue",
    "heapq.heappush", "bisect.bisect_left", "copy.deepcopy", "pickle.dumps", "sqlite3.connect", "unittest.TestCase",
    "urllib.parse.urlparse", "hashlib.sha256", "base64.b64encode", "uuid.uuid4", "tempfile.TemporaryDirectory",
    "zipfile.ZipFile", "glob.glob", "sys.argv", "the with statement", "generators and yield", "lambda functions",
    "try/except/finally", "list.sort", "the walrus operator", "*args and **kwargs", "property decorators",
]

# (operation) for "In {language}, how do I ...?"
LANGUAGE_HOWTOS = [
    "read a file line by line", "sort a list of records by one field", "parse a JSON string", "handle errors",
    "make an HTTP request", "write a unit test", "define a class with a constructor", "iterate over a map",
    "format a date", "run two tasks concurrently", "split a string", "convert a string to a number",
    "remove duplicates from an array", "read command-line arguments", "measure how long code takes to run",
]

SENTENCES = [
    "me and him goes to the shop every days", "The meeting have been moved to tomorrow morning.",
    "i think this report need more detail before we send it", "We was late because the train were cancelled.",
    "Their going to finish the project next week.", "The data shows that sales has increased.",
    "hey can u send me the files asap thx", "The product is good but it's price is too high.",
    "We need to talk about the budget, it is a big problem.", "The cat sat quietly by the warm fire.",
    "Learning a new language takes patience and daily practice.", "Our team shipped the new feature on time.",
    "Please remember to lock the door when you leave.", "The weather was perfect for a walk in the park.",
    "I would like to book a table for four people at eight.", "The software update fixed several security bugs.",
]

REWRITE_TEMPLATES = [
    "Correct the grammar and spelling: \"{0}\"", "Rewrite this sentence to sound more formal: \"{0}\"",
    "Rewrite this sentence in a friendly, casual tone: \"{0}\"", "Translate into French: \"{0}\"",
    "Translate into Spanish: \"{0}\"", "Translate into German: \"{0}\"",
    "Make this sentence shorter without losing its meaning: \"{0}\"",
]

# Appended to some prompts so answers vary in length and format, not only in topic.
STYLES = ["", " Keep it under 100 words.", " Use a numbered list.", " Answer in two or three sentences."]

# (template, topic list, use STYLES). Templates take one topic as {0}.
TOPIC_TEMPLATES = [
    ("Explain {0} to a beginner.", CONCEPTS, True),
    ("Explain {0} with one everyday example.", CONCEPTS, True),
    ("What are common misconceptions about {0}?", CONCEPTS, True),
    ("Summarise the key idea of {0} in one short paragraph.", CONCEPTS, False),
    ("Give me three surprising facts about {0}.", CONCEPTS, True),
    ("Why is it useful to understand {0}?", CONCEPTS, True),
    ("Describe {0} using an analogy.", CONCEPTS, False),
    ("Write four quiz questions about {0}, with answers.", CONCEPTS, False),
    ("Summarise {0} in a short paragraph.", EVENTS, True),
    ("What were the main causes of {0}?", EVENTS, True),
    ("How did {0} change daily life for ordinary people?", EVENTS, True),
    ("Write a short diary entry by someone who lived through {0}.", EVENTS, False),
    ("How do I {0}?", SKILLS, True),
    ("Give me a step-by-step guide to help me {0}.", SKILLS, True),
    ("What mistakes do beginners make when they try to {0}?", SKILLS, True),
    ("Make a short checklist for someone who wants to {0}.", SKILLS, False),
    ("Give me a simple recipe for {0}.", DISHES, True),
    ("What can I substitute in {0} if I am missing an ingredient?", DISHES, True),
    ("How can I make {0} healthier?", DISHES, True),
    ("Plan a three-day trip to {0} on a modest budget.", PLACES, True),
    ("What should a first-time visitor to {0} know?", PLACES, True),
    ("Write a short travel blog paragraph about a morning in {0}.", PLACES, False),
    ("Write a short story about {0}.", STORY_SUBJECTS, False),
    ("Write a poem about {0}.", STORY_SUBJECTS, False),
    ("Write a haiku about {0}.", STORY_SUBJECTS, False),
    ("Write a limerick about {0}.", STORY_SUBJECTS, False),
    ("Write the opening paragraph of a novel about {0}.", STORY_SUBJECTS, False),
    ("Write a short, polite email {0}.", MESSAGES, False),
    ("Write a friendly text message {0}.", MESSAGES, False),
    ("Write a formal letter {0}.", MESSAGES, False),
    ("{0}. What can I do about it?", PROBLEMS, True),
    ("A friend tells me: '{0}.' What advice could I give?", PROBLEMS, True),
    ("How does {0} work?", DEVICES, True),
    ("Explain how {0} works to a curious child.", DEVICES, False),
    ("What are the main parts of {0}, and what does each do?", DEVICES, False),
    ("Why {0}?", WHY_QUESTIONS, True),
    ("Can you explain why {0}?", WHY_QUESTIONS, False),
    ("Show how to use Python's {0} with a short example.", STDLIB, False),
    ("What does {0} do in Python, and when is it useful?", STDLIB, False),
    ("Explain {0} in Python to someone who knows another language.", STDLIB, False),
    ("Write a SQL query that {0}.", SQL_TASKS, False),
    ("Write a SQL query that {0}, and explain each clause.", SQL_TASKS, False),
    ("This Python code should {0[0]}, but it does not work. Find the bug and fix it:\n\n```python\n{0[1]}\n```",
     BUGGY_CODE, False),
    ("What does this Python code do?\n\n```python\n{0}\n```", SNIPPETS, False),
    ("Explain this Python code line by line:\n\n```python\n{0}\n```", SNIPPETS, False),
]

PAIR_TEMPLATES = [
    "Compare {0} and {1}: what are the main differences?",
    "What are the pros and cons of {0} versus {1}?",
    "When should I choose {0} over {1}?",
]

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}, and add a few tests.",
    "Write a {lang} function that {task}, and explain its time complexity.",
]

LIST_TEMPLATES = ["List {n} {x}.", "Give me {n} {x}, with one sentence on each."]

HOWTO_TEMPLATES = ["In {lang}, how do I {op}?", "Show me how to {op} in {lang}, with a short example."]


def _topic_prompts() -> list[str]:
    out = []
    for template, topics, styled in TOPIC_TEMPLATES:
        for topic in topics:
            for style in STYLES if styled else [""]:
                out.append(template.format(topic) + style)
    return out


def _pool() -> list[str]:
    """Every template-topic combination, in a fixed order (the seed shuffles it)."""
    pairs = [t.format(a, b) + style for t in PAIR_TEMPLATES for a, b in PAIRS for style in STYLES]
    code = [t.format(lang=lang, task=task) for t in CODE_TEMPLATES for lang in LANGUAGES for task in CODE_TASKS]
    lists = [t.format(n=n, x=x) for t in LIST_TEMPLATES for n in range(3, 9) for x in LISTABLES]
    howtos = [t.format(lang=lang, op=op) for t in HOWTO_TEMPLATES for lang in LANGUAGES for op in LANGUAGE_HOWTOS]
    rewrites = [t.format(x) for t in REWRITE_TEMPLATES for x in SENTENCES]
    return _topic_prompts() + pairs + code + lists + howtos + rewrites


def _ages(younger: int, gap: int) -> str:
    # The total is derived from the answer, so the problem always has a whole-number solution.
    return f"Anna is {gap} years older than Ben, and together they are {2 * younger + gap} years old. How old is each?"


def _class_size(boys: int, gap: int) -> str:
    return f"A class of {2 * boys + gap} students has {gap} more girls than boys. How many boys are there?"


def _word_problem(rng: random.Random) -> str:
    """A math word problem with random numbers; each asks for the working, so answers have some length."""
    r = rng.randint
    problems = [
        lambda: f"A train travels {r(60, 900)} km in {r(2, 9)} hours. What is its average speed?",
        lambda: f"Pens cost {r(15, 95)} cents each. How many can I buy with ${r(2, 40)}, and how much change is left?",
        lambda: f"A recipe needs {r(100, 500)} g of flour for {r(8, 24)} cookies. "
        f"How much flour do {r(25, 90)} cookies need?",
        lambda: f"A rectangular garden is {r(3, 40)} m by {r(3, 40)} m. What are its area and perimeter?",
        lambda: f"I save ${r(5, 120)} a week. How many weeks until I have ${r(500, 5000)}?",
        lambda: f"A jacket costs ${r(30, 400)} and is {r(5, 60)}% off. What is the sale price?",
        lambda: f"${r(500, 20000)} is invested at {r(1, 9)}% interest compounded yearly. "
        f"What is it worth after {r(2, 15)} years?",
        lambda: f"What is the sum of all whole numbers from 1 to {r(20, 2000)}?",
        lambda: f"A bag holds {r(2, 15)} red, {r(2, 15)} blue and {r(2, 15)} green marbles. "
        "What is the probability of drawing a blue one?",
        lambda: _ages(r(4, 40), r(2, 12)),
        lambda: f"One pipe fills a tank in {r(2, 12)} hours, another in {r(3, 15)} hours. "
        "How long do both together take?",
        lambda: f"A phone battery drops {r(3, 20)}% per hour. "
        f"Starting at {r(50, 100)}%, when does it reach {r(5, 20)}%?",
        lambda: _class_size(r(5, 18), r(1, 8)),
        lambda: f"A car uses {r(4, 12)} litres of fuel per 100 km. How much fuel does a {r(50, 1200)} km trip need?",
    ]
    return rng.choice(problems)() + " Show your working."


def normalise_prompt(prompt: str) -> str:
    # Case and spacing differences do not make an evaluation prompt a new prompt.
    return " ".join(prompt.split()).casefold()


def evaluation_prompts() -> frozenset[str]:
    """Normalised text prompts of benchmarks/prompts.jsonl (empty if the file is absent, e.g. in an installed wheel)."""
    if not EVALUATION_PROMPTS.is_file():
        return frozenset()
    out = set()
    for line in EVALUATION_PROMPTS.read_text().splitlines():
        rec = json.loads(line) if line.strip() else None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            out.add(normalise_prompt(rec["prompt"]))
    return frozenset(out)


def is_evaluation_prompt(prompt: str, evaluation: frozenset[str]) -> bool:
    return normalise_prompt(prompt) in evaluation


MATH_EVERY = 8
MAX_CONSECUTIVE_REPEATS = 10_000  # only word problems are left and they keep repeating


def builtin_prompts(num: int, seed: int = 0) -> list[str]:
    """`num` distinct training prompts, the same for the same seed; a shorter list is a prefix of a longer one."""
    if num < 0:
        raise SpecformerError(f"number of prompts must be >= 0, got {num}")
    rng = random.Random(seed)
    pool = _pool()
    rng.shuffle(pool)
    evaluation = evaluation_prompts()
    out: list[str] = []
    seen: set[str] = set()
    repeats = 0
    draws = 0
    while len(out) < num:
        draws += 1  # every MATH_EVERY-th draw is a word problem; the rest come from the shuffled pool
        p = _word_problem(rng) if draws % MATH_EVERY == 0 or not pool else pool.pop()
        if p in seen or is_evaluation_prompt(p, evaluation):
            repeats += 1
            if repeats > MAX_CONSECUTIVE_REPEATS:
                raise SpecformerError(f"cannot make {num} distinct built-in prompts; got {len(out)}")
            continue
        repeats = 0
        seen.add(p)
        out.append(p)
    return out
