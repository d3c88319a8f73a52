"""A small embedded English corpus for training the tiny checkpoints' tokenizer.

Why embedded: nothing can be downloaded where Quanta is built and tested, and the tokenizer must
come out byte-identical on every run, so its training text lives in the source tree. The text is
original, varied on purpose (prose, dialogue, numbers, lists, code, a little non-ASCII) so the
learned merges cover the shapes of text a serving benchmark sends. Changing it changes every
tiny checkpoint's vocabulary: treat it as frozen.
"""

from __future__ import annotations

CORPUS = """\
The morning train left the station at seven, as it always did, and the people on the platform
watched it go with the patience of those who know another will come. A woman in a green coat
checked her watch, then her phone, then her watch again. Somewhere a child was laughing.

Spring arrived late that year. The river was still high with melted snow, and the fields along
its banks were soft and dark. Farmers waited for the ground to dry before planting; they talked
about the weather in the shop on the corner, where coffee cost two dollars and fifty cents.

"Have you read the letter?" she asked.
"Not yet. I wanted to wait until you were here."
"Then open it now. Whatever it says, we will deal with it together."
He tore the envelope carefully, unfolded the single page, and began to read aloud.

In computing, a scheduler decides which work runs next. A good scheduler is fair to every user,
keeps the machine busy, and answers quickly when a short request arrives behind a long one. The
first-come, first-served rule is simple, but it lets one large job delay everyone else. Other
policies give each job a small slice of time and move it to a lower queue when the slice is used.

Large language models generate text one token at a time. Each new token depends on all the
tokens before it, so the model keeps a cache of keys and values for the past context. Memory for
this cache is divided into fixed-size blocks; a request that grows beyond its blocks asks for
more, and when none are free, some request must wait, be swapped to host memory, or be
recomputed later.

Recipe for a simple bread: mix 500 grams of flour, 10 grams of salt, 7 grams of yeast and 350
millilitres of warm water. Knead for ten minutes, let the dough rise for one hour, shape it, let
it rise again for 45 minutes, then bake at 220 degrees for about 30 minutes until golden brown.

Shopping list:
- eggs (a dozen)
- milk, 2 litres
- apples, pears and a few oranges
- rice, beans, tomatoes, onions and garlic
- batteries for the kitchen clock

The history of the city goes back more than a thousand years. Merchants built the first houses
near the harbour, where ships from the north brought wool, timber and salted fish. Later came the
cathedral, the university and the long stone bridge that still carries traffic across the river.
In 1848 a great fire destroyed half of the old town; it was rebuilt in brick within a decade.

Question: What is the capital of France?
Answer: Paris is the capital of France.
Question: How many days are there in a leap year?
Answer: A leap year has 366 days, one more than a common year.
Question: Why is the sky blue?
Answer: Sunlight is scattered by the molecules of the air, and blue light is scattered more
strongly than red light because its wavelength is shorter.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]

for i in range(10):
    print(i, fibonacci(i))

{"name": "example", "version": 3, "enabled": true, "tags": ["alpha", "beta"], "ratio": 0.75}

SELECT user_id, COUNT(*) AS requests FROM events WHERE day >= '2024-01-01' GROUP BY user_id;

Dear team, thank you for your hard work this quarter. We shipped three major releases, fixed
more than two hundred bugs and cut the average response time by forty percent. Please take some
time off in the coming weeks; you have earned it. Best regards, Maria.

The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. He counted
the steps out of habit: one hundred and twelve. From the top he could see the whole bay, the
fishing boats coming home, and on clear nights the lights of the town on the far shore.

Mathematics is the study of numbers, shapes and patterns. If x + 3 = 10, then x = 7. The area
of a circle with radius r is pi times r squared, roughly 3.14159 * r * r. A prime number has
exactly two divisors: 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29 are the first ten primes.

She walked through the market, past stalls of cheese and bread, olives and honey, flowers in
buckets of cold water. A man was selling old books; she bought a worn copy of a novel she had
loved as a girl, and read the first chapter standing in the sun.

Travel notes: the café in the square serves an excellent crème brûlée. Prices are in euros (€)
and the waiter said « bonjour » with a smile. Next stop: München, then Zürich and São Paulo.
Temperatures ranged from −3 °C at night to 18 °C at noon.

Why do we sleep? Scientists still debate the answer. Sleep helps the brain store memories,
clear waste and restore energy; without it, attention and mood quickly suffer. Most adults need
between seven and nine hours each night, yet many get far less.

Error: connection refused (code 111). Retrying in 5 seconds... Attempt 2 of 3. OK: connected
to server at 127.0.0.1:8000 after 2.4 s. Warning: response exceeded 4096 tokens; truncated.
"""
